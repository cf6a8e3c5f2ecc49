"""Reading an adapter's tensors (shoal/lora/weights.py): B's scale folded in with the bits of
the float32 round trip, and the digest's second SHA-256 skipped only while both files bear
the stamps they had when it was taken of settled files; any rewrite (same bytes, other
bytes, or in place with the old mtime put back) goes through the hash again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from peft_adapters import write_raw_adapter
from safetensors.torch import load_file

from shoal.lora import adapter_digest
from shoal.lora.adapter import read_adapter
from shoal.lora.weights import load_adapter_weights, scaled

TARGETS = {f"model.layers.{i}.self_attn.{p}": (64, 32) for i in range(2)
           for p in ("q_proj", "v_proj")}


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float16),
                                     (torch.float32, torch.float32),
                                     (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("scaling", [2.0, 0.5, 1 / 3, 0.7071067811865476, 1.0, 1.37])
def test_scaled_matches_the_float32_round_trip(src, dst, scaling):
    b = (torch.randn(4096, 16, generator=torch.Generator().manual_seed(3)) * 3).to(src)
    want = (b.float() * scaling).to(dst)
    got = scaled(b, scaling, dst)
    assert got.dtype == dst and torch.equal(got, want)


@pytest.fixture
def hashes(monkeypatch) -> list[int]:
    """One entry per SHA-256 of a whole adapter (adapter_digest.digest_of, read_verified's)."""
    calls: list[int] = []
    digest_of = adapter_digest.digest_of

    def counting(config: bytes, weights: bytes) -> str:
        calls.append(len(weights))
        return digest_of(config, weights)

    monkeypatch.setattr(adapter_digest, "digest_of", counting)
    return calls


def _expected(folder: Path, scaling: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    raw = load_file(str(folder / "adapter_model.safetensors"))
    return {name: (raw[f"base_model.model.{name}.lora_A.weight"],
                   raw[f"base_model.model.{name}.lora_B.weight"] * scaling)
            for name in TARGETS}


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1]) for k in want)


def test_settled_files_are_not_hashed_again(tmp_path, hashes, monkeypatch):
    monkeypatch.setattr(adapter_digest, "SETTLED_NS", 0)  # (files just written count)
    folder = write_raw_adapter(tmp_path / "a", TARGETS, seed=5, r=4, alpha=8)
    spec = read_adapter(str(folder))
    assert spec.stamps is not None
    want = _expected(folder, 2.0)
    assert _same(load_adapter_weights(spec, torch.float32), want) and hashes == []

    # the same bytes saved again (a new inode): hashed, accepted
    copy = tmp_path / "copy.safetensors"
    shutil.copy(folder / "adapter_model.safetensors", copy)
    os.replace(copy, folder / "adapter_model.safetensors")
    assert _same(load_adapter_weights(spec, torch.float32), want) and len(hashes) == 1

    # other bytes of the same size written in place, the old mtime put back: the ctime
    # still moves, so the stale spec's load hashes and refuses them
    fresh = read_adapter(str(folder))
    assert fresh.stamps is not None and fresh.digest == spec.digest
    weights = folder / "adapter_model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40
    with open(weights, "r+b") as f:
        f.write(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ValueError, match="changed after the request arrived"):
        load_adapter_weights(fresh, torch.float32)
    assert len(hashes) == 2


def test_unsettled_files_are_hashed_at_every_load(tmp_path, hashes):
    """Files written within SETTLED_NS of their digest may be written again within the same
    tick of a coarse file-system clock: their stamps prove nothing, every load hashes."""
    folder = write_raw_adapter(tmp_path / "a", TARGETS, seed=6, r=4, alpha=4)
    spec = read_adapter(str(folder))
    assert spec.stamps is None
    want = _expected(folder, 1.0)
    for n in (1, 2):
        assert _same(load_adapter_weights(spec, torch.float32), want)
        assert len(hashes) == n


def test_settled_needs_both_files_old_enough():
    now = 10 * adapter_digest.SETTLED_NS
    old = (1, 10, now - 2 * adapter_digest.SETTLED_NS, now - 2 * adapter_digest.SETTLED_NS)
    young = (1, 10, old[2], now - adapter_digest.SETTLED_NS // 2)  # (a fresh ctime)
    assert adapter_digest.settled((old, old), now)
    assert not adapter_digest.settled((old, young), now)
    assert not adapter_digest.settled((young, old), now)
