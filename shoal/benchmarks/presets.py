"""The workloads of BENCHMARKS.md as presets for `shoal bench serve | throughput | latency`.

A preset fixes the requests (count, length ranges, token ids, sampling); flags given on the
command line still override the count (`--num-prompts`), `--temperature`, `--max-concurrency`
and, for the offline commands, engine flags given with a non-default value.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any

from shoal.benchmarks.datasets import RandomSpec


@dataclass(frozen=True)
class Preset:
    description: str
    num_prompts: int = 1
    random: RandomSpec | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    max_concurrency: int | None = None  # serve only
    engine: dict[str, Any] = field(default_factory=dict)  # throughput / latency only
    batch_size: int = 1  # latency only
    input_len: int = 0  # latency only
    output_len: int = 0  # latency only


# W1 (and W8's requests): the nano-vllm bench.
# nano-vllm draws ids with randint(0, 10000), both ends included: [0, 10001).
_W1_REQUESTS = RandomSpec((100, 1024), (100, 1024), token_range=(0, 10001), token_ids=True,
                          nano_vllm_draws=True)
_W1 = Preset("W1: 256 requests, random ids in [0,10000), in/out U[100,1024], ignore_eos, "
             "temperature 0.6", num_prompts=256, random=_W1_REQUESTS, temperature=0.6)

SERVE_PRESETS: dict[str, Preset] = {
    "W1": _W1,
    "W4": Preset("W4 on the CPU: 64 requests, 256 in / 64 out, random ids in [100,10000), "
                 "greedy, ignore_eos", num_prompts=64,
                 random=RandomSpec((256, 256), (64, 64), token_range=(100, 10000),
                                   token_ids=True)),
    "W4-gpu": Preset("W4 on a GPU: 500 requests, 1024 in / 256 out, random ids in "
                     "[100,10000), greedy, ignore_eos", num_prompts=500,
                     random=RandomSpec((1024, 1024), (256, 256), token_range=(100, 10000),
                                       token_ids=True)),
    "W8": replace(_W1, description="W8: the W1 requests from 256 concurrent clients",
                  max_concurrency=256),
}

THROUGHPUT_PRESETS: dict[str, Preset] = {
    "W4": replace(SERVE_PRESETS["W4"], description="W4's requests offline (the serve/offline "
                  "ratio on the CPU)"),
    "W1": replace(_W1, engine={"model": "Qwen/Qwen3-0.6B", "load_format": "dummy",
                               "dtype": "bfloat16"}),
    "W6": Preset("W6: SmolLM2-135M, 64 requests, random ids in [0,49000), in U[100,512], "
                 "out U[64,256], ignore_eos, greedy", num_prompts=64,
                 random=RandomSpec((100, 512), (64, 256), token_range=(0, 49000),
                                   token_ids=True)),
    "W8": replace(_W1, description="W8 offline side: the W1 requests, prefix caching off "
                  "(pass the W8 model with --model)",
                  engine={"enable_prefix_caching": False, "dtype": "bfloat16"}),
    # Was benchmarks/pp_microbatch_cpu.py: run it with --pipeline-parallel-size 2 and 1.
    "pp-cpu": Preset("pipeline-parallel micro-batching on the CPU: SmolLM2-135M, 32 requests "
                     "of 128 random ids in [0,49000), 64 out, greedy, ignore_eos",
                     num_prompts=32, random=RandomSpec((128, 128), (64, 64),
                                                       token_range=(0, 49000), token_ids=True),
                     engine={"max_model_len": 512}),
    # Was benchmarks/gpu_suite.py w3 (max_num_seqs 256 is the GPU default).
    "W3": Preset("W3: Llama-3.1-8B shape, random bf16 weights, 1024 requests of random ids in "
                 "[0,128000), 1000 in / 1000 out, greedy, ignore_eos", num_prompts=1024,
                 random=RandomSpec((1000, 1000), (1000, 1000), token_range=(0, 128000),
                                   token_ids=True),
                 engine={"model": "meta-llama/Llama-3.1-8B", "load_format": "dummy",
                         "dtype": "bfloat16", "max_model_len": 2048}),
}

LATENCY_PRESETS: dict[str, Preset] = {
    "W2": Preset("W2: Llama-3.1-8B shape, random bf16 weights, batch 1, 128 in / 256 out, "
                 "greedy", engine={"model": "meta-llama/Llama-3.1-8B", "load_format": "dummy",
                                   "dtype": "bfloat16"}, input_len=128, output_len=256),
    "W6": Preset("W6 batch 1: SmolLM2-135M, 128 in / 128 out, greedy", input_len=128,
                 output_len=128),
}


def describe(presets: dict[str, Preset]) -> str:
    return "; ".join(p.description for p in presets.values())


def apply_serve_preset(ns: argparse.Namespace) -> Preset | None:
    if not getattr(ns, "preset", None):
        return None
    preset = SERVE_PRESETS[ns.preset]
    if ns.dataset_name != "random":
        raise ValueError(f"--preset {ns.preset} uses the random dataset, not {ns.dataset_name}")
    if ns.num_prompts is None:
        ns.num_prompts = preset.num_prompts
    if ns.temperature is None:
        ns.temperature = preset.temperature
    if ns.max_concurrency is None:
        ns.max_concurrency = preset.max_concurrency
    ns.ignore_eos = ns.ignore_eos or preset.ignore_eos
    return preset


def apply_engine_preset(ns: argparse.Namespace, preset: Preset,
                        engine_defaults: dict[str, Any]) -> None:
    """Set the preset's engine arguments where the flag still has its default value."""
    for name, value in preset.engine.items():
        if getattr(ns, name, None) == engine_defaults.get(name):
            setattr(ns, name, value)
