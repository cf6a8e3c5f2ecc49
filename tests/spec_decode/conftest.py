"""Checkpoints with draft heads, shared by the draft-graph tests (CPU and GPU)."""

from __future__ import annotations

import json

import pytest
from oracle import write_tiny_checkpoint
from spec_decode.test_eagle import build_checkpoints as eagle_checkpoints
from spec_decode.test_eagle3 import head_config
from spec_decode.test_mtp import build_checkpoints as mtp_checkpoints


@pytest.fixture(scope="module")
def mtp_ckpts(tmp_path_factory):
    """Tiny DeepSeek-V3 targets with an MTP layer: "random" and "bigram" (see test_mtp.py)."""
    return mtp_checkpoints(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def eagle_ckpts(tiny_llama_dir, tmp_path_factory):
    """Tiny Llama targets with EAGLE heads: "random" and "bigram" (see test_eagle.py)."""
    return eagle_checkpoints(tiny_llama_dir, tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def drafter_checkpoint(mtp_ckpts, eagle_ckpts):
    """pick(method, name, k) -> (target folder, reference formula, speculative_config) of a
    hidden-state drafter: method "mtp" or "eagle", checkpoint "random" or "bigram"."""
    def pick(method: str, name: str, k: int):
        if method == "mtp":
            target, ref = mtp_ckpts[name]
            return target, ref, {"method": "mtp", "num_speculative_tokens": k}
        target, folder, ref = eagle_ckpts[name]
        return target, ref, {"method": "eagle", "model": str(folder), "num_speculative_tokens": k}
    return pick


@pytest.fixture(scope="module")
def eagle3_target_and_head(tmp_path_factory):
    """(target, head folder): an 8-layer tiny Llama and an EAGLE-3 head's config alone, for
    load_format="dummy" (random head weights: the forced-acceptance tests)."""
    root = tmp_path_factory.mktemp("eagle3")
    target = write_tiny_checkpoint(root / "target", "llama", seed=3, num_hidden_layers=8)
    head = root / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(head_config()))
    return target, head
