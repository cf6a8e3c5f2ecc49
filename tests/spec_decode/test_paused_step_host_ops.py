"""The host work of a step whose requests all back off from drafting (mirror_backlog.py): the
drafter keeps the step's rows in its ring of kept rows at launch, in the one copy it made of
them anyway, and the step's mirror then makes no torch call at all, whatever the batch (it
made 3 + batch on the CPU, 4 + batch on a GPU: an index copy, a gather and a view per
request). The ring's positions, its wrap and a backlog overwritten before its catch-up
(dropped: still lossless)."""

from __future__ import annotations

import torch
from engine_helpers import random_prompts, tiny_llm
from spec_decode.host_ops import HostOps
from spec_decode.proposal_log import record_proposals
from spec_decode.test_eagle3 import ckpt  # noqa: F401 (the fixture)

from shoal import SamplingParams
from shoal.spec_decode.kept_rows import KeptRows
from shoal.spec_decode.mirror_backlog import (
    MirrorBacklog,
    mirror_sources,
    mirror_states,
)

K = 3
# Top-level torch calls per step of paused requests only: on_launch's view of the aux
# buffer and its copy into the ring (the clone it replaced was 2 as well); the mirror none.
MAX_LAUNCH_OPS = 2
MAX_MIRROR_OPS = 0


def _spec(folder) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}


def test_a_paused_step_makes_no_torch_call_in_its_mirror(ckpt) -> None:  # noqa: F811
    target, folder, ref = ckpt
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(5, seed=14, lo=5, hi=20)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    llm = tiny_llm(target, max_num_seqs=4, speculative_config=_spec(folder))
    drafter = llm.llm_engine.core.runner.drafter
    log = record_proposals(llm)
    launch, propose = drafter.on_launch, drafter.propose
    counts: dict[tuple[str, int], list[int]] = {}

    def counted_launch(step):
        with HostOps() as mode:
            state = launch(step)
        items = step.inputs.items
        if items and all(it.drafts_paused for it in items):
            counts.setdefault(("launch", len(items)), []).append(mode.ops)
        return state

    def counted_mirror(step, state, out, latest):  # the step's mirror (propose)
        with HostOps() as mode:
            propose(step, state, out, latest)
        items = step.inputs.items
        if items and all(it.drafts_paused for it in items) and not out.draft_token_ids:
            counts.setdefault(("mirror", len(items)), []).append(mode.ops)
    drafter.on_launch, drafter.propose = counted_launch, counted_mirror
    got = llm.generate(prompts[:1], sp, use_tqdm=False)
    got += llm.generate(prompts[1:], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    for batch in (1, 4):
        launches, mirrors = counts.get(("launch", batch)), counts.get(("mirror", batch))
        assert launches and len(launches) > 5 and max(launches) <= MAX_LAUNCH_OPS, counts
        # (a paused request with a full backlog is mirrored: the steps of those run a pass)
        assert sorted(mirrors)[len(mirrors) // 2] <= MAX_MIRROR_OPS, counts
        assert mirrors.count(0) > 5, counts
    for seq, drafts in log:  # the catch-ups from the ring: the formula's drafts
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_a_backlog_overwritten_in_the_ring_is_dropped(ckpt) -> None:  # noqa: F811
    """A ring of two steps: the backlogs of requests paused longer are overwritten before
    their catch-up and dropped (their positions keep stale head KV): the output is still
    plain greedy decoding."""
    target, folder, _ = ckpt
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts(3, seed=15, lo=5, hi=20)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    # (synchronous: a step's rows stay in a ring of two steps until its own mirror)
    llm = tiny_llm(target, max_num_seqs=4, async_scheduling=False,
                   speculative_config=_spec(folder))
    drafter = llm.llm_engine.core.runner.drafter
    old = drafter.kept_rows
    ring = drafter.kept_rows = KeptRows(8, old.buf.shape[1], old.buf.dtype, old.buf.device,
                                   step_rows=4)
    lost: list[int] = []
    inner = ring.holds

    def holds(at: int) -> bool:
        held = inner(at)
        if not held:
            lost.append(at)
        return held
    ring.holds = holds
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert lost


def test_ring_positions_wrap_without_splitting_a_run() -> None:
    ring = KeptRows(5, 2, torch.float32, torch.device("cpu"), step_rows=3)
    assert ring.keep(torch.full((3, 2), 1.0)) == 0
    assert ring.keep(torch.full((2, 2), 2.0)) == 3
    assert ring.holds(0) and ring.holds(4)
    assert ring.keep(torch.full((2, 2), 3.0)) == 5  # slots 0-1: the run stays whole
    assert not ring.holds(1) and ring.holds(2)  # (slot 2 is not rewritten yet)
    assert ring.buf[:, 0].tolist() == [3.0, 3.0, 1.0, 2.0, 2.0]
    assert ring.keep(torch.full((2, 2), 4.0)) == 7 and ring.slot(7) == 2
    assert ring.keep(torch.full((1, 2), 5.0)) == 9 and ring.slot(9) == 4
    assert ring.keep(torch.full((3, 2), 6.0)) == 10
    assert not ring.holds(7) and ring.holds(9)
    assert ring.buf[:, 0].tolist() == [6.0, 6.0, 6.0, 4.0, 5.0]
    try:
        ring.keep(torch.zeros(1, 2, dtype=torch.float64))
    except ValueError as e:
        assert "do not fit a ring" in str(e)
    else:
        raise AssertionError("a float64 row went into a float32 ring")
    try:
        KeptRows(4, 2, torch.float32, torch.device("cpu"), step_rows=5)
    except ValueError as e:
        assert "step_rows" in str(e)
    else:
        raise AssertionError("a ring smaller than a step")


def test_mirror_states_put_each_backlog_before_its_own_rows() -> None:
    """Requests with and without backlogs, from a step's raw or head states and the ring:
    per request its kept rows, then its own, each through input_states where raw."""
    ring = KeptRows(10, 3, torch.float32, torch.device("cpu"), step_rows=4)
    kept = torch.arange(12.0).view(4, 3) + 100
    at = ring.keep(kept)
    states = torch.arange(18.0).view(6, 3)  # a step of 6 rows: request spans below
    spans = [(0, 2), (2, 1), (4, 2)]
    backs = [MirrorBacklog(5, [at + 1, at + 3]), None, MirrorBacklog(9, [at])]

    def fc(x: torch.Tensor) -> torch.Tensor:
        return 10 * x

    want_raw = torch.cat([kept[[1, 3]], states[0:2], states[2:3], kept[[0]], states[4:6]])
    for raw in (True, False):
        src = mirror_sources(spans, backs, ring, None, states.shape[0])
        index = [torch.tensor(x, dtype=torch.long) for x in (src.step, src.ring, src.order)]
        got = mirror_states(states, raw, src, ring, index, fc)
        want = fc(want_raw) if raw else torch.cat(
            [fc(kept[[1, 3]]), states[0:2], states[2:3], fc(kept[[0]]), states[4:6]])
        assert torch.equal(got, want), raw
    assert src.step == [0, 1, 2, 4, 5]  # row 3 is no request's


def test_holds_after_predicts_keep() -> None:
    """KeptRows.holds_after(n, at) says whether position `at` survives keeping n more rows,
    as keep() then leaves it (runs that would wrap start at slot 0)."""
    ring = KeptRows(7, 1, torch.float32, torch.device("cpu"), step_rows=4)
    for n in (3, 2, 4, 1, 4, 3, 2, 4, 4, 1):
        before = list(range(max(0, ring.written - 7), ring.written))
        predicted = {at: ring.holds_after(n, at) for at in before}
        ring.keep(torch.zeros(n, 1))
        assert predicted == {at: ring.holds(at) for at in before}, (n, predicted)


def test_ring_rows_orders_backlogs_first_and_refuses_to_overwrite_them() -> None:
    """A catch-up's rows as ring slots (mirror_graphs.py gathers them from the ring): per
    request its kept rows, then its own (kept now, in one copy, or where a step kept whole
    at launch put them); None where keeping the own rows would overwrite a backlog row."""
    from shoal.spec_decode.kept_rows import KeptStep
    from shoal.spec_decode.mirror_backlog import MirrorBacklog, ring_rows

    def index(rows):
        return torch.tensor(rows)

    ring = KeptRows(10, 1, torch.float32, torch.device("cpu"), step_rows=4)
    old = ring.keep(torch.tensor([[1.0], [2.0]]))  # positions 0, 1: request a's backlog
    states = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # the step: a 1 row, b 2 (skip 1)
    spans = [(0, 1), (2, 2)]
    slots = ring_rows(spans, [MirrorBacklog(5, [old, old + 1]), None], ring, None, states,
                      index)
    assert ring.buf[slots, 0].tolist() == [1.0, 2.0, 10.0, 12.0, 13.0]
    # a step kept whole at launch: its rows are read where they are
    at = ring.keep(states)
    kept = KeptStep(at, 4)
    slots = ring_rows(spans, [None, MirrorBacklog(9, [old])], ring, kept, None, index)
    assert ring.buf[slots, 0].tolist() == [10.0, 1.0, 12.0, 13.0]
    # keeping 3 more rows would overwrite position 0 (10 rows written of 10): refused
    ring2 = KeptRows(6, 1, torch.float32, torch.device("cpu"), step_rows=4)
    first = ring2.keep(torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
    assert ring_rows([(0, 3)], [MirrorBacklog(0, [first])], ring2, None, states, index) is None
    assert ring2.written == 4  # nothing kept
    # more own rows than a batch (the ring's sizing rule): refused, nothing kept
    ring3 = KeptRows(20, 1, torch.float32, torch.device("cpu"), step_rows=2)
    back = ring3.keep(torch.tensor([[1.0]]))
    assert ring_rows([(0, 3)], [MirrorBacklog(0, [back])], ring3, None, states, index) is None
    assert ring3.written == 1


def test_mirror_graph_shapes_for_catch_ups() -> None:
    """shape_for: verify and decode mirrors keep their graphs at any batch; a catch-up
    (kept rows ahead of a request's own) takes the graph of MAX_ROWS + k + 1 tokens a
    request up to 32 requests, unless more than 256 tokens of it would be mostly padding."""
    from shoal.spec_decode.mirror_backlog import MAX_ROWS
    from shoal.spec_decode.mirror_graphs import MirrorGraphs

    graphs = MirrorGraphs.__new__(MirrorGraphs)  # shape_for's state only
    graphs.catch_up_q, graphs.max_len = MAX_ROWS + K + 1, 1024
    from shoal.worker.graph_table import StepShape
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    shapes = [StepShape(b, q) for b in sizes for q in (1, K + 1)]
    shapes += [StepShape(b, graphs.catch_up_q) for b in sizes if b <= 32]
    graphs.shapes = sorted(shapes, key=lambda s: (s.tokens, s.rows))
    q = graphs.catch_up_q
    assert graphs.shape_for([1], [10]) == StepShape(1, 1)
    assert graphs.shape_for([1] * 60 + [K + 1], [10] * 61) == StepShape(64, K + 1)
    assert graphs.shape_for([MAX_ROWS + 1], [10]) == StepShape(1, q)
    assert graphs.shape_for([MAX_ROWS + 1] * 32, [10] * 32) == StepShape(32, q)  # lockstep
    assert graphs.shape_for([MAX_ROWS + 1] + [1] * 7, [10] * 8) == StepShape(8, q)  # 160
    assert graphs.shape_for([MAX_ROWS + 1] + [1] * 20, [10] * 21) is None  # padding: eager
    assert graphs.shape_for([MAX_ROWS + 1] * 33, [10] * 33) is None  # past 32 requests
    assert graphs.shape_for([MAX_ROWS + 1], [1024 - q + 1]) is None  # past the tables
