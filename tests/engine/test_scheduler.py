"""Scheduler driven by a fake model runner.

The fake runner mirrors the paged KV cache token by token: before running a scheduled chunk
it checks that every context position the scheduler claims is cached really holds that
request's token (in the slot the block table names), then writes the chunk's tokens. So any
scheduling or prefix-cache mistake that would make a real model read wrong keys fails here."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.core.types import EngineCoreOutput
from shoal.engine.scheduler import Scheduler
from shoal.engine.token_results import keep_tokens, token_output
from shoal.sampling_params import SamplingParams

EOS = 2
BS = 4


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16,
                   max_model_len: int = 256, chunked: bool = True, policy: str = "fcfs",
                   caching: bool = True, block_size: int = BS) -> Scheduler:
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                         max_model_len=max_model_len, enable_chunked_prefill=chunked,
                         policy=policy)
    return Scheduler(sc, cc, num_blocks)


def make_req(rid: str, prompt: list[int], max_tokens: int = 16, priority: int = 0,
             arrival: float = 0.0, **sp: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sp)  # type: ignore[arg-type]
    return Request(rid, list(prompt), params, frozenset({EOS}), max_tokens,
                   arrival_time=arrival, priority=priority)


def prompt_of(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


class FakeRunner:
    def __init__(self, sched: Scheduler,
                 sample: Callable[[str, int], int] | None = None):
        self.sched = sched
        self.bs = sched.block_size
        self.cache: dict[int, tuple[tuple[int, ...], int]] = {}  # slot -> (prefix, token)
        self.tokens: dict[str, list[int]] = {}  # the runner's own copy of each sequence
        self.sample = sample or (lambda rid, n_out: 1000 + n_out)
        self.steps: list[SchedulerOutput] = []

    def remove_requests(self, serials: set[int]) -> None:
        for serial in serials:
            self.tokens.pop(serial, None)  # aborted before it ever ran: nothing to drop

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for nr in out.new_requests:
            self.tokens[nr.serial] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
        sampled: dict[int, int] = {}
        # Write every chunk first (as attention does per layer), then check contexts.
        for item in out.scheduled:
            toks = self.tokens[item.serial]
            assert item.input_token_ids == toks[item.context_len:item.context_len
                                                + item.num_new_tokens]
            assert len(item.block_ids) >= -(-(item.context_len + item.num_new_tokens) // self.bs)
            for j, t in enumerate(item.input_token_ids):
                pos = item.context_len + j
                slot = item.block_ids[pos // self.bs] * self.bs + pos % self.bs
                self.cache[slot] = (tuple(toks[:pos]), t)
        for item in out.scheduled:
            toks = self.tokens[item.serial]
            for pos in range(item.context_len):
                slot = item.block_ids[pos // self.bs] * self.bs + pos % self.bs
                got = self.cache.get(slot)
                assert got is not None and got[1] == toks[pos] and got[0] == tuple(toks[:pos]), (
                    f"{item.request_id}: cached position {pos} holds {got}, "
                    f"expected token {toks[pos]}")
            if item.sample:
                assert item.num_output_tokens == len(toks) - len(
                    self.sched_prompt(item.request_id))
                tok = self.sample(item.request_id, item.num_output_tokens)
                sampled[item.serial] = tok
                toks.append(tok)
        self.steps.append(out)
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def sched_prompt(self, rid: str) -> list[int]:
        return self.sched.requests[rid].prompt_token_ids

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        out = self.sched.schedule()
        budget = self.sched.config.max_num_batched_tokens
        assert out.num_scheduled_tokens <= budget
        assert len(out.scheduled) <= self.sched.config.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)
        # decodes first
        kinds = [s.num_new_tokens == 1 and s.sample for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True)
        assert out.num_decodes == sum(kinds)
        result = self.execute(out)
        outs = self.sched.update(out, result)
        # As the engine core does: ended requests release their runner state.
        self.remove_requests(self.sched.take_finished_serials())
        return out, outs

    def run_to_completion(self, max_steps: int = 1000) -> dict[str, EngineCoreOutput]:
        finals: dict[str, EngineCoreOutput] = {}
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return finals
            _, outs = self.step()
            for o in outs:
                if o.finish_reason is not None:
                    finals[o.request_id] = o
        raise AssertionError("did not finish")


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert sched.kv.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks


# ---- budget, chunking, batching -------------------------------------------------------------


def test_token_budget_respected_every_step() -> None:
    sched = make_scheduler(num_blocks=200, budget=10)
    for i in range(8):
        sched.add_request(make_req(f"r{i}", prompt_of(3 + 5 * i, start=100 * i), max_tokens=5))
    runner = FakeRunner(sched)
    finals = runner.run_to_completion()
    assert set(finals) == {f"r{i}" for i in range(8)}
    assert all(o.finish_reason == "length" for o in finals.values())
    assert all(s.num_scheduled_tokens <= 10 for s in runner.steps)
    # The budget is actually used: most steps are full while work remains.
    assert sum(s.num_scheduled_tokens == 10 for s in runner.steps) >= len(runner.steps) // 2
    assert_all_blocks_free(sched)


def test_long_prompt_is_chunked_by_budget() -> None:
    sched = make_scheduler(budget=8)
    req = make_req("a", prompt_of(27), max_tokens=2)
    sched.add_request(req)
    runner = FakeRunner(sched)
    chunks: list[tuple[int, int, bool]] = []
    for _ in range(4):
        out, outs = runner.step()
        (item,) = out.scheduled
        chunks.append((item.context_len, item.num_new_tokens, item.sample))
        if not item.sample:
            assert outs == []
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 3, True)]
    assert req.num_computed_tokens == 27
    assert req.output_token_ids == [1000]
    assert len(runner.steps[0].new_requests) == 1
    assert all(not s.new_requests for s in runner.steps[1:])


def test_decodes_and_prefill_chunks_mixed_with_decodes_first() -> None:
    sched = make_scheduler(budget=10)
    sched.add_request(make_req("a", prompt_of(5), max_tokens=10))
    sched.add_request(make_req("b", prompt_of(4, 300), max_tokens=10))
    runner = FakeRunner(sched)
    runner.step()  # both prefilled (5 + 4 <= 10)
    sched.add_request(make_req("c", prompt_of(30, 500), max_tokens=10))
    out, _ = runner.step()
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert out.num_decodes == 2
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 8]
    assert out.scheduled[2].context_len == 0 and not out.scheduled[2].sample
    out, _ = runner.step()
    # c's next chunk is a running prefill: still after the decodes.
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 8]
    assert out.scheduled[2].context_len == 8


def test_max_num_seqs_respected() -> None:
    sched = make_scheduler(budget=100, max_seqs=2)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", prompt_of(3, 100 * i), max_tokens=2 + i))
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_waiting == 2
    out, outs = runner.step()  # r0 finishes (max_tokens 2)
    assert [o.request_id for o in outs if o.finish_reason] == ["r0"]
    out, _ = runner.step()
    assert [s.request_id for s in out.scheduled] == ["r1", "r2"]
    assert sched.requests.get("r1") is None  # r1 finished at its third token
    finals = runner.run_to_completion()
    assert set(finals) == {"r2", "r3"}
    assert all(len(s.scheduled) <= 2 for s in runner.steps)


def test_chunked_prefill_disabled_prompt_larger_than_budget_waits() -> None:
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    sched.add_request(make_req("a", prompt_of(4), max_tokens=3))
    runner = FakeRunner(sched)
    runner.step()
    sched.add_request(make_req("b", prompt_of(16, 300), max_tokens=1))
    sched.add_request(make_req("c", prompt_of(2, 500), max_tokens=1))
    out, _ = runner.step()
    # b (16 tokens) does not fit in the 15 left after a's decode; it is not chunked, and c
    # queues behind it (FCFS).
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert sched.requests["b"].status == RequestStatus.WAITING
    assert sched.requests["b"].num_computed_tokens == 0
    out, _ = runner.step()  # a finishes this step
    out, _ = runner.step()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 16)]
    finals = runner.run_to_completion()
    assert set(finals) == {"c"}  # b finished in the step above (max_tokens=1)
    assert_all_blocks_free(sched)


# ---- preemption ------------------------------------------------------------------------------


def test_preempts_newest_running_request_and_resumes_by_recompute() -> None:
    # 5 blocks of 4: a and b each hold 2 after their 7-token prompts and need a third block
    # two tokens later; only one of them can grow.
    sched = make_scheduler(num_blocks=5, budget=32, caching=False)
    a = make_req("a", prompt_of(7), max_tokens=8)
    b = make_req("b", prompt_of(7, 300), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.step()  # both prefilled: 2 blocks each, 1 free; 8 tokens each after sampling
    assert sched.kv.num_free_blocks == 1
    out, outs = runner.step()  # decode position 7: still in block 1
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    # A request already waiting when b is preempted must end up behind b.
    sched.add_request(make_req("c", prompt_of(3, 900), max_tokens=1))
    out, outs = runner.step()  # position 8: a takes the last block; b has none -> preempted
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert sched.kv.block_ids("b") == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.waiting.peek() is b
    assert b.output_token_ids == [1000, 1001]
    assert not out.new_requests
    assert sched.requests["c"].status == RequestStatus.WAITING
    assert sched.num_waiting == 2
    resumed = None
    for _ in range(20):
        out, _ = runner.step()
        hit = [s for s in out.scheduled if s.request_id == "b"]
        if hit:
            resumed = hit[0]
            break
    assert resumed is not None
    # Recompute of prompt + outputs from scratch, sampling the next token at the end.
    assert resumed.context_len == 0
    assert resumed.input_token_ids == b.prompt_token_ids + [1000, 1001]
    assert resumed.sample and resumed.num_output_tokens == 2
    assert not any(nr.request_id == "b" for nr in out.new_requests)
    assert b.status == RequestStatus.RUNNING
    finals = runner.run_to_completion()
    assert b.output_token_ids == [1000 + i for i in range(8)]
    assert a.output_token_ids == [1000 + i for i in range(8)]
    assert finals["b"].finish_reason == "length"
    assert_all_blocks_free(sched)


def test_preemption_with_prefix_cache_resumes_from_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=5, budget=32, caching=True)
    a = make_req("a", prompt_of(7), max_tokens=8)
    b = make_req("b", prompt_of(7, 300), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    for _ in range(3):
        runner.step()
    assert b.status == RequestStatus.PREEMPTED
    finals = runner.run_to_completion()
    assert set(finals) == {"a", "b"}
    assert b.output_token_ids == [1000 + i for i in range(8)]
    assert_all_blocks_free(sched)


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=5, budget=32, caching=False)
    sched.add_request(make_req("a", prompt_of(7), max_tokens=8))
    sched.add_request(make_req("b", prompt_of(7, 300), max_tokens=8))
    runner = FakeRunner(sched)
    runner.step()
    runner.step()
    sched.add_request(make_req("tiny", [5], max_tokens=1))
    out, _ = runner.step()  # b preempted
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert sched.requests["tiny"].status == RequestStatus.WAITING


def test_priority_policy_admits_lowest_value_first() -> None:
    sched = make_scheduler(budget=100, max_seqs=1, policy="priority")
    sched.add_request(make_req("low", prompt_of(3), max_tokens=1, priority=5, arrival=1.0))
    sched.add_request(make_req("high", prompt_of(3, 200), max_tokens=1, priority=0, arrival=2.0))
    sched.add_request(make_req("mid", prompt_of(3, 300), max_tokens=1, priority=2, arrival=0.5))
    sched.add_request(make_req("high2", prompt_of(3, 400), max_tokens=1, priority=0, arrival=3.0))
    runner = FakeRunner(sched)
    order = []
    for _ in range(4):
        out, _ = runner.step()
        order += [s.request_id for s in out.scheduled]
    assert order == ["high", "high2", "mid", "low"]


def test_priority_policy_preempts_highest_value() -> None:
    sched = make_scheduler(num_blocks=6, budget=64, policy="priority", caching=False)
    r0 = make_req("p0", prompt_of(7), max_tokens=8, priority=0, arrival=0.0)
    r9 = make_req("p9", prompt_of(7, 200), max_tokens=8, priority=9, arrival=1.0)
    r3 = make_req("p3", prompt_of(4, 400), max_tokens=8, priority=3, arrival=2.0)
    for r in (r0, r9, r3):
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.step()  # 2 + 2 + 1 blocks, 1 free
    assert sched.kv.num_free_blocks == 1
    assert [r.request_id for r in sched.running] == ["p0", "p3", "p9"]
    runner.step()  # p3 takes the free block (position 4); p0, p9 stay in block 1
    assert sched.kv.num_free_blocks == 0
    out, _ = runner.step()  # p0 and p9 need block 2: p9 (priority 9) is preempted
    assert r9.status == RequestStatus.PREEMPTED
    assert r0.status == RequestStatus.RUNNING and r3.status == RequestStatus.RUNNING
    assert sched.kv.block_ids("p9") == []
    assert {s.request_id for s in out.scheduled} == {"p0", "p3"}
    finals = runner.run_to_completion()
    assert set(finals) == {"p0", "p3", "p9"}
    assert r9.output_token_ids == [1000 + i for i in range(8)]
    assert_all_blocks_free(sched)


# ---- stopping --------------------------------------------------------------------------------


def run_single(req: Request, tokens: list[int], **kw: object) -> tuple[Scheduler, list[EngineCoreOutput]]:
    sched = make_scheduler(**kw)  # type: ignore[arg-type]
    sched.add_request(req)
    runner = FakeRunner(sched, sample=lambda rid, n: tokens[n])
    outs: list[EngineCoreOutput] = []
    for _ in range(len(tokens) + 5):
        if not sched.has_unfinished_requests():
            break
        outs += runner.step()[1]
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)
    return sched, outs


def test_stop_on_eos() -> None:
    req = make_req("a", prompt_of(3), max_tokens=10)
    _, outs = run_single(req, [7, 8, EOS, 9, 9])
    assert req.output_token_ids == [7, 8, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert [o.new_token_ids for o in outs] == [[7], [8], [EOS]]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    assert outs[-1].stop_token  # the frontend leaves EOS's text out
    assert all(o.finish_reason is None for o in outs[:-1])


def test_eos_ignored_before_min_tokens() -> None:
    req = make_req("a", prompt_of(3), max_tokens=10, min_tokens=3)
    run_single(req, [EOS, EOS, 5, EOS, 6])
    assert req.output_token_ids == [EOS, EOS, 5, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_eos_at_exactly_min_tokens_stops() -> None:
    req = make_req("a", prompt_of(3), max_tokens=10, min_tokens=2)
    run_single(req, [EOS, EOS, 5])
    assert req.output_token_ids == [EOS, EOS]


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = make_req("a", prompt_of(3), max_tokens=4, ignore_eos=True)
    _, outs = run_single(req, [EOS, EOS, EOS, EOS, EOS])
    assert req.output_token_ids == [EOS] * 4
    assert outs[-1].finish_reason == "length"
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert not outs[-1].stop_token  # the last EOS is an ordinary token here


def test_stop_token_ids_set_stop_reason() -> None:
    req = make_req("a", prompt_of(3), max_tokens=10, stop_token_ids=[42, 43])
    _, outs = run_single(req, [5, 43, 6])
    assert req.output_token_ids == [5, 43]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason == 43
    assert req.stop_reason == 43
    assert outs[-1].stop_token


def test_stop_token_ids_respect_min_tokens() -> None:
    req = make_req("a", prompt_of(3), max_tokens=10, stop_token_ids=[42], min_tokens=2)
    run_single(req, [42, 42, 7])
    assert req.output_token_ids == [42, 42]
    assert req.stop_reason == 42


class _EndsOn:
    """A grammar that accepts every token and completes on one of them."""

    def __init__(self, last: int) -> None:
        self.last, self.ended = last, False

    def accept(self, token: int) -> bool:
        self.ended = token == self.last
        return True


@pytest.mark.parametrize("last, stop_token", [(EOS, True), (6, False)])
def test_a_grammar_s_end_is_a_stop_token_only_on_eos(last: int, stop_token: bool) -> None:
    # xgrammar completes on EOS (its text is left out, even with ignore_eos, which a
    # grammar's end does not skip); guidance may complete on an ordinary token (kept)
    req = make_req("a", prompt_of(3), max_tokens=10, ignore_eos=True)
    req.structured = _EndsOn(last)
    kept, status = keep_tokens(req, [5, last, 7], max_model_len=64)
    assert kept == [5, last] and status == RequestStatus.FINISHED_STOPPED
    out = token_output(req, kept, None, None, status)
    assert out.finish_reason == "stop" and out.stop_token is stop_token


def test_stop_on_max_tokens_is_length() -> None:
    req = make_req("a", prompt_of(3), max_tokens=3)
    _, outs = run_single(req, [5, 6, 7, 8])
    assert req.output_token_ids == [5, 6, 7]
    assert outs[-1].finish_reason == "length"
    assert outs[-1].stop_reason is None
    assert not outs[-1].stop_token


def test_stop_on_max_model_len() -> None:
    req = make_req("a", prompt_of(5), max_tokens=100)
    _, outs = run_single(req, list(range(10, 30)), max_model_len=9)
    assert req.num_tokens == 9
    assert req.output_token_ids == [10, 11, 12, 13]
    assert outs[-1].finish_reason == "length"


def test_finished_serials_are_taken_once() -> None:
    sched = make_scheduler()
    sched.add_request(make_req("a", prompt_of(3), max_tokens=1))
    sched.add_request(make_req("b", prompt_of(3, 300), max_tokens=3))
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput(sampled_token_ids={1: 5, 2: 6}))  # a finishes
    assert sched.take_finished_serials() == {1}
    assert sched.take_finished_serials() == set()
    sched.abort_requests(["b"])
    assert sched.take_finished_serials() == {2}


# ---- aborts ----------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests() -> None:
    sched = make_scheduler(budget=8)
    a = make_req("a", prompt_of(6), max_tokens=10)
    b = make_req("b", prompt_of(20, 300), max_tokens=10)
    c = make_req("c", prompt_of(5, 600), max_tokens=10)
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.step()  # a prefilled (6), b chunk of 2; c waits
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.RUNNING
    assert c.status == RequestStatus.WAITING
    assert sched.kv.block_ids("b")
    sched.abort_requests(["b", "c", "unknown"])
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert c.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.block_ids("b") == [] and "b" not in sched.kv.req_blocks
    assert sched.num_waiting == 0
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.kv.usage() == pytest.approx(2 / 64)  # only a's blocks are held
    assert sched.take_finished_serials() == {b.serial, c.serial}
    runner.remove_requests({b.serial})  # c never reached the runner
    out, outs = runner.step()
    aborts = [o for o in outs if o.finish_reason == "abort"]
    assert sorted(o.request_id for o in aborts) == ["b", "c"]
    assert all(o.new_token_ids == [] for o in aborts)
    assert [s.request_id for s in out.scheduled] == ["a"]
    sched.abort_requests(["a"])
    assert sched.take_pending_outputs()[0].finish_reason == "abort"
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_abort_while_step_in_flight_drops_the_result() -> None:
    sched = make_scheduler()
    a = make_req("a", prompt_of(3), max_tokens=10)
    sched.add_request(a)
    out = sched.schedule()
    sched.abort_requests(["a"])
    outs = sched.update(out, ModelRunnerOutput(sampled_token_ids={a.serial: 5}))
    assert a.output_token_ids == []
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert_all_blocks_free(sched)


# ---- prefix caching --------------------------------------------------------------------------


def test_prefix_cache_hit_sets_num_cached_tokens() -> None:
    sched = make_scheduler(budget=64)
    prompt = prompt_of(14)  # 3 full blocks + 2
    a = make_req("a", prompt, max_tokens=3)
    sched.add_request(a)
    runner = FakeRunner(sched)
    runner.step()
    assert a.num_cached_tokens == 0
    b = make_req("b", prompt, max_tokens=3)
    sched.add_request(b)
    out, outs = runner.step()
    item = next(s for s in out.scheduled if s.request_id == "b")
    assert b.num_cached_tokens == 12
    assert item.context_len == 12 and item.input_token_ids == prompt[12:]
    assert item.block_ids[:3] == sched.kv.block_ids("a")[:3]
    assert next(o for o in outs if o.request_id == "b").num_cached_tokens == 12
    runner.run_to_completion()
    assert a.output_token_ids == b.output_token_ids
    assert_all_blocks_free(sched)


def test_prefix_cache_exact_block_multiple_recomputes_last_block() -> None:
    sched = make_scheduler(budget=64)
    prompt = prompt_of(12)
    sched.add_request(make_req("a", prompt, max_tokens=1))
    runner = FakeRunner(sched)
    runner.run_to_completion()
    b = make_req("b", prompt, max_tokens=1)
    sched.add_request(b)
    out, _ = runner.step()
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].context_len == 8
    assert out.scheduled[0].input_token_ids == prompt[8:]


def test_prefix_hit_allocates_only_the_blocks_needed() -> None:
    # 13-token prompt with 3 cached blocks: one new token, so exactly one new block.
    sched = make_scheduler(num_blocks=32, budget=64)
    prompt = prompt_of(13)
    sched.add_request(make_req("a", prompt, max_tokens=1))
    runner = FakeRunner(sched)
    runner.run_to_completion()
    b = make_req("b", prompt, max_tokens=4)
    sched.add_request(b)
    out, _ = runner.step()
    assert b.num_cached_tokens == 12
    assert len(sched.kv.block_ids("b")) == 4
    assert sched.kv.num_free_blocks == 32 - 4


def test_prefix_hit_then_chunked_prefill_publishes_only_computed_blocks() -> None:
    # b shares a 40-token prompt with a, whose later blocks were evicted: b hits the head and
    # prefills the rest in chunks. b is aborted after its first chunk; c, with the same prompt,
    # must only hit blocks that hold computed keys (the fake runner checks every position).
    sched = make_scheduler(num_blocks=24, budget=8)
    prompt = prompt_of(40)
    sched.add_request(make_req("a", prompt, max_tokens=1))
    runner = FakeRunner(sched)
    runner.run_to_completion()
    # a's blocks are freed tail-first; the filler's 20 blocks evict a's blocks 9..4.
    sched.add_request(make_req("filler", prompt_of(80, 5000), max_tokens=1))
    runner.run_to_completion()
    b = make_req("b", prompt, max_tokens=2)
    sched.add_request(b)
    out, _ = runner.step()
    assert b.num_cached_tokens == 16
    assert [(s.context_len, s.num_new_tokens) for s in out.scheduled] == [(16, 8)]
    assert len(sched.kv.block_ids("b")) == 6  # 24 tokens after this step
    sched.abort_requests(["b"])
    c = make_req("c", prompt + [7], max_tokens=2)
    sched.add_request(c)
    out, _ = runner.step()
    assert c.num_cached_tokens == 24
    runner.run_to_completion()
    assert_all_blocks_free(sched)


def test_same_step_prefix_sharing_between_new_requests() -> None:
    # Two identical prompts admitted in one step: the second may hit blocks the first fills
    # in the same step (attention writes before it reads).
    sched = make_scheduler(budget=64)
    prompt = prompt_of(9)
    a, b = make_req("a", prompt, max_tokens=2), make_req("b", prompt, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert b.num_cached_tokens == 8
    assert sched.kv.block_ids("a")[:2] == sched.kv.block_ids("b")[:2]
    runner.run_to_completion()
    assert_all_blocks_free(sched)


def test_priority_unscheduled_victim_leaves_no_uncomputed_block_in_prefix_cache() -> None:
    # p5 is scheduled first in a step (its decode would complete its block 1), then p0's chunk
    # needs more blocks than are free: p5 is preempted (un-scheduled) and p0 too. p5's block 1
    # was published for this step but never computed; a later request with the same tokens
    # must not get it as a cache hit.
    sched = make_scheduler(num_blocks=5, budget=13, policy="priority")
    p5 = make_req("p5", prompt_of(6), max_tokens=20, priority=5, arrival=0.0)
    sched.add_request(p5)
    runner = FakeRunner(sched)
    runner.step()
    p0 = make_req("p0", prompt_of(40, 300), max_tokens=20, priority=0, arrival=1.0)
    sched.add_request(p0)
    runner.step()  # p5 decode, p0 chunk of 12
    out, _ = runner.step()
    assert p5.status == RequestStatus.PREEMPTED and p0.status == RequestStatus.PREEMPTED
    assert out.scheduled == []
    assert p5.num_tokens == 8  # positions 0..6 computed, position 7 never
    sched.abort_requests(["p0"])
    d = make_req("d", p5.all_token_ids + [9], max_tokens=1, priority=-1, arrival=2.0)
    sched.add_request(d)
    out = sched.schedule()
    assert d.num_cached_tokens == 4
    runner.execute(out)  # and every cached position d reads holds its token


# ---- randomized workload ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3, 5])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_randomized_workload_keeps_cache_consistent(seed: int, policy: str) -> None:
    """Arrivals with shared prefixes, a small pool (preemptions), chunked prefill and aborts.
    The fake runner checks every cached position each step; outputs must not depend on
    preemption, and everything is released at the end."""
    import random

    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=14, budget=rng.choice([5, 8, 13]), max_seqs=4,
                           policy=policy)
    runner = FakeRunner(sched)
    bases = [[rng.randint(10, 60) for _ in range(20)] for _ in range(3)]
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    finals: dict[str, EngineCoreOutput] = {}
    n = 0
    for _ in range(300):
        if n < 25 and rng.random() < 0.35:
            prompt = rng.choice(bases)[: rng.randint(1, 20)] + [rng.randint(10, 60)
                                                                for _ in range(rng.randint(0, 5))]
            mt = rng.randint(1, 10)
            rid = f"r{n}"
            n += 1
            sched.add_request(make_req(rid, prompt, max_tokens=mt, priority=rng.randint(0, 3),
                                       arrival=float(n)))
            expected[rid] = mt
        if sched.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(sched.requests))
            sched.abort_requests([rid])
            aborted.add(rid)
        if not sched.has_unfinished_requests():
            continue
        _, outs = runner.step()
        for o in outs:
            if o.finish_reason is not None:
                finals[o.request_id] = o
    finals.update(runner.run_to_completion())
    assert set(finals) == set(expected)
    for rid, o in finals.items():
        if rid in aborted:
            assert o.finish_reason == "abort"
        else:
            assert o.finish_reason == "length"
    assert_all_blocks_free(sched)
    # The seeds are chosen so the run exercised preemption and prefix reuse.
    assert sched.num_preemptions > 0
    assert sched.kv.prefix_hits > 0


# ---- request timeouts -------------------------------------------------------------------------


def test_requests_older_than_the_timeout_end_with_an_error() -> None:
    import time

    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=256)
    sched = Scheduler(sc, cc, 64, request_timeout=30.0)
    now = time.monotonic()
    old_running = make_req("old-running", prompt_of(5), arrival=now - 25)
    fresh = make_req("fresh", prompt_of(5, 600), arrival=now)
    old_waiting = make_req("old-waiting", prompt_of(6, 300), arrival=now - 25)
    for r in (old_running, fresh, old_waiting):
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.step()  # two sequences at most: old-waiting waits
    assert old_waiting.status == RequestStatus.WAITING
    old_running.arrival_time = old_waiting.arrival_time = now - 31  # both now past 30 s
    sched.table._next_expiry_check = 0.0
    out, outs = runner.step()
    errors = {o.request_id: o.error for o in outs if o.finish_reason == "error"}
    assert set(errors) == {"old-running", "old-waiting"}
    assert "request_timeout (30 s)" in errors["old-running"]
    assert {o.error_code for o in outs if o.finish_reason == "error"} == {ErrorCode.TIMED_OUT}
    assert [s.request_id for s in out.scheduled] == ["fresh"]
    runner.run_to_completion()
    assert_all_blocks_free(sched)


# ---- non-finite values: the scheduler zeroes what the failed request leaves -----------------


def test_failed_request_preempted_with_its_step_in_flight_zeroes_only_unowned_slots() -> None:
    """Async scheduling: "a" is preempted while its step is in flight and "c" takes one of
    its blocks and schedules a token into its first slot; then a's step turns out to have
    produced non-finite logits. The block nobody owns is zeroed whole, c's block only past
    the slot c has written, and a's blocks leave the prefix cache."""
    sched = make_scheduler(num_blocks=4)
    c = make_req("c", prompt_of(8), max_tokens=4)
    a = make_req("a", prompt_of(8, 300), max_tokens=4)
    sched.add_request(c)
    sched.add_request(a)
    step1 = sched.schedule()  # both prefill 8 tokens (2 blocks each) and sample
    a_blocks = list(sched.kv.block_ids("a"))
    a_hashes = list(a.block_hashes)
    assert all(sched.kv.pool.get_cached_block(h) for h in a_hashes)
    step2 = sched.schedule()  # c needs a third block: a is preempted, its last block reused
    assert a.status == RequestStatus.PREEMPTED and [s.request_id for s in step2.scheduled] == [
        "c"]
    reused = sched.kv.block_ids("c")[2]
    assert reused == a_blocks[1]
    outs = sched.update(step1, ModelRunnerOutput(sampled_token_ids={c.serial: 5},
                                                 failed_serials={a.serial}))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("c", None), ("a", "error")]
    assert not any(sched.kv.pool.get_cached_block(h) for h in a_hashes)
    sched.update(step2, ModelRunnerOutput(sampled_token_ids={c.serial: 6}))
    step3 = sched.schedule()
    assert sorted(step3.kv_zero) == sorted([(a_blocks[0], 0), (reused, 1)])
    assert sched.schedule().kv_zero == []  # handed out once
