"""`shoal bench throughput`: offline throughput through `shoal.LLM`, as `vllm bench throughput`.

All requests go to one `LLM.generate` call; the figure is wall time over that call. Requests
come from the same datasets as `bench serve` (random by default, 1024 in / 128 out, as vLLM);
`--preset W1|W6|W8` gives the BENCHMARKS.md workloads. `--num-runs 2` repeats the same
generate in the same process, which shows warm-up that real traffic still pays (W1's first
run against its second).

    shoal bench throughput --preset W6 --output-json results/w6.json
    shoal bench throughput --input-len 256 --output-len 64 --num-prompts 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from shoal.benchmarks.datasets import add_dataset_flags, get_samples
from shoal.benchmarks.offline_common import add_common_flags, apply_preset, make_llm, record, save
from shoal.benchmarks.presets import THROUGHPUT_PRESETS


def add_flags(p: argparse.ArgumentParser) -> None:
    add_dataset_flags(p, with_seed=False)  # --seed is the engine's, and seeds the dataset too
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested output lengths (default on, as vLLM)")
    p.add_argument("--num-runs", type=int, default=1,
                   help="repeat the timed generate (the last run is the headline figure)")
    add_common_flags(p, THROUGHPUT_PRESETS)


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from shoal.sampling_params import SamplingParams

    preset = apply_preset(ns, THROUGHPUT_PRESETS)
    if preset is not None and ns.num_prompts is None:
        ns.num_prompts = preset.num_prompts
    if ns.num_runs < 1:
        raise ValueError("--num-runs must be >= 1")
    llm = make_llm(ns)
    tokenizer = None if ns.token_id_prompts or preset is not None else llm.get_tokenizer()
    samples = get_samples(ns, tokenizer, preset.random if preset else None)
    prompts = [{"prompt_token_ids": s.prompt} if isinstance(s.prompt, list) else s.prompt
               for s in samples]
    params = [SamplingParams(n=ns.n, temperature=ns.temperature, top_p=ns.top_p,
                             ignore_eos=ns.ignore_eos, max_tokens=s.expected_output_len)
              for s in samples]
    runs = []
    for i in range(ns.num_runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=not ns.disable_tqdm)
        elapsed = time.perf_counter() - start
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
        runs.append({"elapsed_time": elapsed, "num_requests": len(outs),
                     "total_num_tokens": n_in + n_out, "total_input_tokens": n_in,
                     "total_output_tokens": n_out,
                     "requests_per_second": len(outs) / elapsed,
                     "tokens_per_second": (n_in + n_out) / elapsed,
                     "output_tokens_per_second": n_out / elapsed})
        r = runs[-1]
        print(f"run {i + 1}/{ns.num_runs}: Throughput: {r['requests_per_second']:.2f} "
              f"requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
              f"{r['output_tokens_per_second']:.2f} output tokens/s")
    last = runs[-1]
    print(f"Total num prompt tokens:  {last['total_input_tokens']}")
    print(f"Total num output tokens:  {last['total_output_tokens']}")
    result = record(ns, "throughput", {**last, "runs": runs, "dataset_name": ns.dataset_name,
                                       "temperature": ns.temperature, "n": ns.n,
                                       "ignore_eos": ns.ignore_eos})
    save(ns.output_json, result)
    return result


def main(ns: argparse.Namespace) -> int:
    run(ns)
    return 0
