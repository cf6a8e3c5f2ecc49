"""Structured outputs on a GPU (issue 15): the engine step time with the grammar bitmask
against without, on the Qwen3-0.6B shape (load_format="dummy") and W1-like requests.

    python benchmarks/structured_outputs_gpu.py --tokenizer bench-work/qwen3-0.6b-smol \
        --out benchmarks/results/<date>-structured-outputs-H200.json
    python benchmarks/structured_outputs_gpu.py --smoke --out /tmp/so.json   # CPU, tiny model

W1's requests (nano-vllm's draw: 256 requests, random ids, in/out U[100,1024], temperature
0.6) run offline four ways, each after a warm-up run:
  free-async   unconstrained, async scheduling (shoal's default on CUDA)
  free-sync    unconstrained, one step at a time
  json         every request constrained by a JSON schema whose string field never has to end,
               so requests run to max_tokens like W1's (ignore_eos) unless the JSON closes;
               one step at a time
  json-async   the same with async scheduling (the default): a constrained step's forward
               runs while the step before's tokens are applied, then its bitmask is filled
Each engine step is timed (the engine core's step, an internal), with its batch size. The
step times compared are those of steady decode steps only: every request of the step
scheduled in the call, and of the one scheduled in the call before, decodes one token, and
the step scheduled has as many rows as sampled. Prefills and the steps where a batch shrinks
are left out: the constrained requests end at different times (a JSON answer may close
early), so the runs reach a batch size at different moments. The figures: the step time at
each batch size (steady decode steps, at least 3), the ratio of step times at the batch
sizes two runs share, weighted by batch size (the comparison at matched batch sizes), the
mean and median at each run's most common batch size, the time spent filling the bitmask on
the host, and output tokens per second (wall time of the whole run).

Public figures, from the requests alone: output tok/s and each request's decode time per
token ((finished - first token) / (tokens - 1), RequestOutput.metrics), their means. Under
SHOAL_BENCH_PUBLIC_ONLY=1 (the before/after sweep) only these are taken, and only the modes
free-async and json-async (switching async scheduling on a built engine is an internal).

The dummy model has no tokenizer: SmolLM2's (49,152 tokens) stands in, with its
end-of-sequence id in the model's config: the grammar and its bitmask cover the tokenizer's
ids and the rest of Qwen3's 151,936 logits is banned as padding."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
from bench_args import REQUIRED, add_common
from offline_runs import QWEN3_06B
from results_file import record, write

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["note", "task"]},
    "text": {"type": "string"}},
    "required": ["kind", "text"]}
MODES = ("free-async", "free-sync", "json", "json-async")
ASYNC_MODES = ("free-async", "json-async")


def w1_requests(num: int, smoke: bool) -> list[tuple[list[int], int]]:
    """The W1 preset's requests (nano-vllm's draws, as `shoal bench throughput --preset W1`)."""
    from shoal.benchmarks.datasets import sample_random
    from shoal.benchmarks.presets import THROUGHPUT_PRESETS

    samples = sample_random(THROUGHPUT_PRESETS["W1"].random, num, 0)
    return [(list(s.prompt)[:32], 8) if smoke else (list(s.prompt), s.expected_output_len)
            for s in samples]


class StepTimer:
    """Wraps the engine core's step and bitmask fill to time them, and the scheduler's
    schedule to tell steady decode steps (see the module's docstring)."""

    def __init__(self, core: Any):
        self.core = core
        self.steps: list[tuple[int, float, bool]] = []  # (rows sampled, seconds, steady)
        self._step, self._schedule = core.step, core.scheduler.schedule
        self.fill = engine_internals.MethodTimers()
        # The manager (StructuredSteps.manager since the seams refactor; core.structured before)
        self.fill.wrap(getattr(core.structured, "manager", core.structured), "fill_bitmask")
        scheduled: list[tuple[int, bool]] = []  # this call's: (rows, decodes only)
        before_decodes = [False]  # the call before scheduled decodes only

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = self._schedule(*args, **kwargs)
            scheduled.append((len(out.scheduled), all(
                s.sample and s.num_new_tokens == 1 for s in out.scheduled)))
            return out

        def step() -> Any:
            scheduled.clear()
            t0 = time.perf_counter()
            out = self._step()
            dt = time.perf_counter() - t0
            rows = sum(len(o.new_token_ids) for o in out.outputs)
            decodes = bool(scheduled) and all(d for _, d in scheduled)
            steady = (decodes and before_decodes[0] and len(scheduled) == 1
                      and scheduled[0][0] == rows)
            before_decodes[0] = decodes
            self.steps.append((rows, dt, steady))
            return out

        core.step, core.scheduler.schedule = step, schedule

    def restore(self) -> None:
        self.core.step = self._step
        del self.core.scheduler.schedule  # the class's method again
        self.fill.restore()

    def figures(self) -> dict[str, Any]:
        steady = [(n, dt) for n, dt, ok in self.steps if ok and n]
        if not steady:  # a smoke run may have none
            steady = [(n, dt) for n, dt, _ in self.steps if n]
        batch, _ = Counter(n for n, _ in steady).most_common(1)[0]
        at_batch = [dt for n, dt in steady if n == batch]
        by_batch: dict[int, list[float]] = {}
        for n, dt in steady:
            by_batch.setdefault(n, []).append(dt)
        return {"step_ms_by_batch": {n: round(1e3 * statistics.fmean(v), 3)
                                     for n, v in sorted(by_batch.items()) if len(v) >= 3},
                "steps": len(self.steps), "steady_decode_steps": len(steady),
                "common_batch": batch,
                "mean_step_ms_at_common_batch": round(1e3 * statistics.fmean(at_batch), 3),
                "median_step_ms_at_common_batch": round(1e3 * statistics.median(at_batch), 3),
                "bitmask_fill_ms_per_step": round(1e3 * sum(self.fill.calls["fill_bitmask"])
                                                  / max(len(self.steps), 1), 3)}


def run(llm: Any, requests: list[tuple[list[int], int]], mode: str) -> dict[str, Any]:
    from shoal import SamplingParams

    core = engine_internals.core(llm)
    async_default = core.async_scheduling if core is not None else None
    if core is not None:
        core.async_scheduling = async_default and mode in ASYNC_MODES
    so = {"json": SCHEMA, "disable_any_whitespace": True} if mode.startswith("json") else None
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True,
                             structured_outputs=so) for _, n in requests]
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    timer = StepTimer(core) if core is not None else None
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        if timer is not None:
            timer.restore()
            core.async_scheduling = async_default
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    per_token = [(m.finished_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1)
                 for o in outs if (m := o.metrics) is not None and m.finished_time is not None
                 and m.first_token_time is not None and len(o.outputs[0].token_ids) > 1]
    return {"mode": mode, "requests": len(requests), "output_tokens": tokens,
            "seconds": round(wall, 3), "output_tok_per_s": round(tokens / wall, 1),
            "request_decode_ms_per_token_mean":
                round(1e3 * statistics.fmean(per_token), 3) if per_token else None,
            **(timer.figures() if timer is not None else {}),
            "finish_reasons": dict(Counter(o.outputs[0].finish_reason for o in outs))}


def matched_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Mean over the batch sizes both runs timed (>= 3 steps each) of a's step time over b's,
    weighted by batch size."""
    pa, pb = a.get("step_ms_by_batch"), b.get("step_ms_by_batch")
    common = [n for n in pa or {} if n in (pb or {})]
    if not common:
        return None
    return round(sum(n * pa[n] / pb[n] for n in common) / sum(common), 3)


def ratio(results: dict[str, dict], a: str, b: str, key: str) -> float | None:
    x, y = results.get(a, {}).get(key), results.get(b, {}).get(key)
    return round(x / y, 3) if x and y else None


def qwen3_with_tokenizer_eos(tokenizer: str, smoke: bool) -> str:
    """A folder with Qwen3-0.6B's config (--smoke: a 2-layer Llama of the same vocabulary)
    whose end-of-sequence id is the stand-in tokenizer's (Qwen3's own, 151645, lies past
    SmolLM2's 49,152 ids: the grammar's vocabulary would have to reach it)."""
    folder = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-"))
    try:  # a tokenizer folder made by export_hf_folder.py names its eos in config.json
        eos = int(json.loads(Path(tokenizer, "config.json").read_text())["eos_token_id"])
    except (OSError, KeyError, ValueError, TypeError):
        from shoal.loader.tokenizers import load_tokenizer  # a name: shoal resolves it

        eos = load_tokenizer(tokenizer).eos_token_id
    cfg = json.loads((offline_runs.shipped_folder(QWEN3_06B) / "config.json").read_text())
    if smoke:
        return offline_runs.tiny_llama(folder, vocab=cfg["vocab_size"], eos=eos)
    (folder / "config.json").write_text(json.dumps(cfg | {"eos_token_id": eos}))
    return str(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, out=REQUIRED, num_requests=256, device=None,
               smoke="a 2-layer model on the CPU, 8 short requests")
    p.add_argument("--tokenizer", default="smollm2",
                   help="SmolLM2's tokenizer: the embedded model's name, or a folder with it")
    ns = p.parse_args()
    if ns.smoke:
        ns.device, ns.num_requests = ns.device or "cpu", 8
    cpu = ns.device == "cpu"
    eng = offline_runs.start_engine(
        qwen3_with_tokenizer_eos(ns.tokenizer, ns.smoke), load_format="dummy",
        tokenizer=ns.tokenizer, dtype="float32" if cpu else "bfloat16", device=ns.device,
        max_model_len=2048 + 64, enable_prefix_caching=False,
        **({"async_scheduling": True} if engine_internals.public_only() else {}),
        **({"kv_cache_memory_bytes": 1 << 30} if cpu else {}))
    requests = w1_requests(ns.num_requests, ns.smoke)
    warm = requests[: max(4, ns.num_requests // 16)]
    modes = ASYNC_MODES if engine_internals.public_only() else MODES
    results = {}
    for mode in modes:
        run(eng.llm, warm, mode)  # compiles the grammar, warms kernels for this mode
        results[mode] = run(eng.llm, requests, mode)
        print({k: v for k, v in results[mode].items() if k != "step_ms_by_batch"}, flush=True)
    figures = {
        "runs": results, "ready_s": eng.ready_s, "public_only": engine_internals.public_only(),
        # Requests under a grammar end at different times than W1's, so the runs' batch sizes
        # differ: compare steady decode step times at the batch sizes both runs have.
        "json_over_free_sync_at_matched_batches": matched_ratio(
            results.get("json", {}), results.get("free-sync", {})),
        "json_over_free_async_at_matched_batches": matched_ratio(
            results.get("json", {}), results.get("free-async", {})),
        "json_step_over_free_sync": ratio(results, "json", "free-sync",
                                          "mean_step_ms_at_common_batch"),
        "json_step_over_free_async": ratio(results, "json", "free-async",
                                           "mean_step_ms_at_common_batch"),
        "json_tok_per_s_over_free_async": ratio(results, "json", "free-async",
                                                "output_tok_per_s"),
        "json_async_over_free_async_at_matched_batches": matched_ratio(
            results["json-async"], results["free-async"]),
        "json_async_tok_per_s_over_free_async": ratio(results, "json-async", "free-async",
                                                      "output_tok_per_s"),
        "json_async_request_decode_ms_over_free_async": ratio(
            results, "json-async", "free-async", "request_decode_ms_per_token_mean"),
        "note": "json: constrained, one step at a time (against free-sync: the bitmask's own "
                "cost); json-async: constrained, async scheduling (against free-async: the "
                "default)",
    }
    print({k: v for k, v in figures.items() if k != "runs"}, flush=True)
    write([record("structured-outputs-W1-json", "shoal", smoke=ns.smoke, **figures)], ns.out)
    eng.llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
