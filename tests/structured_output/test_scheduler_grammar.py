"""The scheduler's side of structured outputs, with a stand-in grammar (no torch, no grammar
engine): a request waits for its own grammar, stops when the grammar terminates, and ends
with an error on a token the grammar refuses."""

from __future__ import annotations

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.errors import ErrorCode
from shoal.core.request import Request
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.engine.scheduler import Scheduler
from shoal.sampling_params import SamplingParams


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                     max_model_len=256), CacheConfig(block_size=4), 64)


def make_req(rid: str, prompt: list[int], max_tokens: int = 16, **sp: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sp)  # type: ignore[arg-type]
    return Request(rid, prompt, params, frozenset({2}), max_tokens)


def prompt_of(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


class FakeGrammar:
    def __init__(self, accepts: int, ready: bool = True):
        self.ready = ready
        self.left = accepts  # tokens until the grammar is complete
        self.refuse: int | None = None

    def is_ready(self) -> bool:
        return self.ready

    def accept(self, token: int) -> bool:
        if token == self.refuse:
            return False
        self.left -= 1
        return True

    @property
    def ended(self) -> bool:  # StructuredRequest's: complete (or refused) after accept()
        return self.left <= 0


def step(sched, token: int = 7):
    out = sched.schedule()
    result = ModelRunnerOutput(sampled_token_ids={s.serial: token for s in out.scheduled
                                                  if s.sample})
    return out, sched.update(out, result)


def test_a_request_waits_only_for_its_own_grammar():
    sched = make_scheduler()
    slow = make_req("slow", prompt_of(5), max_tokens=8)
    slow.structured = FakeGrammar(3, ready=False)
    free = make_req("free", prompt_of(5, 300), max_tokens=8)
    sched.add_request(slow)
    sched.add_request(free)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["free"]
    slow.structured.ready = True
    out, _ = step(sched)
    assert {s.request_id for s in out.scheduled} == {"free", "slow"}


def test_the_grammar_ends_the_request_with_stop():
    sched = make_scheduler()
    req = make_req("r", prompt_of(5), max_tokens=50, ignore_eos=True)
    req.structured = FakeGrammar(3)
    sched.add_request(req)
    finishes = []
    for _ in range(5):
        _, outs = step(sched)
        finishes += [o.finish_reason for o in outs if o.finish_reason]
    assert finishes == ["stop"] and req.num_output_tokens == 3


def test_a_refused_token_is_an_error_not_a_silent_answer():
    sched = make_scheduler()
    req = make_req("r", prompt_of(5), max_tokens=50)
    req.structured = FakeGrammar(10)
    req.structured.refuse = 9
    sched.add_request(req)
    step(sched)
    _, outs = step(sched, token=9)
    assert outs[0].finish_reason == "error" and "grammar" in outs[0].error
    assert outs[0].error_code == ErrorCode.OUTSIDE_GRAMMAR


def test_fail_request_reports_a_bad_request():
    sched = make_scheduler()
    req = make_req("r", prompt_of(5))
    req.structured = FakeGrammar(1, ready=False)
    sched.add_request(req)
    sched.fail_request(req, "structured_outputs.regex is invalid")
    (out,) = sched.take_pending_outputs()
    assert out.error == "structured_outputs.regex is invalid"
    assert out.error_code == ErrorCode.BAD_REQUEST
    assert not sched.has_unfinished_requests()
