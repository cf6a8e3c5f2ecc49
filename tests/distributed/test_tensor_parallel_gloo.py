"""Tensor-parallel layers on the CPU with the gloo backend: a tiny Llama split over 2 ranks
(column/row-parallel projections, vocab-parallel embedding and LM head, KV heads split) gives
the logits of the unsplit model."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.attention.metadata import build_attention_metadata
from shoal.distributed.parallel_state import init_tensor_parallel, reset_tensor_parallel
from shoal.loader import load_model
from shoal.models.registry import resolve_model_class

PROMPT = [5, 17, 300, 42, 7, 99, 256, 3, 11, 400, 23]


def _logits(path: str) -> tuple[torch.Tensor, int]:
    """Last-position logits of PROMPT, on whatever TP group is initialised, and the number of
    rows of this rank's fused qkv weight (to show the weights really were split)."""
    loaded = load_model(path)
    model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32)
    model.load_weights(loaded.weights())
    bs, n = 4, len(PROMPT)
    blocks = -(-n // bs)
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, (blocks + 1) * bs, layer.num_kv_heads, layer.head_dim)
    md = build_attention_metadata(query_lens=[n], context_lens=[0],
                                  block_tables=[list(range(blocks))], block_size=bs,
                                  num_decodes=0, sliding_window=None, device=torch.device("cpu"),
                                  null_block=blocks)
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(n), md)
        rows = model.model.layers[0].self_attn.qkv_proj.weight.shape[0]
        return model.compute_logits(hidden[-1:])[0], rows


def _rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        init_tensor_parallel()
        logits, rows = _logits(path)
        if rank == 0:
            torch.save({"logits": logits, "qkv_rows": torch.tensor(rows)}, out)
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


def test_two_rank_llama_matches_one_rank(tiny_llama_dir, tmp_path):
    torch.set_num_threads(1)
    expected, full_rows = _logits(str(tiny_llama_dir))
    out = tmp_path / "tp2.pt"
    mp.spawn(_rank, args=(2, _free_port(), str(tiny_llama_dir), str(out)), nprocs=2, join=True)
    saved = torch.load(out, weights_only=True)
    got = saved["logits"]
    assert int(saved["qkv_rows"]) * 2 == full_rows  # each rank holds half the heads
    assert got.shape == expected.shape == (512,)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert int(got.argmax()) == int(expected.argmax())
