"""The scheduler with speculative decoding, driven by a fake runner that mirrors the paged KV
cache token by token (as tests/engine/test_scheduler.py does) and verifies drafts against a
known true continuation. A rejected draft whose slot were read as context, a block left
holding only rejected drafts, or a draft reaching the prefix cache fails here."""

from __future__ import annotations

import random

import pytest
from engine.test_scheduler import BS, EOS, assert_all_blocks_free, make_req, prompt_of

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.request import RequestStatus
from shoal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.core.types import EngineCoreOutput
from shoal.engine.draft_budget import (
    MAX_WORTH,
    MIN_WORTH,
    WORTH_HALF_BATCH,
    adaptive_num_drafts,
    worth_threshold,
)
from shoal.engine.scheduler import Scheduler

K = 3


def spec_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16,
                   max_model_len: int = 256, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks,
                     num_speculative_tokens=K)


def truth(prompt: tuple[int, ...], n_out: int) -> int:
    """The 'model': output n_out of a request, a function of its prompt (so requests with
    one prompt agree, as they must for the prefix cache)."""
    return 1000 + (sum(prompt) * 7 + n_out * 13) % 50


class FakeSpecRunner:
    def __init__(self, sched: Scheduler, seed: int = 0, eos_at: int | None = None):
        self.sched = sched
        self.bs = sched.block_size
        self.cache: dict[int, tuple[tuple[int, ...], int]] = {}  # slot -> (prefix, token)
        self.tokens: dict[int, list[int]] = {}
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.rng = random.Random(seed)
        self.eos_at = eos_at  # output index at which the truth says EOS
        self.steps: list[SchedulerOutput] = []
        self.num_verified = 0

    def _true(self, serial: int, n_out: int) -> int:
        if self.eos_at is not None and n_out == self.eos_at:
            return EOS
        return truth(self.prompts[serial], n_out)

    def _drafts(self, serial: int) -> list[int]:
        """Up to K drafts: the truth for a random number of them, then wrong ones."""
        n_out = len(self.tokens[serial]) - len(self.prompts[serial])
        right = self.rng.randrange(K + 1)
        return [self._true(serial, n_out + j) if j < right else 7 for j in range(K)]

    def _slot(self, item, pos: int) -> int:
        return item.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for nr in out.new_requests:
            self.prompts[nr.serial] = tuple(nr.prompt_token_ids)
            self.tokens[nr.serial] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
        res = ModelRunnerOutput()
        for item in out.scheduled:  # write first, as attention does per layer
            toks = self.tokens[item.serial]
            k = item.num_draft_tokens
            known = item.input_token_ids[:item.num_new_tokens - k]
            assert known == toks[item.context_len:item.context_len + len(known)]
            assert len(item.block_ids) >= -(-(item.context_len + item.num_new_tokens) // self.bs)
            seq = toks[:item.context_len] + item.input_token_ids
            for j, t in enumerate(item.input_token_ids):
                pos = item.context_len + j
                self.cache[self._slot(item, pos)] = (tuple(seq[:pos]), t)
        for item in out.scheduled:
            toks = self.tokens[item.serial]
            for pos in range(item.context_len):
                got = self.cache.get(self._slot(item, pos))
                assert got is not None and got[1] == toks[pos] and got[0] == tuple(toks[:pos]), (
                    f"{item.request_id}: cached position {pos} holds {got}, expected "
                    f"{toks[pos]}")
            if not item.sample:
                continue
            n_out = len(toks) - len(self.prompts[item.serial])
            k = item.num_draft_tokens
            drafts = item.input_token_ids[len(item.input_token_ids) - k:] if k else []
            kept = []
            for j in range(k + 1):
                t = self._true(item.serial, n_out + j)
                kept.append(t)
                if j == k or drafts[j] != t:
                    break
            toks.extend(kept)
            res.sampled_token_ids[item.serial] = kept[0]
            if k:
                self.num_verified += 1
                res.verified_token_ids[item.serial] = kept
            res.draft_token_ids[item.serial] = self._drafts(item.serial)
        self.steps.append(out)
        return res

    def step(self) -> list[EngineCoreOutput]:
        out = self.sched.schedule()
        assert out.num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        outs = self.sched.update(out, self.execute(out))
        for serial in self.sched.take_finished_serials():
            self.tokens.pop(serial, None)
        for req in self.sched.running:  # rejected drafts' blocks went back to the pool
            held = len(self.sched.kv.req_blocks.get(req.request_id, []))
            assert held <= -(-req.num_computed_tokens // self.bs) or not any(
                it.request_id == req.request_id and it.num_draft_tokens for it in out.scheduled)
            assert req.num_computed_tokens <= req.num_tokens
        return outs

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return got
            for o in self.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        raise AssertionError("did not finish")


def expected(prompt: list[int], n: int, eos_at: int | None = None) -> list[int]:
    out = []
    for i in range(n):
        if eos_at is not None and i == eos_at:
            return out + [EOS]
        out.append(truth(tuple(prompt), i))
    return out


def test_verify_steps_give_the_true_tokens_and_roll_back() -> None:
    sched = spec_scheduler()
    prompts = {f"r{i}": prompt_of(3 + 5 * i, start=100 * i) for i in range(6)}
    for rid, p in prompts.items():
        sched.add_request(make_req(rid, p, max_tokens=20))
    runner = FakeSpecRunner(sched)
    got = runner.run()
    assert got == {rid: expected(p, 20) for rid, p in prompts.items()}
    assert runner.num_verified > 20
    # verify items travel with the chunks, never as decodes
    for out in runner.steps:
        assert all(it.num_draft_tokens == 0 for it in out.scheduled[:out.num_decodes])
    assert_all_blocks_free(sched)


def test_rejected_drafts_blocks_return_to_the_pool() -> None:
    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(BS), max_tokens=40))  # prompt fills one block
    runner = FakeSpecRunner(sched)
    runner.rng = random.Random(1)
    runner.step()  # prefill; drafts proposed
    req = sched.requests["a"]
    req.spec_token_ids = [7, 7, 7]  # all wrong: the verify's extra block only holds rejects
    before = sched.kv.num_free_blocks
    out = sched.schedule()
    assert out.scheduled[0].num_draft_tokens == K
    assert sched.kv.num_free_blocks == before - 1  # a block for positions 4..7
    sched.update(out, runner.execute(out))
    assert req.num_computed_tokens == BS + 1 and req.num_output_tokens == 2
    assert sched.kv.num_free_blocks == before - 1  # position 4 (accepted) keeps that block
    assert len(sched.kv.block_ids("a")) == 2


def test_trim_frees_a_block_of_rejects_only() -> None:
    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(BS - 1), max_tokens=40))
    runner = FakeSpecRunner(sched)
    runner.step()  # prefill of 3 tokens, 1 output: 4 tokens, 3 computed
    req = sched.requests["a"]
    req.spec_token_ids = [7, 7, 7]
    free = sched.kv.num_free_blocks
    out = sched.schedule()  # position 3 and drafts at 4..6: a second block
    assert sched.kv.num_free_blocks == free - 1
    sched.update(out, runner.execute(out))
    assert req.num_computed_tokens == BS  # the block of rejects is back in the pool
    assert sched.kv.num_free_blocks == free and len(sched.kv.block_ids("a")) == 1


def test_stop_token_inside_the_accepted_run_ends_there() -> None:
    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(5), max_tokens=30))
    runner = FakeSpecRunner(sched, seed=3, eos_at=9)
    runner.rng = random.Random(0)
    got = runner.run()
    assert got["a"] == expected(prompt_of(5), 30, eos_at=9)
    assert_all_blocks_free(sched)


def test_drafts_never_pass_max_tokens_or_max_model_len() -> None:
    sched = spec_scheduler(max_model_len=24)
    sched.add_request(make_req("a", prompt_of(10), max_tokens=7))
    sched.add_request(make_req("b", prompt_of(18, start=300), max_tokens=50))
    runner = FakeSpecRunner(sched)
    runner.rng.randrange = lambda n: K  # always right: drafts stop only at the limits
    got = runner.run()
    assert len(got["a"]) == 7 and len(got["b"]) == 24 - 18
    assert_all_blocks_free(sched)


def test_prefix_cache_after_partial_acceptance() -> None:
    """Requests with one prompt, one after the other: the later ones hit the blocks the
    earlier ones filled through verify steps with rejected drafts, and the fake cache checks
    that every hit holds the accepted tokens."""
    sched = spec_scheduler(num_blocks=64)
    prompt = prompt_of(9)
    runner = FakeSpecRunner(sched, seed=5)
    sched.add_request(make_req("first", prompt, max_tokens=25))
    first = runner.run()["first"]
    assert first == expected(prompt, 25)
    # The next prompt extends the first's output: its full blocks come from the cache.
    follow = prompt + first[:20]
    sched.add_request(make_req("second", follow, max_tokens=10))
    hits_before = sched.kv.prefix_hits
    second = runner.run()["second"]
    assert sched.kv.prefix_hits - hits_before >= (len(follow) // BS - 1) * BS
    assert second == expected(follow, 10)
    assert_all_blocks_free(sched)


def test_preemption_of_speculating_requests() -> None:
    sched = spec_scheduler(num_blocks=14, budget=32)
    prompts = {f"r{i}": prompt_of(6 + i, start=100 * i) for i in range(5)}
    for rid, p in prompts.items():
        sched.add_request(make_req(rid, p, max_tokens=18))
    runner = FakeSpecRunner(sched, seed=2)
    got = runner.run()
    assert sched.num_preemptions > 0
    assert runner.num_verified > 0
    assert got == {rid: expected(p, 18) for rid, p in prompts.items()}
    assert_all_blocks_free(sched)


def test_abort_while_a_verify_step_runs() -> None:
    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(6), max_tokens=30))
    sched.add_request(make_req("b", prompt_of(6, start=200), max_tokens=30))
    runner = FakeSpecRunner(sched)
    runner.step()
    for rid in ("a", "b"):
        sched.requests[rid].spec_token_ids = [7, 7, 7]
    out = sched.schedule()
    assert all(it.num_draft_tokens == K for it in out.scheduled)
    result = runner.execute(out)
    sched.abort_requests(["a"])  # while the verify step "runs"
    outs = sched.update(out, result)
    assert [o.request_id for o in outs] == ["a", "b"] and outs[0].finish_reason == "abort"
    assert sched.requests["b"].status == RequestStatus.RUNNING
    assert "a" not in sched.kv.req_blocks
    sched.abort_requests(["b"])
    assert_all_blocks_free(sched)


def test_spec_stats_count_drafts_and_accepted_tokens_by_position() -> None:
    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(6), max_tokens=40))
    runner = FakeSpecRunner(sched)
    totals = {"drafts": 0, "tokens": 0, "accepted": 0}
    per_pos = [0] * K
    while sched.has_unfinished_requests():
        runner.step()
        s = sched.stats()
        totals["drafts"] += s.spec_num_drafts
        totals["tokens"] += s.spec_num_draft_tokens
        totals["accepted"] += s.spec_num_accepted_tokens
        for i, v in enumerate(s.spec_num_accepted_tokens_per_pos or []):
            per_pos[i] += v
    assert totals["drafts"] == runner.num_verified > 0
    assert totals["accepted"] == sum(per_pos) > 0
    assert per_pos == sorted(per_pos, reverse=True)  # position i needs all before it
    assert totals["tokens"] <= K * totals["drafts"]


def test_backoff_after_drafts_that_keep_failing() -> None:
    """Verifies in a row with nothing accepted (three while no draft was ever accepted; two
    at least, with the acceptance estimate low, after one was): the request decodes without
    drafts for 4 steps, then tries again; a further backoff doubles the pause; an
    acceptance ends it."""
    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(6), max_tokens=200))
    runner = FakeSpecRunner(sched)
    runner._drafts = lambda serial: [7, 7, 7]  # never right
    runner.step()
    req = sched.requests["a"]
    drafted = []
    for _ in range(30):
        out = sched.schedule()
        drafted.append(out.scheduled[0].num_draft_tokens > 0)
        sched.update(out, runner.execute(out))
    # Three misses (none ever accepted: MISSES_BEFORE_FIRST_HIT, whatever the estimate,
    # still near the prior's 0.8), 4 plain, a miss, 8 plain, a miss, 16 plain.
    assert drafted == [True] * 3 + [False] * 4 + [True] + [False] * 8 + [True] + [False] * 13
    assert req.spec_backoffs == 3 and req.spec_skip > 0
    req.spec_skip, req.spec_hits, req.spec_fails = 0, 3.0, 0.0  # the estimate recovered
    req.spec_token_ids = [runner._true(req.serial, req.num_output_tokens), 7, 7]  # one right
    out = sched.schedule()
    assert out.scheduled[0].num_draft_tokens == K
    sched.update(out, runner.execute(out))
    assert req.spec_misses == req.spec_backoffs == req.spec_skip == 0


def test_adaptive_budget_follows_acceptance_and_batch_size() -> None:
    """The estimate p: a fresh request verifies all k drafts; one whose drafts have been
    failing verifies none (p below the small-batch threshold), then fewer than k while right
    drafts raise p again, then k; at a large batch only near-certain drafts pay."""
    assert worth_threshold(1) == worth_threshold(8) == MIN_WORTH
    # the ramp up to 32 running, then n / (n + WORTH_HALF_BATCH) up to MAX_WORTH (issue 38)
    assert worth_threshold(32) == pytest.approx(MIN_WORTH + (MAX_WORTH - MIN_WORTH) * 24 / 56)
    assert worth_threshold(64) == pytest.approx(64 / (64 + WORTH_HALF_BATCH))
    values = [worth_threshold(n) for n in range(1, 2000)]
    assert values == sorted(values) and values[-1] == MAX_WORTH > worth_threshold(64)
    assert adaptive_num_drafts(3.0, 0.0, 4, MIN_WORTH) == 4
    assert adaptive_num_drafts(0.0, 3.0, 4, MIN_WORTH) == 1  # p = 0.2
    assert adaptive_num_drafts(0.0, 9.0, 4, MIN_WORTH) == 0  # p = 1/11
    assert adaptive_num_drafts(3.0, 0.0, 4, MAX_WORTH) == 0  # p = 0.8 at a full batch
    assert adaptive_num_drafts(20.0, 0.0, 4, MAX_WORTH) == 2  # p = 21/22, p**3 < 0.9

    sched = spec_scheduler()
    sched.add_request(make_req("a", prompt_of(6), max_tokens=200))
    runner = FakeSpecRunner(sched)

    def drafts(serial: int) -> list[int]:  # always right
        n_out = len(runner.tokens[serial]) - len(runner.prompts[serial])
        return [runner._true(serial, n_out + j) for j in range(K)]

    runner._drafts = drafts
    runner.step()
    req = sched.requests["a"]
    counts = []
    for step in range(12):
        if step == 1:  # as after many failed drafts
            req.spec_hits, req.spec_fails = 0.0, 12.0
        out = sched.schedule()
        counts.append(out.scheduled[0].num_draft_tokens)
        sched.update(out, runner.execute(out))
    assert counts[0] == K
    assert counts[1] == 0  # not worth a draft now...
    assert 0 < counts[2] < K  # ...one step of decay later, a cautious try
    assert counts[-1] == K  # right drafts bring k back


def test_disable_by_batch_size_stops_drafting() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16,
                                      max_model_len=256),
                      CacheConfig(block_size=BS, enable_prefix_caching=True), 64,
                      num_speculative_tokens=K, spec_disable_by_batch_size=2)
    for name in "ab":
        sched.add_request(make_req(name, prompt_of(6, start=100 * ord(name)), max_tokens=20))
    runner = FakeSpecRunner(sched)
    runner.step()
    for req in sched.requests.values():
        req.spec_token_ids = [7] * K
    out = sched.schedule()
    assert all(it.num_draft_tokens == 0 for it in out.scheduled)
