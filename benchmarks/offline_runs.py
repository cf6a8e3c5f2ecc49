"""Offline measurements the GPU scripts share, through shoal's public API only (`shoal.LLM`,
`SamplingParams`, `RequestOutput` and its metrics), so that one script measures an older
tree and a refactored one the same way (the before/after sweep of gpu_run.sh --trees).

- start_engine: LLM(...) with its ready time, and the time from process start to ready (W7);
- w1_requests / throughput: W1's requests (gpu_suite's draw: 144,160 output tokens at seed 0)
  and output tok/s of one generate over them;
- batch1: batch-1 decode rate, TTFT taken apart (W2, W10's batch 1).
torch is imported lazily (sync only), so the scripts parse their flags without it."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results_file import shoal_source

LLAMA_8B = "meta-llama/Llama-3.1-8B"
QWEN3_06B = "Qwen/Qwen3-0.6B"
DEEPSEEK_V2_LITE = "deepseek-ai/DeepSeek-V2-Lite"
# H200 copy bandwidth (BENCHMARKS.md): the roofline of a decode step that streams weights.
COPY_BANDWIDTH = 4.25e12
# Device-to-device copy bandwidth (bytes read + written) measured on the lent machines
# (.library/device/KINDS.md), by the name torch gives the GPU: a roofline must use the card
# that ran, or an H100 run reads 1.4x too far from its floor.
COPY_BANDWIDTH_BY_GPU = {"H200": 4.25e12, "H100": 3.0e12}


def copy_bandwidth() -> float:
    """The copy bandwidth of this process's GPU (COPY_BANDWIDTH, the H200's, where the card
    is not in the table or there is no GPU: smoke runs)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in COPY_BANDWIDTH_BY_GPU.items():
            if key in name:
                return value
    return COPY_BANDWIDTH
# The shipped shapes (shoal/model_configs/<folder>/config.json) of the names above.
SHIPPED_CONFIGS = {LLAMA_8B: "llama-3.1-8b", QWEN3_06B: "qwen3-0.6b",
                   DEEPSEEK_V2_LITE: "deepseek-v2-lite", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b"}


def process_start_time() -> float | None:
    """Wall-clock time this process started: SHOAL_PROCESS_START (set by a shell before it
    started python), else the kernel's start time in /proc (before the interpreter began),
    in clock ticks since boot: its age is CLOCK_BOOTTIME now less that (10 ms resolution)."""
    env = os.environ.get("SHOAL_PROCESS_START")
    if env:
        return float(env)
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class Engine:
    llm: Any
    ready_s: float  # LLM(...) alone
    process_ready_s: float | None  # process start to ready: imports and CUDA start included


def start_engine(model: str | None, **engine_kw: Any) -> Engine:
    from shoal import LLM

    t0 = time.perf_counter()
    llm = LLM(model, **engine_kw)
    ready = time.perf_counter() - t0
    start = process_start_time()
    print(f"engine ready in {ready:.1f} s", flush=True)
    return Engine(llm, ready, time.time() - start if start is not None else None)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_prompt(rng: random.Random, n: int, hi: int, lo: int = 0) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(lo, hi) for _ in range(n)]}


def shipped_folder(model: str) -> Path:
    """A model folder as given, or the folder of a shipped shape's config.json in the shoal
    tree that `import shoal` would load (a data file, not an engine API)."""
    if Path(model, "config.json").exists() or model not in SHIPPED_CONFIGS:
        return Path(model)
    tree = shoal_source()
    return Path(tree, "shoal", "model_configs", SHIPPED_CONFIGS[model]) if tree else Path(model)


def config_vocab_size(model: str) -> int | None:
    """The vocabulary of a model folder or shipped shape, from its config.json; None when
    there is none."""
    folder = shipped_folder(model)
    try:
        return int(json.loads((folder / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError):
        return None


def w1_requests(n: int, hi: int = 10000, seed: int = 0, in_range: tuple[int, int] = (100, 1024),
                out_range: tuple[int, int] = (100, 1024), temperature: float = 0.6
                ) -> tuple[list[dict], list[Any], list[int], list[int]]:
    """W1: n prompts of random ids in [0, hi), lengths U[in_range] / U[out_range], ignore_eos;
    returns prompts, sampling params, input and output lengths."""
    from shoal import SamplingParams

    rng = random.Random(seed)
    ins = [rng.randint(*in_range) for _ in range(n)]
    outs = [rng.randint(*out_range) for _ in range(n)]
    prompts = [random_prompt(rng, i, hi) for i in ins]
    params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True)
              for o in outs]
    return prompts, params, ins, outs


def throughput(llm: Any, prompts: list[dict], params: Any, runs: int = 1) -> dict[str, Any]:
    """Output tok/s of one generate over all requests (after a 4-request warm-up), `runs`
    times in a row: the last run is the headline figure, the first shows warm-up."""
    llm.generate(prompts[:4], params[:4] if isinstance(params, list) else params,
                 use_tqdm=False)
    per_run = []
    for _ in range(runs):
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        total = sum(len(r.outputs[0].token_ids) for r in res)
        per_run.append({"total_output_tokens": total, "elapsed_s": dt, "output_tok_s": total / dt})
    out = dict(per_run[-1])
    if runs > 1:
        out["runs_output_tok_s"] = [r["output_tok_s"] for r in per_run]
    return out


def batch1(llm: Any, hi: int, input_len: int, output_len: int, runs: int = 3, seed: int = 0,
           repeat_prompt: bool = False) -> dict[str, Any]:
    """Batch-1 decode: TTFT from a separate 1-token request, decode = (n - 1) / (total -
    TTFT), the median run of `runs` by total time, plus the engine's own TTFT and decode rate
    (RequestOutput.metrics). repeat_prompt: every run reuses one prompt (gpu_suite w2 as it
    always did; its prefill then hits the prefix cache), else a fresh prompt per run."""
    from shoal import SamplingParams

    rng = random.Random(seed)
    fixed = random_prompt(rng, input_len, hi) if repeat_prompt else None
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(random_prompt(rng, input_len, hi), full, use_tqdm=False)  # warm
    rows, first_ids = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        llm.generate(random_prompt(rng, input_len, hi), first, use_tqdm=False)
        ttft = time.perf_counter() - t0
        prompt = fixed or random_prompt(rng, input_len, hi)
        t0 = time.perf_counter()
        out = llm.generate(prompt, full, use_tqdm=False)[0]
        total = time.perf_counter() - t0
        n, m = len(out.outputs[0].token_ids), out.metrics
        first_ids = first_ids or list(out.outputs[0].token_ids[:32])
        eng_ttft = eng_decode = None
        if m is not None and m.first_token_time is not None and m.finished_time is not None:
            eng_ttft = m.first_token_time - m.arrival_time
            span = m.finished_time - m.first_token_time
            eng_decode = (n - 1) / span if span > 0 else None
        rows.append((total, ttft, n, eng_ttft, eng_decode, out.num_cached_tokens))
    total, ttft, n, eng_ttft, eng_decode, cached = sorted(rows, key=lambda r: r[0])[len(rows) // 2]
    # None where the TTFT probe outlasted the whole run (a smoke run on a busy CPU)
    decode = (n - 1) / (total - ttft) if total > ttft and n > 1 else None
    return dict(output_tokens=n, runs=len(rows), output_tok_s=n / total, decode_tok_s=decode,
                ttft_s=ttft, step_ms=1000 / decode if decode else None, total_s=total,
                engine_ttft_s=eng_ttft,
                engine_decode_tok_s=eng_decode, num_cached_tokens=cached,
                all_runs_total_s=[r[0] for r in rows], all_runs_ttft_s=[r[1] for r in rows],
                first_run_token_ids=first_ids)  # (greedy: equal across switches that keep math)


def tiny_llama(folder: Path, vocab: int = 512, eos: int = 2) -> str:
    """A 2-layer, 64-wide Llama config (load_format="dummy"): the scripts' --smoke model."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "bos_token_id": 1, "eos_token_id": eos, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)
