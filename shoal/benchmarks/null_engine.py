"""A model-free engine core, to measure the serving path alone.

`NullEngineCore` has EngineCore's interface (add_request, abort_requests, step, limits,
shutdown) but no model: each step gives every running request (up to max_num_seqs) one token
and takes `step_time_s` of wall time, like a GPU step of that length. Like the engine, it ends
a request older than `request_timeout` with ErrorCode.TIMED_OUT. Behind `shoal serve`'s
frontend, it shows how many tokens per second the frontend, the IPC and the HTTP layer can
carry, and how much CPU they spend per token, on any machine.

    python -m shoal.benchmarks.null_engine --port 8000 --step-time-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from dataclasses import dataclass

from shoal.core.errors import ErrorCode
from shoal.core.types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from shoal.engine.request_checks import EngineLimits, validate_core_request
from shoal.engine.request_table import timeout_message

# Ids of ordinary word pieces in SmolLM2's vocabulary, so detokenizing costs what text does.
TOKEN_RANGE = (1000, 9000)


@dataclass
class _Running:
    request_id: str
    remaining: int
    next_token: int
    arrival_time: float  # time.monotonic(), from the frontend


class NullEngineCore:
    def __init__(self, limits: EngineLimits, step_time_s: float = 0.01,
                 request_timeout: float | None = None):
        self.limits = limits
        self.step_time_s = step_time_s
        self.request_timeout = request_timeout
        self._running: dict[str, _Running] = {}
        self._waiting: list[_Running] = []
        self._pending: list[EngineCoreOutput] = []
        self._next_step = time.perf_counter()

    def add_request(self, req: EngineCoreRequest) -> None:
        max_tokens = validate_core_request(self.limits, req)
        if req.request_id in self._running or any(
                w.request_id == req.request_id for w in self._waiting):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        lo, hi = TOKEN_RANGE
        self._waiting.append(_Running(req.request_id, max_tokens,
                                      lo + hash(req.request_id) % (hi - lo), req.arrival_time))

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self._waiting = [w for w in self._waiting if w.request_id not in ids]
        for rid in ids:
            if self._running.pop(rid, None) is not None:
                self._pending.append(EngineCoreOutput(rid, [], finish_reason="abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting or self._pending)

    def shutdown(self) -> None:
        pass

    def step(self) -> EngineCoreOutputs:
        while self._waiting and len(self._running) < self.limits.max_num_seqs:
            r = self._waiting.pop(0)
            self._running[r.request_id] = r
        self._next_step = max(self._next_step + self.step_time_s, time.perf_counter())
        delay = self._next_step - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        outputs, self._pending = self._pending, []
        if self.request_timeout is not None:
            outputs += self._expire(self.request_timeout)
        lo, hi = TOKEN_RANGE
        for r in list(self._running.values()):
            r.remaining -= 1
            token = r.next_token
            r.next_token = lo + (token * 7 + 13) % (hi - lo)
            done = r.remaining <= 0
            outputs.append(EngineCoreOutput(r.request_id, [token],
                                            finish_reason="length" if done else None))
            if done:
                del self._running[r.request_id]
        stats = SchedulerStats(num_running=len(self._running), num_waiting=len(self._waiting),
                               num_generation_tokens=len(outputs))
        return EngineCoreOutputs(outputs=outputs, stats=stats)

    def _expire(self, limit: float) -> list[EngineCoreOutput]:
        """Ends the requests older than `limit` seconds, as the engine's scheduler does."""
        now = time.monotonic()
        late = [r for r in [*self._running.values(), *self._waiting]
                if now - r.arrival_time > limit]
        for r in late:
            if self._running.pop(r.request_id, None) is None:
                self._waiting.remove(r)
        return [EngineCoreOutput(r.request_id, [], finish_reason="error",
                                 error=timeout_message(limit), error_code=ErrorCode.TIMED_OUT)
                for r in late]


def build_null_core(engine_args, step_time_s: float, vocab_size: int) -> NullEngineCore:
    """A build_core for shoal.engine.core_proc.run_engine_core (picklable with partial)."""
    limits = EngineLimits(vocab_size=vocab_size, max_model_len=engine_args.max_model_len or 8192,
                          num_kv_blocks=1 << 20, block_size=16,
                          max_num_seqs=engine_args.max_num_seqs or 256,
                          eos_token_ids=frozenset([0]))
    return NullEngineCore(limits, step_time_s, request_timeout=engine_args.request_timeout)


def main(argv: list[str] | None = None) -> int:
    from shoal.engine.engine_args import EngineArgs
    from shoal.entrypoints.openai.api_server import serve
    from shoal.entrypoints.openai.server_settings import ServerSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--step-time-ms", type=float, default=10.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    ns = p.parse_args(argv)
    args = EngineArgs(max_num_seqs=ns.max_num_seqs, device="cpu")
    build = functools.partial(build_null_core, step_time_s=ns.step_time_ms / 1000,
                              vocab_size=49152)
    settings = ServerSettings(host=ns.host, port=ns.port, disable_uvicorn_access_log=True)
    return asyncio.run(serve(args, settings, build_core=build))


if __name__ == "__main__":
    raise SystemExit(main())
