"""Structured outputs on a GPU (issue 15): the engine step time with the grammar bitmask
against without, on the Qwen3-0.6B shape (load_format="dummy") and W1-like requests.

    python benchmarks/structured_outputs_gpu.py --out benchmarks/results/<date>-so-H200.json
    python benchmarks/structured_outputs_gpu.py --smoke --device cpu   # a check of the script

W1's requests (nano-vllm's draw: 256 requests, random ids, in/out U[100,1024], temperature
0.6) run offline three ways, each after a warm-up run:
  free-async   unconstrained, async scheduling (shoal's default on CUDA)
  free-sync    unconstrained, one step at a time (what a structured request forced before they were pipelined)
  json         every request constrained by a JSON schema whose string field never has to end,
               so requests run to max_tokens like W1's (ignore_eos); one step at a time
  json-async   the same with async scheduling (the default): a constrained step's forward
               runs while the step before's tokens are applied, then its bitmask is filled
               and it samples (since 2026-12-04; the runs before compared json, one step at
               a time, with free-async)
Each engine step is timed (EngineCore.step), with its batch size (the rows that sampled). The
step times compared are those of steady decode steps only: every request of the step
scheduled in the call, and of the one scheduled in the call before (whose results an
async-scheduled call applies), decodes one token (no prefill chunk), and the step scheduled
has as many rows as sampled (no request ended in between). The 256 prompts' prefills (the
first steps, at growing batch sizes) and the steps where a batch shrinks are left out: W1's
requests and the grammar-constrained ones end at different times (a JSON answer may close
early), so the runs reach a batch size at different moments, and a mean over all steps of a
batch size would mix 10 ms prefill steps of one run with decode steps of the other. The
figures: the step time at each batch size (steady decode steps, at least 3), the ratio of
step times at the batch sizes two runs share, weighted by batch size (the comparison at
matched batch sizes), the mean and median at each run's most common batch size (these are
different sizes for different runs: json_step_over_* compare those, not like with like), the
time spent filling the bitmask on the host (per step, every step), and output tokens per
second (wall time of the whole run). Until 2026-12-04 every step counted. The dummy model
has no tokenizer: SmolLM2's
(49,152 tokens) stands in, with its end-of-sequence id in the model's config: the grammar and
its bitmask cover the tokenizer's ids and the rest of Qwen3's 151,936 logits is banned as
padding (a real Qwen3 tokenizer names 151,669 ids: its bitmask would be 3x wider)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["note", "task"]},
    "text": {"type": "string"}},
    "required": ["kind", "text"]}


def w1_requests(num: int, seed: int, smoke: bool) -> list[tuple[list[int], int]]:
    from shoal.benchmarks.datasets import sample_random
    from shoal.benchmarks.presets import THROUGHPUT_PRESETS

    spec = THROUGHPUT_PRESETS["W1"].random
    samples = sample_random(spec, num, seed)
    out = []
    for s in samples:
        ids, n_out = list(s.prompt), s.expected_output_len
        if smoke:
            ids, n_out = ids[:32], 8
        out.append((ids, n_out))
    return out


class StepTimer:
    """Wraps EngineCore.step and the bitmask fill (StructuredOutputManager) to time them, and
    the scheduler's schedule to tell steady decode steps (see the module's docstring)."""

    def __init__(self, core: Any):
        self.core = core
        self.manager = core.structured
        # (rows that sampled, seconds, steady decode step)
        self.steps: list[tuple[int, float, bool]] = []
        self.fill_seconds = 0.0
        self._step, self._fill = core.step, core.structured.fill_bitmask
        self._schedule = core.scheduler.schedule
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

        def fill(grammars: Any, *drafts: Any) -> Any:
            t0 = time.perf_counter()
            res = self._fill(grammars, *drafts)
            self.fill_seconds += time.perf_counter() - t0
            return res

        core.step, self.manager.fill_bitmask = step, fill
        core.scheduler.schedule = schedule

    def restore(self) -> None:
        self.core.step, self.manager.fill_bitmask = self._step, self._fill
        del self.core.scheduler.schedule  # the class's method again


MODES = ("free-async", "free-sync", "json", "json-async")
ASYNC_MODES = ("free-async", "json-async")


def run(llm: Any, requests: list[tuple[list[int], int]], mode: str) -> dict[str, Any]:
    from shoal import SamplingParams
    from shoal.structured_output.params import StructuredOutputsParams

    core = llm.llm_engine.core
    async_default = core.async_scheduling
    core.async_scheduling = async_default and mode in ASYNC_MODES
    so = (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
          if mode.startswith("json") else None)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True,
                             structured_outputs=so) for _, n in requests]
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    timer = StepTimer(core)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        timer.restore()
        core.async_scheduling = async_default
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steady = [(n, dt) for n, dt, ok in timer.steps if ok and n]
    if not steady:  # a smoke run may have none
        steady = [(n, dt) for n, dt, _ in timer.steps if n]
    sizes = Counter(n for n, _ in steady)
    batch, _ = sizes.most_common(1)[0]
    at_batch = [dt for n, dt in steady if n == batch]
    by_batch: dict[int, list[float]] = {}
    for n, dt in steady:
        by_batch.setdefault(n, []).append(dt)
    return {"mode": mode, "requests": len(requests), "output_tokens": tokens,
            "step_ms_by_batch": {n: round(1e3 * statistics.fmean(v), 3)
                                 for n, v in sorted(by_batch.items()) if len(v) >= 3},
            "seconds": round(wall, 3), "output_tok_per_s": round(tokens / wall, 1),
            "steps": len(timer.steps), "steady_decode_steps": len(steady),
            "common_batch": batch,
            "mean_step_ms_at_common_batch": round(1e3 * statistics.fmean(at_batch), 3),
            "median_step_ms_at_common_batch": round(1e3 * statistics.median(at_batch), 3),
            "bitmask_fill_ms_per_step": round(1e3 * timer.fill_seconds
                                              / max(len(timer.steps), 1), 3),
            "finish_reasons": dict(Counter(o.outputs[0].finish_reason for o in outs))}


def matched_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Mean over the batch sizes both runs timed (>= 3 steps each) of a's step time over b's,
    weighted by batch size."""
    pa, pb = a["step_ms_by_batch"], b["step_ms_by_batch"]
    common = [n for n in pa if n in pb]
    if not common:
        return None
    return round(sum(n * pa[n] / pb[n] for n in common) / sum(common), 3)


def qwen3_with_tokenizer_eos(tokenizer: str) -> str:
    """A folder with Qwen3-0.6B's config whose end-of-sequence id is the stand-in tokenizer's
    (Qwen3's own, 151645, lies past SmolLM2's 49,152 ids: the grammar's vocabulary would have
    to reach it, over 100k ids no real tokenizer leaves unnamed)."""
    import json
    import tempfile

    from shoal.loader.resolve import _CONFIGS_DIR
    from shoal.loader.tokenizers import load_tokenizer

    tok = load_tokenizer(tokenizer)
    cfg = json.loads((_CONFIGS_DIR / "qwen3-0.6b" / "config.json").read_text())
    cfg["eos_token_id"] = tok.eos_token_id
    folder = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--smoke", action="store_true", help="short requests (a script check)")
    p.add_argument("--tokenizer", default="smollm2",
                   help="SmolLM2's tokenizer: the embedded model's name, or a folder with it")
    ns = p.parse_args()
    from gpu_common import record, write

    from shoal import LLM

    num = 8 if ns.smoke else ns.num_prompts
    llm = LLM(model=qwen3_with_tokenizer_eos(ns.tokenizer), load_format="dummy",
              tokenizer=ns.tokenizer,
              dtype="bfloat16" if ns.device != "cpu" else "float32", device=ns.device,
              max_model_len=2048 + 64, enable_prefix_caching=False,
              **({"kv_cache_memory_bytes": 1 << 30} if ns.device == "cpu" else {}))
    requests = w1_requests(num, 0, ns.smoke)
    warm = requests[: max(4, num // 16)]
    results = {}
    for mode in MODES:
        run(llm, warm, mode)  # compiles the grammar, warms kernels for this mode
        results[mode] = run(llm, requests, mode)
        print({k: v for k, v in results[mode].items() if k != "step_ms_by_batch"}, flush=True)
    json_ms = results["json"]["mean_step_ms_at_common_batch"]
    figures = {
        "runs": results,
        # Requests under a grammar end at different times than W1's, so the runs' batch sizes
        # differ: compare steady decode step times at the batch sizes both runs have.
        "json_over_free_sync_at_matched_batches": matched_ratio(results["json"],
                                                                results["free-sync"]),
        "json_over_free_async_at_matched_batches": matched_ratio(results["json"],
                                                                 results["free-async"]),
        "json_step_over_free_sync": round(
            json_ms / results["free-sync"]["mean_step_ms_at_common_batch"], 3),
        "json_step_over_free_async": round(
            json_ms / results["free-async"]["mean_step_ms_at_common_batch"], 3),
        "json_tok_per_s_over_free_async": round(
            results["json"]["output_tok_per_s"] / results["free-async"]["output_tok_per_s"], 3),
        "note": "json: constrained, one step at a time (against free-sync: the bitmask's own "
                "cost); json-async: constrained, async scheduling (against free-async: the "
                "default)",
    }
    figures["json_async_over_free_async_at_matched_batches"] = matched_ratio(
        results["json-async"], results["free-async"])
    figures["json_async_tok_per_s_over_free_async"] = round(
        results["json-async"]["output_tok_per_s"] / results["free-async"]["output_tok_per_s"], 3)
    print({k: v for k, v in figures.items() if k != "runs"}, flush=True)
    write([record("structured-outputs-W1-json", "shoal", smoke=ns.smoke, **figures)], ns.out)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
