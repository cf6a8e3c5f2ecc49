"""The gRPC control plane: a grpc.aio server over the AsyncLLM the HTTP server uses, on the
same event loop (shoal_engine.proto is the contract; see this package's docstring)."""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

import shoal
from shoal.engine.async_llm import AsyncLLM, QueueFullError, RequestStream
from shoal.engine.generation_defaults import capped_max_tokens
from shoal.engine.output_processor import OutputKind
from shoal.engine.request_errors import EngineDeadError, RequestTimeoutError
from shoal.entrypoints.grpc import health
from shoal.entrypoints.grpc import shoal_engine_pb2 as pb
from shoal.entrypoints.grpc import shoal_engine_pb2_grpc as pb_grpc
from shoal.entrypoints.grpc.tls import TlsFiles, server_credentials
from shoal.entrypoints.openai.errors import OpenAIError, ServerShuttingDown
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.outputs import PositionLogprobs, RequestOutput
from shoal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Methods a load balancer calls without credentials (as /health over HTTP); reflection, as
# HTTP's /openapi.json, needs the key.
OPEN_METHODS = frozenset({"/shoal.v1.Engine/Health"}) | health.OPEN_METHODS
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")
_HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                503: grpc.StatusCode.UNAVAILABLE}


class AbortedByClient(Exception):
    """Put into a request's stream by the Abort method: the stream ends with "abort"."""


def status_of(e: BaseException) -> grpc.StatusCode:
    """The gRPC status for what add_request or a stream raised (HTTP picks its codes alike)."""
    if isinstance(e, OpenAIError):
        return _HTTP_STATUS.get(e.status, grpc.StatusCode.UNKNOWN)
    if isinstance(e, EngineDeadError | ServerShuttingDown):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, RequestTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def sampling_params(msg: pb.SamplingParams, defaults: dict[str, Any] | None = None
                    ) -> SamplingParams:
    """The proto's subset; unset fields take `defaults` (the model's generation config, whose
    max_tokens caps the request's, as over HTTP), else SamplingParams' defaults. Nothing is
    detokenized: the client gets token ids only (and stop strings are not part of this API)."""
    kw: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_PARAMS
                          if msg.HasField(name)}
    d = defaults or {}
    kw = {**d, **kw}
    if "max_tokens" in kw:  # (else SamplingParams' own default)
        kw["max_tokens"] = capped_max_tokens(kw["max_tokens"], d)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = list(msg.stop_token_ids)
    return SamplingParams(**kw, ignore_eos=msg.ignore_eos, detokenize=False)


def token_logprobs(token_id: int, position: PositionLogprobs) -> pb.TokenLogprobs:
    sampled = position.get(token_id)
    top = sorted((lp.rank or 0, t, lp.logprob) for t, lp in position.items()
                 if lp.rank is not None and lp.rank > 0)
    return pb.TokenLogprobs(
        logprob=sampled.logprob if sampled is not None else 0.0,
        rank=(sampled.rank or 0) if sampled is not None else 0,
        top=[pb.TopLogprob(token_id=t, logprob=lp, rank=r) for r, t, lp in top])


def generate_response(request_id: str, outs: list[RequestOutput], completion_tokens: int
                      ) -> pb.GenerateResponse:
    """One message for the outputs a stream had ready (their deltas concatenated)."""
    msg = pb.GenerateResponse(request_id=request_id)
    for out in outs:
        msg.prompt_tokens = len(out.prompt_token_ids)
        msg.num_cached_tokens = out.num_cached_tokens
        if not out.outputs:
            continue
        c = out.outputs[0]
        msg.token_ids.extend(c.token_ids)
        if c.logprobs:
            msg.logprobs.extend(token_logprobs(t, p) for t, p in zip(c.token_ids, c.logprobs))
        msg.finish_reason = c.finish_reason or ""
    msg.completion_tokens = completion_tokens + len(msg.token_ids)
    return msg


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, engine: AsyncLLM, models: ServedModels, settings: ServerSettings,
                 draining: Callable[[], bool], kv_events_address: str | None = None):
        self.engine = engine
        self.models = models
        self.settings = settings
        self.draining = draining
        # Filled by whoever configures the KV cache event publisher (empty: none).
        self.kv_events_address = kv_events_address
        self.active: dict[str, RequestStream] = {}  # the client's request id -> its stream

    def _submit(self, rid: str, request: pb.GenerateRequest) -> RequestStream:
        """Validates and submits; raises what add_request raises (or OpenAIError)."""
        if self.draining():
            raise ServerShuttingDown("the server is shutting down")
        which = request.WhichOneof("prompt")
        if which is None:
            raise ValueError("a prompt is required: prompt_token_ids or text")
        prompt: Any = list(request.prompt_token_ids.ids) if which == "prompt_token_ids" \
            else request.text
        if which == "text" and self.engine.tokenizer is None:
            raise ValueError("text prompts need the tokenizer, and this server runs without "
                             "one (--skip-tokenizer-init): send prompt_token_ids")
        self.models.check(request.model or None)
        params = sampling_params(request.sampling_params,
                                 self.engine.inputs.limits.generation.sampling)
        return self.engine.add_request(
            f"grpc-{rid}", prompt, params, output_kind=OutputKind.DELTA,
            lora_request=self.models.lora(request.model or None))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {rid!r} is running already")
        try:
            stream = self._submit(rid, request)
        except Exception as e:
            await context.abort(status_of(e), str(e))
        self.active[rid] = stream
        sent = 0
        try:
            while True:
                try:
                    outs = await stream.drain()
                except AbortedByClient:
                    yield pb.GenerateResponse(request_id=rid, finish_reason="abort",
                                              completion_tokens=sent)
                    return
                if not outs:
                    return
                msg = generate_response(rid, outs, sent)
                sent = msg.completion_tokens
                yield msg
        except Exception as e:
            await context.abort(status_of(e), str(e))
        finally:  # also on the client's cancel (CancelledError): the engine stops the request
            stream.abort()
            if self.active.get(rid) is stream:
                del self.active[rid]

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        stream = self.active.pop(request.request_id, None)
        if stream is None:
            return pb.AbortResponse(found=False)
        # Stopped in the engine now; the sentinel wakes its Generate, which answers "abort".
        self.engine.abort(f"grpc-{request.request_id}")
        stream.put(AbortedByClient())
        return pb.AbortResponse(found=True)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
                     ) -> pb.HealthResponse:
        stats = self.engine.last_stats
        msg = pb.HealthResponse(status=pb.HealthResponse.SERVING, num_running=stats.num_running,
                                num_waiting=stats.num_waiting,
                                kv_cache_usage=stats.kv_cache_usage)
        reason = await self.not_serving_reason()
        if reason:
            msg.status, msg.reason = pb.HealthResponse.NOT_SERVING, reason
        return msg

    async def not_serving_reason(self) -> str:
        """Why the engine takes no requests now ("": it does); grpc.health.v1 asks it too."""
        if not self.engine.is_healthy:
            return f"engine dead: {self.engine.errored or 'the engine process is not running'}"
        if self.draining():
            return "shutting down"
        try:
            if await self.engine.is_sleeping():
                return "sleeping"
            if await self.engine.is_paused():  # (requests wait queued until resumed)
                return "paused"
        except Exception as e:  # a core that does not answer is not serving
            return f"engine not responding: {e}"
        return ""

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            served_model_names=self.models.names, lora_adapters=list(self.models.loras),
            max_model_len=self.engine.max_model_len, vocab_size=self.engine.vocab_size,
            has_tokenizer=self.engine.tokenizer is not None,
            model_path=self.models.root or "")

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        s = self.settings
        http = f"unix:{s.uds}" if s.uds else f"http://{s.host}:{s.port}"
        return pb.GetServerInfoResponse(
            version=shoal.__version__, http_address=http,
            kv_events_address=self.kv_events_address,
            data_parallel_size=self.engine.engine_args.data_parallel_size)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """--api-key for gRPC: `authorization: Bearer <key>` metadata on every method but those
    in OPEN_METHODS (by exclusion, as the HTTP middleware)."""

    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}".encode()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
            details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if details.method in OPEN_METHODS or handler is None:
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"),
                     "")
        given_b = given.encode() if isinstance(given, str) else given
        # Constant-time: the time taken must not tell how much of a key matched.
        if hmac.compare_digest(given_b, self.expected):
            return handler
        message = ("missing API key: pass the metadata 'authorization: Bearer <key>'"
                   if not given_b else "invalid API key")
        return _rejecting(handler, message)


def _rejecting(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await deny(request, context)
            yield  # unreachable: makes this an async generator, as a streaming handler is

        make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming  # reflection
                else grpc.unary_stream_rpc_method_handler)
        return make(deny_stream, **kw)
    make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
            else grpc.unary_unary_rpc_method_handler)
    return make(deny, **kw)


async def start_grpc_server(engine: AsyncLLM, models: ServedModels, settings: ServerSettings,
                            draining: Callable[[], bool], kv_events_address: str | None = None
                            ) -> health.ControlPlane:
    """Binds --host:--grpc-port (over TLS with --grpc-ssl-certfile: tls.py) and starts
    serving shoal.v1.Engine, grpc.health.v1.Health and reflection on the running event loop;
    the caller stops it (`await plane.stop(grace)`: health turns NOT_SERVING first)."""
    tls = TlsFiles.of(settings)
    credentials = server_credentials(tls) if tls is not None else None  # before binding
    interceptors = [ApiKeyInterceptor(settings.api_key)] if settings.api_key else []
    server = grpc.aio.server(interceptors=interceptors)
    servicer = EngineServicer(engine, models, settings, draining, kv_events_address)
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    health_servicer = health.add_health_and_reflection(server, servicer.not_serving_reason)
    await health_servicer.refresh()  # the engine is up: SERVING from the first call
    address = f"{settings.host}:{settings.grpc_port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as e:
        raise OSError(f"cannot listen for gRPC on {address}: {e}") from None
    if not bound:
        raise OSError(f"cannot listen for gRPC on {address}")
    await server.start()
    logger.info("gRPC control plane on %s (%s)", address,
                tls.describe() if tls is not None else "plaintext")
    return health.ControlPlane(server, health_servicer)
