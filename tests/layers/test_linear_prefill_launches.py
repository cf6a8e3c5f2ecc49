"""A prefill step of a hybrid model (Qwen3.5, Kimi-Linear) asks nothing of the host from its
linear-attention layers and launches about as many ops for a longer prompt (issue 30: on the
H100 the hybrid TTFT was several times its work). Counted on the CPU by
benchmarks/hybrid_prefill_trace.py: syncs are what makes a CUDA host wait (.item(), bool,
.tolist(), nonzero, torch.tensor(values, device=...)); ops are aten ops, a launch each on a GPU.

With a block of 64 tokens, a 128-token prompt keeps one block end's state and runs 2 chunks of
the chunked rule; 384 tokens keep 5 and run 6. Before: 3 and 7 blocking copies a layer, and
the ops a layer grew by 10 a block end; now the per-chunk walk of the state (3 ops a chunk of
64 tokens) is all that grows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from hybrid_prefill_trace import model_dirs, trace_prefill  # noqa: E402

SHORT, LONG = 128, 384
CHUNK = 64  # the torch chunked rule's chunk
OPS_PER_CHUNK = 3  # its loop: u, the decayed state, the state update


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return model_dirs(tmp_path_factory.mktemp("hybrid-prefill"))


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-kimi-linear"])
def test_prefill_linear_layers_never_wait_on_the_device(dirs, name: str):
    short, long = trace_prefill(dirs[name], [SHORT, LONG])
    assert short["block_size"] == 64 and short["linear_layers"] == 3
    for rec in (short, long):
        linear_syncs = {k: v for k, v in rec["syncs"].items() if k.startswith("linear:")}
        assert linear_syncs == {}, (rec["tokens"], linear_syncs)
    grew = long["linear_ops_per_layer"] - short["linear_ops_per_layer"]
    assert grew <= OPS_PER_CHUNK * (LONG - SHORT) // CHUNK, (short, long)


def test_full_attention_prefill_is_the_baseline(dirs):
    """The same width with every layer full attention: no syncs, no growth (what the hybrid
    steps are held to, less the chunked rule's walk)."""
    short, long = trace_prefill(dirs["full-attention"], [SHORT, LONG])
    assert short["syncs"] == {} and long["syncs"] == {}
    assert short["ops"] == long["ops"]
