"""The gRPC control plane's standard services, through the stubs of grpcio-health-checking and
grpcio-reflection (nothing of shoal's proto): shoal's real gRPC server (start_grpc_server,
its API-key interceptor, on a real port) over a stand-in engine whose state the test sets, so
every state is reached in milliseconds (test_grpc_server.py runs the same server over a real
engine). grpc.health.v1 is SERVING for the server and for shoal.v1.Engine, NOT_FOUND for
another name, open without the API key; NOT_SERVING while the engine sleeps, is paused, is
dead or the server drains (Check at once, Watch within the poll interval), and for good once
the server stops. shoal's own Health says the same. Reflection needs the key, lists the
three services and describes shoal.v1.Engine from the proto the package ships."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shoal.core.types import SchedulerStats
from shoal.entrypoints.grpc import health
from shoal.entrypoints.grpc import shoal_engine_pb2 as pb
from shoal.entrypoints.grpc import shoal_engine_pb2_grpc as pb_grpc
from shoal.entrypoints.grpc.server import start_grpc_server
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_models import ServedModels

from .conftest import free_port

KEY = "grpc-health-key"
AUTH = [("authorization", f"Bearer {KEY}")]
ENGINE = "shoal.v1.Engine"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class StandInEngine:
    """What the health paths read of AsyncLLM; the test sets its state."""

    sleeping: bool = False
    paused: bool = False
    errored: BaseException | None = None
    draining: bool = False
    last_stats: SchedulerStats = field(default_factory=SchedulerStats)

    @property
    def is_healthy(self) -> bool:
        return self.errored is None

    async def is_sleeping(self) -> bool:
        return self.sleeping

    async def is_paused(self) -> bool:
        return self.paused


@dataclass
class Plane:
    engine: StandInEngine
    channel: grpc.Channel
    stop: Any  # () -> None: stops the server as serve() does


@pytest.fixture
def plane(monkeypatch) -> Iterator[Plane]:
    monkeypatch.setattr(health, "POLL_S", 0.02)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    engine = StandInEngine()
    settings = ServerSettings(grpc_port=free_port(), api_key=KEY)
    server = run(start_grpc_server(engine, ServedModels(["m"], None, 512), settings,
                                   lambda: engine.draining))
    channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            run(server.stop(0.1))

    try:
        yield Plane(engine, channel, stop)
    finally:
        channel.close()
        stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _check(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _reflect(channel: grpc.Channel, metadata: Any = None, **request: Any
             ) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(**request)]), metadata=metadata,
        timeout=10)
    return resp


def test_health_check_per_service_follows_the_engine(plane: Plane) -> None:
    ch, engine = plane.channel, plane.engine
    assert _check(ch, "") == SERVING  # the whole server; no API key needed
    assert _check(ch, ENGINE) == SERVING
    with pytest.raises(grpc.RpcError) as err:
        _check(ch, "shoal.v1.Nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    own = pb_grpc.EngineStub(ch)
    for state, reason in (("sleeping", "sleeping"), ("paused", "paused"),
                          ("draining", "shutting down")):
        setattr(engine, state, True)
        assert _check(ch, "") == NOT_SERVING and _check(ch, ENGINE) == NOT_SERVING, state
        h = own.Health(pb.HealthRequest(), timeout=10)  # shoal's Health agrees, with why
        assert h.status == pb.HealthResponse.NOT_SERVING and h.reason == reason
        setattr(engine, state, False)
        assert _check(ch, ENGINE) == SERVING, state
    engine.errored = RuntimeError("boom")
    assert _check(ch, ENGINE) == NOT_SERVING
    assert own.Health(pb.HealthRequest(), timeout=10).reason == "engine dead: boom"


def test_watch_sees_pause_resume_and_shutdown(plane: Plane) -> None:
    watch = health_pb2_grpc.HealthStub(plane.channel).Watch(
        health_pb2.HealthCheckRequest(service=ENGINE), timeout=30)
    assert next(watch).status == SERVING
    plane.engine.paused = True
    assert next(watch).status == NOT_SERVING  # from the poller: nobody asked with Check
    plane.engine.paused = False
    assert next(watch).status == SERVING
    plane.stop()
    assert next(watch).status == NOT_SERVING  # before the server closes the stream
    with pytest.raises(grpc.RpcError):
        next(watch)


def test_reflection_lists_and_describes_the_services(plane: Plane) -> None:
    ch = plane.channel
    with pytest.raises(grpc.RpcError) as err:  # as HTTP's /openapi.json: the key is needed
        _reflect(ch, list_services="")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    listed = _reflect(ch, AUTH, list_services="").list_services_response.service
    assert sorted(s.name for s in listed) == sorted(
        [ENGINE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"])
    files = _reflect(ch, AUTH, file_containing_symbol=ENGINE).file_descriptor_response
    proto = descriptor_pb2.FileDescriptorProto.FromString(files.file_descriptor_proto[0])
    assert proto.package == "shoal.v1"
    (service,) = proto.service
    assert {m.name for m in service.method} == {"Generate", "Abort", "Health", "GetModelInfo",
                                                "GetServerInfo"}
