"""Speculative decoding's verify step is a chunk of k+1 query tokens over a paged context,
beside one-token decodes: the Triton kernels (interpreted on the CPU) against the PyTorch
reference, with chunks that cross block boundaries and contexts that end on one."""

from __future__ import annotations

from test_triton_kernels import Seq, run_attention


def test_verify_chunks_beside_decodes() -> None:
    bs = 16
    seqs = [Seq(40, 1), Seq(16, 1),  # decodes
            Seq(13, 5), Seq(16, 5), Seq(45, 3), Seq(31, 5), Seq(0, 20)]  # verifies, a prefill
    run_attention(seqs, 2, 8, 2, 64, bs, seed=11)


def test_verify_chunks_alone() -> None:
    run_attention([Seq(27, 5)], 0, 4, 1, 64, 16, seed=12)
    run_attention([Seq(14, 5), Seq(3, 2)], 0, 4, 2, 128, 4, seed=13)
