"""Start-up warm-up compiles the soft-capped kernel variants (Gemma 2) a model runs: the
warm function launches each decode split and prefill tile height with the layers' cap, once
per variant (SOFTCAP is a constexpr flag, the value a runtime argument); the start-up pass
hands each KV cache group's caps to the backend; a capped warm-up runs in the interpreter
(conftest.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.ops import warm  # noqa: E402
from shoal.attention.ops.paged_decode import MAX_SPLITS  # noqa: E402
from shoal.attention.ops.paged_prefill import prefill_tile_heights  # noqa: E402
from shoal.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shoal.core.kv_cache_spec import group_layers  # noqa: E402
from shoal.layers.attention import Attention  # noqa: E402
from shoal.worker.kv_cache_tensors import layer_specs  # noqa: E402
from shoal.worker.warmup import warmup  # noqa: E402

HQ, HK, D, BS = 2, 1, 16, 4
SPLITS = int(math.log2(MAX_SPLITS)) + 1  # decode variants: split counts 1, 2, 4, ...
TILES = len(prefill_tile_heights(HQ // HK, D, torch.float32))


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, int | None, float | None]]:
    """(kernel, sliding window, softcap) of each launch the warm function makes (none run)."""
    seen: list[tuple[str, int | None, float | None]] = []

    def recorder(kind: str):
        def launch(*args, sliding_window=None, softcap=None, **kw):
            seen.append((kind, sliding_window, softcap))
        return launch

    monkeypatch.setattr(warm, "paged_decode", recorder("decode"))
    monkeypatch.setattr(warm, "paged_prefill", recorder("prefill"))
    return seen


def test_each_variant_runs_once_per_kind_of_cap(launches) -> None:
    cache = torch.zeros(2, 2 * BS, HK, D)
    assert warm.warm_paged_attention(cache, HQ, 0.25, BS, None, softcaps={2.0}) == SPLITS + TILES
    assert {c for _, _, c in launches} == {2.0}
    assert [k for k, _, _ in launches] == ["decode"] * SPLITS + ["prefill"] * TILES
    launches.clear()
    # uncapped and capped layers on one cache: both variants; two caps share the capped one
    runs = warm.warm_paged_attention(cache, HQ, 0.25, BS, None, softcaps={50.0, None, 30.0})
    assert runs == 2 * (SPLITS + TILES)
    assert sorted({c for _, _, c in launches}, key=str) == [30.0, None]
    launches.clear()
    warm.warm_paged_attention(cache, HQ, 0.25, BS, None)  # by default: uncapped only
    assert {c for _, _, c in launches} == {None}


def _runner(caps: list[float | None], windows: list[int | None]) -> SimpleNamespace:
    """What the start-up warm-up reads of a model runner: a Gemma-2-like model's layers (one
    cap each, sliding and full), their cache groups, the Triton backend. No free blocks, so
    the dummy forward steps are skipped and only the attention kernels are warmed."""
    layers = [Attention(HQ, HK, D, sliding_window=w, softcap=c) for c, w in zip(caps, windows)]
    for layer in layers:
        layer.kv_cache = torch.zeros(2, 2 * BS, HK, D)
    sched = SimpleNamespace(max_num_batched_tokens=16, max_model_len=32, max_num_seqs=4)
    return SimpleNamespace(
        config=SimpleNamespace(scheduler_config=sched),
        model=SimpleNamespace(attention_layers=lambda: layers),
        kv_groups=group_layers(layer_specs(layers, torch.float32)),
        backend=TritonAttentionBackend(), device=torch.device("cpu"), dtype=torch.float32,
        block_size=BS, null_block=0)


def test_start_up_warms_each_groups_capped_variants(launches) -> None:
    warmup(_runner([2.0] * 4, [4, None, 4, None]))  # Gemma 2: every layer capped
    assert {(w, c) for _, w, c in launches} == {(None, 2.0), (4, 2.0)}
    assert len(launches) == 2 * (SPLITS + TILES)  # one variant set per group, no uncapped
    launches.clear()
    warmup(_runner([None, 2.0, None, 2.0], [4, 4, None, None]))  # caps on some layers
    assert {(w, c) for _, w, c in launches} == {(4, None), (4, 2.0), (None, None),
                                                 (None, 2.0)}
    launches.clear()
    warmup(_runner([None, None], [4, None]))  # no cap: the uncapped variants only
    assert {(w, c) for _, w, c in launches} == {(None, None), (4, None)}


def test_a_capped_warm_up_runs_the_kernels() -> None:
    """The launches themselves (the interpreter on the CPU): every split and tile height
    with a cap."""
    cache = torch.randn(2, 2 * BS, HK, D)
    backend = TritonAttentionBackend()
    assert backend.warm_kernels(cache, HQ, 0.25, BS, 3, softcaps={1.5}) == SPLITS + TILES
