"""AsyncLLM's routing, aborts, queue limit and engine-death handling, over a fake client."""

from __future__ import annotations

import asyncio

import pytest

from shoal.core.errors import ErrorCode
from shoal.core.types import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from shoal.engine.async_llm import AsyncLLM, QueueFullError
from shoal.engine.core_client import EngineDeadError
from shoal.engine.core_messages import CoreOutputs, Ready, Rejection
from shoal.engine.engine_args import EngineArgs
from shoal.engine.output_processor import OutputKind
from shoal.engine.request_checks import EngineLimits
from shoal.engine.request_errors import (
    BadRequestError,
    EngineRequestError,
    ReplicaLostError,
    RequestTimeoutError,
)
from shoal.metrics.stats import IterationStats
from shoal.sampling_params import SamplingParams

VOCAB = 100
pytestmark = pytest.mark.anyio  # anyio's pytest plugin runs the async tests


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeClient:
    def __init__(self):
        self.added: list = []
        self.aborted: list[str] = []
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.dead = False
        self.is_alive = True
        self._on_dead = []

    def on_dead(self, cb):
        self._on_dead.append(cb)

    def add_request(self, req):
        self.added.append(req)

    def abort_requests(self, ids):
        self.aborted.extend(ids)

    def engine_of(self, request_id):
        return 0

    async def get_outputs(self):
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def shutdown(self):
        pass

    def push(self, *outs: EngineCoreOutput, stats=None, **kw):
        self.outputs.put_nowait(CoreOutputs(EngineCoreOutputs(list(outs), stats), **kw))

    def die(self):
        self.dead, self.is_alive = True, False
        for cb in self._on_dead:
            cb()


class Recorder:
    def __init__(self):
        self.iterations: list[IterationStats] = []

    def record(self, stats, it, engine=0):
        self.iterations.append(it)

    def log(self):
        pass


async def make_engine(**args) -> tuple[AsyncLLM, FakeClient, Recorder]:
    client = FakeClient()
    limits = EngineLimits(vocab_size=VOCAB, max_model_len=64, num_kv_blocks=16, block_size=16,
                          max_num_seqs=args.get("max_num_seqs") or 64,
                          eos_token_ids=frozenset([2]))
    client.max_num_seqs = limits.max_num_seqs  # what the engine(s) still running batch
    engine = AsyncLLM(EngineArgs(device="cpu", **args), client, Ready(limits, pid=0), None)
    rec = Recorder()
    engine.stat_loggers.append(rec)
    return engine, client, rec


def sp(**kw) -> SamplingParams:
    return SamplingParams(detokenize=False, **kw)


async def test_outputs_are_routed_and_timed():
    engine, client, rec = await make_engine()
    got = []

    async def consume():
        async for out in engine.generate([5, 6], sp(max_tokens=2), "r1",
                                         output_kind=OutputKind.DELTA):
            got.append(out)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    assert [r.request_id for r in client.added] == ["r1"]
    client.push(EngineCoreOutput("r1", [10], queue_time=0.25))
    client.push(EngineCoreOutput("r1", [11], finish_reason="length"),
                stats=SchedulerStats(num_running=0))
    await asyncio.wait_for(task, 5)
    assert [o.outputs[0].token_ids for o in got] == [[10], [11]]
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "length"
    assert engine.num_unfinished_requests == 0 and client.aborted == []
    its = rec.iterations
    assert len(its[0].time_to_first_tokens) == 1 and its[0].queue_times == [0.25]
    assert len(its[1].inter_token_latencies) == 1
    (fin,) = its[1].finished
    assert (fin.finish_reason, fin.num_prompt_tokens, fin.num_generation_tokens) == \
        ("length", 2, 2)
    await engine.shutdown()


async def test_cancelled_consumer_aborts_every_child():
    engine, client, rec = await make_engine()

    async def consume():
        async for _ in engine.generate([5], sp(n=2, max_tokens=50), "r"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    assert [r.request_id for r in client.added] == ["0_r", "1_r"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(client.aborted) == ["0_r", "1_r"]
    assert engine.num_unfinished_requests == 0
    assert rec.iterations[-1].finished[0].finish_reason == "abort"
    await engine.shutdown()


async def test_validation_happens_before_the_core():
    engine, client, _ = await make_engine()
    for prompt, params in (([VOCAB + 1], sp()), ([], sp()), ([1] * 64, sp()),
                           ([1], sp(logit_bias={VOCAB: 1.0}))):
        with pytest.raises(ValueError):
            engine.add_request("x", prompt, params)
    assert client.added == [] and engine.num_unfinished_requests == 0
    await engine.shutdown()


async def test_waiting_queue_limit():
    engine, client, _ = await make_engine(max_num_seqs=1, max_waiting_requests=1)
    engine.add_request("a", [1], sp())
    engine.add_request("b", [1], sp())  # waits
    with pytest.raises(QueueFullError) as err:
        engine.add_request("c", [1], sp())
    assert err.value.retry_after >= 1
    engine.abort("a")
    engine.add_request("c", [1], sp())  # room again
    with pytest.raises(ValueError, match="can ever hold"):
        engine.add_request("d", [1], sp(n=3))
    await engine.shutdown()


async def test_core_rejection_fails_only_that_request():
    engine, client, _ = await make_engine()
    bad = engine.add_request("bad", [1], sp(n=2))
    good = engine.add_request("good", [1], sp(max_tokens=1))
    client.push(EngineCoreOutput("good", [3], finish_reason="length"),
                rejected={"1_bad": Rejection("no room")})
    with pytest.raises(ValueError, match="no room"):
        async for _ in bad:
            pass
    assert "0_bad" in client.aborted
    outs = [o async for o in good]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [3]
    await engine.shutdown()


@pytest.mark.parametrize("code, exc", [
    (ErrorCode.BAD_REQUEST, BadRequestError), (ErrorCode.TIMED_OUT, RequestTimeoutError),
    (ErrorCode.NON_FINITE, EngineRequestError), (None, EngineRequestError),
], ids=["bad-request", "timed-out", "non-finite", "no-code"])
async def test_an_error_output_raises_the_exception_of_its_code(code, exc):
    engine, client, _ = await make_engine()
    stream = engine.add_request("e", [1], sp(max_tokens=5))
    client.push(EngineCoreOutput("e", [], finish_reason="error", error="it went wrong",
                                 error_code=code))
    with pytest.raises(exc, match="it went wrong") as raised:
        async for _ in stream:
            pass
    assert raised.value.code == (code or ErrorCode.ENGINE_FAILED)
    await engine.shutdown()


async def test_rejections_and_lost_requests_raise_by_their_code():
    engine, client, _ = await make_engine()
    broken = engine.add_request("broken", [1], sp())
    lost = engine.add_request("lost", [1], sp())
    client.push(rejected={"broken": Rejection("KeyError: 3", ErrorCode.ENGINE_FAILED)},
                lost={"lost": "engine replica 1 died"})
    with pytest.raises(EngineRequestError, match="KeyError"):
        async for _ in broken:
            pass
    with pytest.raises(ReplicaLostError, match="replica 1 died") as raised:
        async for _ in lost:
            pass
    assert isinstance(raised.value, EngineDeadError) and engine.is_healthy
    await engine.shutdown()


async def test_engine_death_fails_in_flight_and_new_requests():
    engine, client, _ = await make_engine()
    dead_seen = []
    engine.on_dead(lambda: dead_seen.append(True))
    stream = engine.add_request("a", [1], sp())
    client.die()
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    assert dead_seen == [True] and not engine.is_healthy
    with pytest.raises(EngineDeadError):
        engine.add_request("b", [1], sp())
    await engine.shutdown()


async def test_drain_hands_over_everything_that_arrived_then_the_error():
    engine, client, _ = await make_engine()
    stream = engine.add_request("d", [5, 6], sp(max_tokens=5), output_kind=OutputKind.DELTA)
    for t in (10, 11, 12):
        client.push(EngineCoreOutput("d", [t]))
    await asyncio.sleep(0.05)  # the output handler routes all three before anyone reads
    batch = await stream.drain()
    assert [o.outputs[0].token_ids for o in batch] == [[10], [11], [12]]
    client.push(EngineCoreOutput("d", [13]))
    client.push(EngineCoreOutput("d", [], finish_reason="error", error="non-finite logits"))
    await asyncio.sleep(0.05)
    batch = await stream.drain()  # the token that came before the error is not lost
    assert [o.outputs[0].token_ids for o in batch] == [[13]]
    with pytest.raises(Exception, match="non-finite"):
        await stream.drain()
    assert await stream.drain() == []
    await engine.shutdown()


async def test_phase_times_and_token_counts_reach_the_stat_loggers():
    engine, client, rec = await make_engine()
    task = asyncio.create_task(_drain(engine.generate([5, 6, 7], sp(max_tokens=3), "p")))
    await asyncio.sleep(0)
    client.push(EngineCoreOutput("p", [10], queue_time=0.0, num_cached_tokens=2))
    await asyncio.sleep(0.01)
    client.push(EngineCoreOutput("p", [11], num_cached_tokens=2))
    client.push(EngineCoreOutput("p", [12], finish_reason="length", num_cached_tokens=2))
    await asyncio.wait_for(task, 5)
    its = rec.iterations
    assert its[0].num_prompt_tokens == 3 and its[0].num_cached_prompt_tokens == 2
    assert sum(it.num_generation_tokens for it in its) == 3
    (fin,) = [f for it in its for f in it.finished]
    assert (fin.max_tokens, fin.num_cached_tokens, fin.num_generation_tokens) == (3, 2, 3)
    (parent,) = [p for it in its for p in it.finished_parents]
    assert (parent.n, parent.max_num_generation_tokens) == (1, 3)
    assert fin.queued_time == 0.0 and fin.decode_time >= 0.01
    assert fin.inference_time == pytest.approx(fin.prefill_time + fin.decode_time)
    await engine.shutdown()


async def test_abort_all_fails_requests_but_keeps_the_engine():
    engine, client, rec = await make_engine()
    stream = engine.add_request("x", [5], sp(n=2, max_tokens=50))
    engine.abort_all(RuntimeError("deadline"))
    with pytest.raises(RuntimeError, match="deadline"):
        await stream.drain()
    assert sorted(client.aborted) == ["0_x", "1_x"] and engine.num_unfinished_requests == 0
    assert engine.is_healthy and rec.iterations[-1].finished[0].finish_reason == "error"
    await engine.shutdown()


async def test_max_logprobs_and_minus_one():
    engine, _, _ = await make_engine()
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.add_request("a", [5], sp(logprobs=21))
    with pytest.raises(ValueError, match="whole vocabulary"):
        engine.add_request("b", [5], sp(prompt_logprobs=-1))
    await engine.shutdown()
    engine, client, _ = await make_engine(max_logprobs=-1)
    engine.add_request("c", [5], sp(logprobs=-1, prompt_logprobs=-1))
    (req,) = client.added
    assert req.sampling_params.logprobs == VOCAB and req.sampling_params.prompt_logprobs == VOCAB
    await engine.shutdown()


async def _drain(gen) -> None:
    async for _ in gen:
        pass
