"""The standard gRPC health service (grpc.health.v1, grpcio-health-checking) and server
reflection (grpcio-reflection) beside shoal.v1.Engine, so that a load balancer, a Kubernetes
gRPC probe or grpcurl needs nothing of shoal's own proto.

Health answers for the server ("") and for "shoal.v1.Engine" alike: SERVING while the engine
takes requests, NOT_SERVING while it is dead, sleeping or paused or the server drains, and
for good once the server stops (enter_graceful_shutdown). Check asks the engine each time;
Watch streams get a change within POLL_S (the engine is asked only while someone watches).
Other service names are NOT_FOUND, as the standard says."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shoal.entrypoints.grpc import shoal_engine_pb2 as pb

ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name  # "shoal.v1.Engine"
HEALTH_SERVICES = (health.OVERALL_HEALTH, ENGINE_SERVICE)
# Load balancers and probes call these without credentials (as HTTP's /health).
OPEN_METHODS = frozenset({f"/{health.SERVICE_NAME}/Check", f"/{health.SERVICE_NAME}/Watch"})
POLL_S = 1.0  # how soon a Watch stream learns of a change


class EngineHealth(health.aio.HealthServicer):
    """grpc.health.v1 over the engine's state; `not_serving_reason` is "" when serving."""

    def __init__(self, not_serving_reason: Callable[[], Awaitable[str]]):
        super().__init__()
        self._reason = not_serving_reason
        self.watchers = 0

    async def refresh(self) -> None:
        serving = not await self._reason()
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in HEALTH_SERVICES:
            await self.set(service, status)  # (ignored once shutting down)

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> Any:
        if request.service in HEALTH_SERVICES:
            await self.refresh()
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> None:
        self.watchers += 1
        try:
            await self.refresh()
            await super().Watch(request, context)
        finally:
            self.watchers -= 1

    async def poll(self) -> None:
        """Runs until cancelled: keeps the statuses current for Watch streams."""
        while True:
            await asyncio.sleep(POLL_S)
            if self.watchers:
                await self.refresh()


class ControlPlane:
    """The running gRPC server and its health service; stop() turns every service
    NOT_SERVING (watchers see it) before the server stops."""

    def __init__(self, server: grpc.aio.Server, health_servicer: EngineHealth):
        self.server = server
        self.health = health_servicer
        self._poll = asyncio.get_running_loop().create_task(health_servicer.poll(),
                                                            name="grpc-health-poll")

    async def stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        self._poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._poll
        await self.server.stop(grace)


def add_health_and_reflection(server: grpc.aio.Server,
                              not_serving_reason: Callable[[], Awaitable[str]]
                              ) -> EngineHealth:
    """Adds grpc.health.v1.Health and grpc.reflection.v1alpha.ServerReflection (which lists
    shoal.v1.Engine, Health and itself); returns the health servicer."""
    servicer = EngineHealth(not_serving_reason)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer
