"""Drafting through CUDA graphs (shoal/spec_decode/draft_graphs.py) on the CPU: the Triton
backend under TRITON_INTERPRET=1 (tests/conftest.py), replay emulated eagerly over the graphs'
static buffers, which are poisoned before every run, so an input the run does not stage (or a
metadata field the step does not move on) changes the drafts. MTP, EAGLE and a draft model
draft for batches padded to a captured size; every proposal is still the drafter's formula
and the output the plain engine's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine_helpers import random_prompts, tiny_llm  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from spec_decode.proposal_log import record_proposals  # noqa: E402
from spec_decode.test_draft_model import _draft  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402

from shoal import SamplingParams  # noqa: E402
from shoal.attention.metadata import token_slots  # noqa: E402
from shoal.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shoal.spec_decode.draft_graphs import DraftGraphs  # noqa: E402
from shoal.worker.graph_table import round_up  # noqa: E402

K = 3
# tiny_llm's blocks of 4 up to 64 tokens (requests here reach 32): graphs of one decode split
# (the split kernels have their own tests), a quarter of the interpreted programs of
# tiny_llm's 256.
MAX_LEN = 64
MAX_BLOCKS = MAX_LEN // 4


class EagerDraftGraphs(DraftGraphs):
    """Replays emulated eagerly (worker/eager_graphs.py); every run starts from junk in every
    static buffer the run must stage and the step must move on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, table_type=EagerGraphTable, **kwargs)
        self.runs: list[tuple[int, int, int]] = []  # (rows, padded size, steps)

    def _poison(self) -> None:
        gen = torch.Generator().manual_seed(len(self.runs))
        tokens, b = self.table.tokens, self.table.buffers[0]
        tokens.buffer.copy_(torch.randint(3, 500, tokens.buffer.shape, generator=gen))
        if self.hidden is not None:
            self.hidden.copy_(10 * torch.randn(self.hidden.shape, generator=gen))
        self.drafts.fill_(-1)
        self.step_index.fill_(self.max_steps - 1)
        b.meta.copy_(torch.randint(1, 40, b.meta.shape, generator=gen))
        b.slot_mapping.copy_(torch.randint(0, 32, b.slot_mapping.shape, generator=gen))
        b.block_tables.copy_(torch.randint(0, 8, b.block_tables.shape, generator=gen))

    def run(self, ids, hidden, positions, tables, steps):
        self._poison()
        self.runs.append((len(positions), round_up(len(positions), self.sizes), steps))
        return super().run(ids, hidden, positions, tables, steps)


def test_advance_moves_live_rows_as_a_fill_of_the_next_positions():
    be = TritonAttentionBackend()
    cpu = torch.device("cpu")

    def filled(positions: list[int], tables: list[list[int]]):
        buf = be.alloc_graph_buffers(4, 4, 6, cpu, block_size=4, sliding_window=None)
        be.fill_graph_buffers(buf, 4, 1, positions, tables,
                              token_slots([1] * len(positions), positions, tables, 4))
        return buf

    tables = [[3, 7, 9], [5, 2], [8]]  # row 0 crosses into a new block, then row 1
    buf = filled([6, 2, 0], tables)  # three live rows, one padding row
    for step in (1, 2):
        be.advance_graph_buffers(buf, 4)
        want = filled([6 + step, 2 + step, step], tables)
        assert buf.meta[:8].tolist() == want.meta[:8].tolist()  # sequence, context lengths
        assert buf.slot_mapping[:4].tolist() == want.slot_mapping[:4].tolist()
    assert buf.slot_mapping[3] == -1 and buf.meta[3] == 0  # padding stays padding


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# Each method, each head and both schedulings once (MTP and EAGLE share the hidden-state
# drafter's graphs; the whole product took twice the interpreted time).
@pytest.mark.parametrize("method,name,async_scheduling", [
    ("mtp", "random", True), ("eagle", "bigram", False)])
def test_hidden_state_drafts_through_padded_graphs(drafter_checkpoint, method, name,
                                                   async_scheduling):
    """Drafts 2..k of MTP / EAGLE replay the emulated graphs (3 requests padded to 4, one
    alone at 1): lossless, and every proposal is the head's formula."""
    target, ref, spec = drafter_checkpoint(method, name, K)
    sp = SamplingParams(temperature=0, max_tokens=10 if async_scheduling else 8,
                        ignore_eos=True)
    prompts = random_prompts(3, seed=9, lo=2, hi=10)
    want = _ids(tiny_llm(target).generate(prompts, sp, use_tqdm=False))
    llm = tiny_llm(target, attention_backend="triton", max_num_seqs=4, max_model_len=MAX_LEN,
                   async_scheduling=async_scheduling, speculative_config=spec)
    drafter = llm.llm_engine.core.runner.drafter
    drafter.capture_graphs(None, MAX_BLOCKS, EagerDraftGraphs)
    graphs = drafter.graphs
    assert graphs.sizes == [1, 2, 4]
    log = record_proposals(llm)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert _ids(llm.generate(prompts[1], sp, use_tqdm=False)) == [want[1]]
    assert {run[:2] for run in graphs.runs} >= {(3, 4), (1, 1)}
    # Every proposal of 2 or more drafts went through the graphs (fewer than k where the
    # draft limits ask: engine/draft_budget.py), a batch to one depth.
    assert sum(n for n, _, _ in graphs.runs) == sum(len(d) >= 2 for _, d in log) > 5
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_draft_model_drafts_through_padded_graphs(tiny_llama_dir, tmp_path):
    """The draft model's k greedy steps replay the emulated graphs: lossless, and every
    proposal is the draft model's own greedy continuation (transformers)."""
    draft = _draft(tiny_llama_dir, tmp_path, 0.03)
    # Prompts of a few tokens and 4 tokens each (8 replays, 16 proposals checked): every
    # prompt and verify token is an interpreted forward of the target and the draft model.
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(3, seed=2, lo=2, hi=10)
    want = _ids(tiny_llm(tiny_llama_dir).generate(prompts, sp, use_tqdm=False))
    llm = tiny_llm(tiny_llama_dir, attention_backend="triton", max_num_seqs=4,
                   max_model_len=MAX_LEN,
                   speculative_config={"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": K})
    drafter = llm.llm_engine.core.runner.drafter
    drafter.capture_graphs(None, MAX_BLOCKS, EagerDraftGraphs)
    log: list[tuple[list[int], list[int]]] = []
    inner = drafter.propose_batch

    def recording(seqs, tables, depth=None):
        drafts = inner(seqs, tables, depth)
        log.extend((list(s), d) for s, d in zip(seqs, drafts))
        return drafts
    drafter.propose_batch = recording
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert _ids(llm.generate(prompts[0], sp, use_tqdm=False)) == [want[0]]
    runs = drafter.graphs.runs
    assert (3, 4, K) in runs and (1, 1, K) in runs
    assert sum(n for n, _, _ in runs) == len(log) > 5
    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    for seq, drafts in log:
        assert drafts == hf_greedy(hf, seq, len(drafts))[0], seq
