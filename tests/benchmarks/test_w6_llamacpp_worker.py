"""The W6 llama.cpp worker's batched greedy loop against a fake llama_cpp module: sequences
stay apart, positions advance one by one, each request stops at its max_tokens, and groups
larger than `parallel` run one after another on a cleared context. (The real llama.cpp runs
only in the side-by-side benchmark.)"""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

VOCAB = 50


def rule(history: list[int]) -> int:
    """The fake model's greedy next token: depends on the whole sequence so far."""
    return (sum(history) * 7 + len(history)) % VOCAB


class _Batch:
    def __init__(self, n: int) -> None:
        self.token = [0] * n
        self.pos = [0] * n
        self.n_seq_id = [0] * n
        self.seq_id = [[0] for _ in range(n)]
        self.logits = [False] * n
        self.n_tokens = 0


def fake_llama_cpp() -> types.ModuleType:
    m = types.ModuleType("llama_cpp")
    state: dict = {"seqs": {}, "rows": {}, "clears": 0, "max_rows": 0}

    def decode(ctx, batch):
        state["rows"] = {}
        state["max_rows"] = max(state["max_rows"], batch.n_tokens)
        for j in range(batch.n_tokens):
            seq = state["seqs"].setdefault(batch.seq_id[j][0], [])
            assert batch.n_seq_id[j] == 1 and batch.pos[j] == len(seq), "position skipped"
            seq.append(batch.token[j])
            if batch.logits[j]:
                row = (ctypes.c_float * VOCAB)()
                row[rule(seq)] = 1.0
                state["rows"][j] = row
        return 0

    def clear(mem, data):
        state["seqs"] = {}
        state["clears"] += 1

    m.llama_batch_init = lambda n, embd, n_seq: _Batch(n)
    m.llama_batch_free = lambda b: None
    m.llama_get_memory = lambda ctx: "mem"
    m.llama_memory_clear = clear
    m.llama_decode = decode
    m.llama_get_logits_ith = lambda ctx, j: state["rows"][j]
    m.state = state
    return m


def reference(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < n:
        out.append(rule(seq))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("parallel", [2, 8])
def test_batched_greedy_keeps_sequences_apart(monkeypatch, parallel):
    fake = fake_llama_cpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    from w6_llamacpp_worker import generate_batched

    reqs = [([1, 2, 3], 4), ([9] * 7, 1), ([5, 4], 6), ([2] * 11, 3), ([8], 2)]
    outs = generate_batched("ctx", VOCAB, reqs, parallel, n_batch=6)
    assert outs == [reference(p, n) for p, n in reqs]
    assert fake.state["clears"] == -(-len(reqs) // parallel)
    assert fake.state["max_rows"] <= max(6, parallel)
