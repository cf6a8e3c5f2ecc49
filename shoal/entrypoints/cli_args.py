"""Command-line flags with vLLM's names, turned into EngineArgs and ServerSettings."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from shoal.engine.engine_args import EngineArgs

# (flag, EngineArgs field, type, help); booleans get --x/--no-x.
ENGINE_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--tokenizer", "tokenizer", str, "tokenizer source (known name, .gguf file or folder)"),
    ("--dtype", "dtype", str, "auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, ..."),
    ("--max-model-len", "max_model_len", int, "context length (default: the model's)"),
    ("--max-num-seqs", "max_num_seqs", int, "sequences per step (default 256 GPU, 64 CPU)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget per step"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float,
     "fraction of device memory for weights and KV cache"),
    ("--kv-cache-memory-bytes", "kv_cache_memory_bytes", int, "KV-cache size in bytes"),
    ("--num-gpu-blocks-override", "num_gpu_blocks_override", int, "exact number of KV blocks"),
    ("--block-size", "block_size", int, "tokens per KV block"),
    ("--enable-prefix-caching", "enable_prefix_caching", bool, "reuse KV blocks of prefixes"),
    ("--enable-chunked-prefill", "enable_chunked_prefill", bool, "split long prefills"),
    ("--tensor-parallel-size", "tensor_parallel_size", int, "GPUs per model (1 for now)"),
    ("--seed", "seed", int, "random seed"),
    ("--load-format", "load_format", str, "auto, gguf, safetensors or dummy (random weights)"),
    ("--device", "device", str, "cpu or cuda (default: cuda when available)"),
    ("--enforce-eager", "enforce_eager", bool, "no CUDA graphs"),
    ("--async-scheduling", "async_scheduling", bool,
     "schedule the next step while the GPU runs this one (default: on with CUDA)"),
    ("--scheduling-policy", "scheduling_policy", str, "fcfs or priority"),
    ("--max-waiting-requests", "max_waiting_requests", int,
     "answer 503 with Retry-After when more sequences than this would wait"),
    ("--kv-offloading-size", "kv_offloading_size", float,
     "GiB of CPU memory for offloaded KV blocks (default: off)"),
    ("--kv-offloading-disk-path", "kv_offloading_disk_path", str,
     "folder for a disk KV tier below the CPU tier (needs --kv-offloading-size)"),
    ("--kv-offloading-disk-size", "kv_offloading_disk_size", float, "GiB for the disk KV tier"),
    ("--kv-offloading-policy", "kv_offloading_policy", str,
     "eviction policy of the KV tiers: lru, arc or pkg.module:Class"),
]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    for flag, name, typ, help_text in ENGINE_FLAGS:
        default = defaults[name]
        if typ is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=typ, default=default,
                                help=f"{help_text} (default: {default})")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {name: getattr(ns, name) for _, name, _, _ in ENGINE_FLAGS}
    return EngineArgs(model=getattr(ns, "model", None), **kwargs)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model name, .gguf file or folder (default: embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on every route but /health")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) clients use (the first one is reported)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGTERM")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_engine_flags(parser)


def server_settings_from(ns: argparse.Namespace) -> Any:
    from shoal.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, ServerSettings

    names = ns.served_model_name or [ns.model or DEFAULT_MODEL_NAME]
    return ServerSettings(host=ns.host, port=ns.port, api_key=ns.api_key,
                          served_model_names=names, shutdown_timeout=ns.shutdown_timeout,
                          log_level=ns.uvicorn_log_level,
                          access_log=not ns.disable_uvicorn_access_log)
