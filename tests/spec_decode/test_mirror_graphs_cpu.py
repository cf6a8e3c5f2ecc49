"""An EAGLE-3 head's mirror pass and draft 1 through CUDA graphs (mirror_graphs.py), emulated
on the CPU (the Triton backend under TRITON_INTERPRET=1, replays rerun eagerly over the static
buffers, worker/eager_graphs.py), feeding the draft graphs of drafts 2..k. Every static buffer
a proposal must stage or feed, the mirror's and the draft graphs', is poisoned before each
proposal, so a missed input changes the drafts. Forced acceptance of every draft, then of
none, makes the mirrors k + 1 rows a request (fewer near max_tokens: padded), then one: the
output, every proposal and its probabilities are the eager engine's (the torch backend, no
graphs). (Forced acceptance keeps the target's token where a draft is accepted, so the
sequence is not what the target read: the EAGLE-3 formula recomputed from it does not apply.
Greedy output and the formula's drafts through these graphs without forcing:
test_proposal_host_ops.py.)

The target's verify steps replay its graphs of k + 1 tokens a row (emulated too): a
request verifying fewer drafts is padded there, so the aux states of the requests after it
sit at other rows than in the step's flat order (issue 38: read in that order on the GPU,
they were other tokens' states, and the drafts of those requests went wrong from then on)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from engine_helpers import random_prompts, tiny_llm  # noqa: E402
from oracle import write_tiny_checkpoint  # noqa: E402
from spec_decode.proposal_log import record_proposals  # noqa: E402
from spec_decode.test_eagle3 import head_weights, write_head  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402

from shoal import SamplingParams  # noqa: E402
from shoal.spec_decode.draft_graphs import DraftGraphs  # noqa: E402
from shoal.spec_decode.mirror_backlog import MAX_ROWS  # noqa: E402
from shoal.worker.graph_table import StepShape  # noqa: E402
from shoal.worker.model_graphs import ModelGraphs  # noqa: E402

K = 3
MAX_LEN = 64  # blocks of 4 (tiny_llm): tables of 16, one decode split


def _poison(table, gen: torch.Generator, *extra: torch.Tensor) -> None:
    """Junk in a graph table's staged token rows and attention buffers, and in `extra`."""
    b = table.buffers[0]
    table.tokens.buffer.copy_(torch.randint(3, 500, table.tokens.buffer.shape, generator=gen))
    b.meta.copy_(torch.randint(1, 40, b.meta.shape, generator=gen))
    b.slot_mapping.copy_(torch.randint(0, 32, b.slot_mapping.shape, generator=gen))
    b.block_tables.copy_(torch.randint(0, 8, b.block_tables.shape, generator=gen))
    for t in extra:
        t.copy_((10 * torch.randn(t.shape, generator=gen)).to(t.dtype))


def _graphed(drafter) -> list[tuple[int, int, list[int]]]:
    """Captures the drafter's graphs (emulated), poisons them before every proposal, and
    returns the log of mirror replays: (padded rows, tokens a row, rows of each request)."""
    drafter.capture_graphs(None, MAX_LEN // 4,
                           functools.partial(DraftGraphs, table_type=EagerGraphTable))
    mirror, drafting = drafter.mirror_graphs, drafter.graphs
    assert mirror is not None and mirror.qs == [1, K + 1] and mirror.sizes == [1, 2, 4]
    runs: list[tuple[int, int, list[int]]] = []
    gen = torch.Generator().manual_seed(0)
    inner_stage, inner_run = drafting.stage, mirror.run

    def stage(positions, tables, rows=0):
        _poison(drafting.table, gen, drafting.hidden, drafting.drafts, drafting.step_index)
        return inner_stage(positions, tables, rows)

    def run(shape, source, src_rows, ids, starts, lens, tables, picks):
        _poison(mirror.table, gen, mirror.raw,
                *([] if mirror.probs is None else [mirror.probs]))
        runs.append((shape.rows, shape.q, list(lens)))
        return inner_run(shape, source, src_rows, ids, starts, lens, tables, picks)
    drafting.stage, mirror.run = stage, run
    return runs


def _target_verify_graphs(runner) -> list[list[int]]:
    """The target's verify steps through its graphs of 1 and 4 rows of k + 1 tokens
    (emulated; its only graphs: other steps run eagerly); returns each replay's tokens a
    request. A request verifying fewer drafts is padded to k + 1 there, so the rows of those
    after it are not the step's flat rows (EAGLE-3 reads its aux states where the graph
    wrote them)."""
    shapes = [StepShape(b, K + 1, K + 1) for b in (1, 4)]
    graphs = ModelGraphs(runner.model, runner.backend, shapes, MAX_LEN // 4, runner.device,
                         block_size=4, keep_hidden=True, table_type=EagerGraphTable)
    graphs.capture()
    runner.graphs = graphs
    runs: list[list[int]] = []
    inner = graphs.run

    def run(shape, inp, fill, **kw):
        runs.append([it.num_new_tokens for it in inp.items])
        return inner(shape, inp, fill, **kw)
    graphs.run = run
    return runs


def _probs(llm) -> list[list[float]]:
    """Every proposal's draft probabilities (the drafter's own, before any overlay)."""
    drafter = llm.llm_engine.core.runner.drafter
    seen: list[list[float]] = []
    inner = drafter.mirror_and_propose

    def recording(reqs, hidden, failed, propose=True):
        drafts = inner(reqs, hidden, failed, propose=propose)
        seen.extend(drafter.last_draft_probs[s] for s in sorted(drafts)
                    if s in drafter.last_draft_probs)
        return drafts
    drafter.mirror_and_propose = recording
    return seen


def test_mirror_and_draft_1_replay_their_graphs(tmp_path) -> None:
    # A 3-layer target (the head reads layers 2, 1, 0): the interpreted Triton kernels of
    # its forward passes are most of the test's time.
    target = write_tiny_checkpoint(tmp_path / "target", "llama", seed=3, num_hidden_layers=3)
    folder = write_head(tmp_path / "head", head_weights(seed=5))
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K,
            "forced_acceptance_rate": 1.0, "confidence_threshold": 0.0}
    # three requests (padded to 4 rows), then one alone, its drafts all rejected
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 7)]
    alone = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # 3 one-row mirrors
    prompts = random_prompts(4, seed=16, lo=2, hi=12)
    outs, logs, probs = [], [], []
    for graphs in (False, True):
        llm = tiny_llm(target, attention_backend="triton" if graphs else "torch",
                       max_num_seqs=4, max_model_len=MAX_LEN, speculative_config=spec)
        runner = llm.llm_engine.core.runner
        runs = _graphed(runner.drafter) if graphs else []
        verifies = _target_verify_graphs(runner) if graphs else []
        log, seen = record_proposals(llm), _probs(llm)
        got = llm.generate(prompts[:3], sp, use_tqdm=False)
        llm.llm_engine.core.runner.drafter.forced_acceptance.rate = 0.0
        got += llm.generate(prompts[3:], alone, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        logs.append(log)
        probs.append(seen)
    assert outs[0] == outs[1]
    # One row a request (drafts all rejected) and k + 1 (all accepted) or fewer (padded);
    # 3 requests padded to 4 rows, one alone (backing off: catch-ups of its kept rows)
    assert {1, K + 1} <= {q for _, q, _ in runs} <= {1, K + 1, MAX_ROWS + K + 1}
    assert any(q == K + 1 and min(lens) < K + 1 for _, q, lens in runs)
    assert any(rows == 4 and len(lens) == 3 for rows, _, lens in runs)
    assert any(rows == 1 for rows, _, _ in runs)
    # a verify replay where a request of fewer than k + 1 tokens came before another
    assert any(min(v[:-1]) < K + 1 for v in verifies if len(v) > 1), verifies
    assert logs[0] == logs[1] and len(logs[1]) > 5
    assert len(probs[0]) == len(probs[1]) > 5
    for eager, graphed in zip(*probs):
        assert graphed == pytest.approx(eager, rel=1e-4, abs=1e-6)


def test_catch_ups_replay_their_graphs_from_the_ring(tmp_path, monkeypatch) -> None:
    """Acceptance 0: requests back off and their rows wait in the ring of kept rows; each
    catch-up (kept rows ahead of the request's own, up to MAX_ROWS + 1) replays a graph of
    MAX_ROWS + k + 1 tokens a request (MAX_ROWS 5 here), every row gathered from the ring: from a step kept
    whole at launch, and from one whose own rows the mirror keeps first. Every proposal and
    its probabilities are the eager engine's (a row gathered wrong changes the head's KV,
    and the drafts after it)."""
    from shoal.spec_decode import mirror_backlog, mirror_graphs

    # Backlogs of at most 5 rows: a backoff of 8 or 16 steps fills them (a step kept whole
    # at launch is then mirrored with its full backlog) within the tables' 64 positions.
    rows_max = 5
    monkeypatch.setattr(mirror_backlog, "MAX_ROWS", rows_max)
    monkeypatch.setattr(mirror_graphs, "MAX_ROWS", rows_max)
    target = write_tiny_checkpoint(tmp_path / "target", "llama", seed=4, num_hidden_layers=3)
    folder = write_head(tmp_path / "head", head_weights(seed=6))
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K,
            "forced_acceptance_rate": 0.0, "confidence_threshold": 0.0}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts(2, seed=19, lo=2, hi=8)
    kinds: list[str] = []  # each catch-up's source: a step kept at launch, or its own rows
    inner_rows = mirror_backlog.ring_rows

    def ring_rows(spans, backlogs, ring, kept_step, states, to_device):
        slots = inner_rows(spans, backlogs, ring, kept_step, states, to_device)
        if slots is not None:
            kinds.append("kept step" if kept_step is not None else "own rows kept")
        return slots
    monkeypatch.setattr(mirror_backlog, "ring_rows", ring_rows)
    logs, probs, from_ring = [], [], []
    for graphs in (False, True):
        llm = tiny_llm(target, attention_backend="triton" if graphs else "torch",
                       max_num_seqs=4, max_model_len=MAX_LEN, speculative_config=spec,
                       async_scheduling=True)
        drafter = llm.llm_engine.core.runner.drafter
        if graphs:
            _graphed(drafter)
            inner = drafter.mirror_graphs.run

            def run(shape, source, src_rows, ids, starts, lens, *args, inner=inner,
                    drafter=drafter):
                if source is drafter.kept_rows.buf:
                    from_ring.append((shape.rows, shape.q, list(lens)))
                return inner(shape, source, src_rows, ids, starts, lens, *args)
            drafter.mirror_graphs.run = run
        log, seen = record_proposals(llm), _probs(llm)
        llm.generate(prompts, sp, use_tqdm=False)
        logs.append(log)
        probs.append(seen)
    assert logs[0] == logs[1] and len(logs[1]) >= 4
    for eager, graphed in zip(*probs):
        assert graphed == pytest.approx(eager, rel=1e-4, abs=1e-6)
    # (a backlog of 3 rows and the step's own fit the graphs of k + 1)
    longer = [(rows, lens) for rows, q, lens in from_ring if q == rows_max + K + 1]
    assert any(max(lens) > K + 1 for _, lens in longer), from_ring
    assert any(rows == 2 for rows, _ in longer), from_ring
    assert set(kinds) == {"kept step", "own rows kept"}, kinds
