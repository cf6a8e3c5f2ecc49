"""Tensor-parallel layers on the CPU with the gloo backend: a tiny Llama split over 2 ranks
(column/row-parallel projections, vocab-parallel embedding and LM head, KV heads split) gives
the logits of the unsplit model."""

from __future__ import annotations

import torch
from gloo_harness import load_tp_model, prompt_logits, run_on_two_ranks


def _logits_and_qkv_rows(path: str) -> tuple[torch.Tensor, int]:
    """The prompt's logits on whatever TP group is initialised, and the number of rows of
    this rank's fused qkv weight (to show the weights really were split)."""
    model = load_tp_model(path)
    return prompt_logits(model), model.model.layers[0].self_attn.qkv_proj.weight.shape[0]


def test_two_rank_llama_matches_one_rank(tiny_llama_dir):
    torch.set_num_threads(1)
    expected, full_rows = _logits_and_qkv_rows(str(tiny_llama_dir))
    got, rows = run_on_two_ranks(_logits_and_qkv_rows, str(tiny_llama_dir))
    assert rows * 2 == full_rows  # each rank holds half the heads
    assert got.shape == expected.shape == (512,)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert int(got.argmax()) == int(expected.argmax())
