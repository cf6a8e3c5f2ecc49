"""Two-rank tensor parallelism on the CPU: a function run on two spawned processes joined by
gloo into one tensor-parallel group, and the last-position logits of a fixed prompt through a
model built on whatever group is set up (world size 1 when none is)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.attention.metadata import build_attention_metadata
from shoal.distributed.parallel_state import init_tensor_parallel, reset_tensor_parallel
from shoal.loader import load_model
from shoal.models.registry import resolve_model_class

PROMPT = [5, 17, 300, 42, 7, 99, 256, 3, 11, 400, 23]


def load_tp_model(path: str) -> torch.nn.Module:
    """The checkpoint's model in float32, holding this rank's shard of the weights."""
    loaded = load_model(path)
    model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32)
    model.load_weights(loaded.weights())
    return model


def prompt_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits after PROMPT, from one prefill into a fresh paged KV cache of blocks of 4."""
    bs, n = 4, len(PROMPT)
    blocks = -(-n // bs)
    for layer in model.attention_layers():
        spec = layer.kv_cache_spec(4)
        layer.kv_cache = torch.zeros(spec.planes, (blocks + 1) * bs, spec.num_kv_heads,
                                     spec.head_size)
    md = build_attention_metadata(query_lens=[n], context_lens=[0],
                                  block_tables=[list(range(blocks))], block_size=bs,
                                  num_decodes=0, sliding_window=None, device=torch.device("cpu"),
                                  null_block=blocks)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(n), md)
        return model.compute_logits(hidden[-1:])[0]


def run_on_two_ranks(fn: Callable, *args):
    """fn(*args) on each of two ranks of a gloo tensor-parallel group; rank 0's result.

    fn must be a module-level function (the spawned processes import it by name) and return
    what torch.load(weights_only=True) reads back: tensors, numbers, tuples, dicts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        mp.spawn(_rank, args=(2, _free_port(), out, fn, args), nprocs=2, join=True)
        return torch.load(out, weights_only=True)


def _rank(rank: int, world: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        init_tensor_parallel()
        result = fn(*args)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        reset_tensor_parallel()
        dist.destroy_process_group()
    # Skip C++ static teardown: a gloo thread still winding down at interpreter exit
    # occasionally aborts the process ("terminate called without an active exception")
    # after all the work is done and saved.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
