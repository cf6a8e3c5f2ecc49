"""The server's routes, in three groups: probes and scrape targets (open even with an API key),
models and tokenizer, and the routes that run the model."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

import shoal
from shoal.engine.async_llm import AsyncLLM
from shoal.engine.request_checks import wrong_runner_message
from shoal.entrypoints.openai.cohere_embed import CohereEmbedHandler, CohereEmbedRequest
from shoal.entrypoints.openai.errors import (
    OpenAIError,
    ServerShuttingDown,
    error_response,
    field_names,
)
from shoal.entrypoints.openai.middleware import ServerLoad
from shoal.entrypoints.openai.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIBaseModel,
    TokenizeRequest,
)
from shoal.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from shoal.entrypoints.openai.responses_api import OpenAIServingResponses, ResponsesRequest
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_chat import OpenAIServingChat
from shoal.entrypoints.openai.serving_completion import OpenAIServingCompletion
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.serving_pooling import OpenAIServingPooling
from shoal.entrypoints.openai.serving_tokenize import OpenAIServingTokenization

logger = logging.getLogger(__name__)


def _warn_unknown(req: OpenAIBaseModel) -> None:
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))


def add_probe_routes(app: FastAPI, engine: AsyncLLM, registry: CollectorRegistry,
                     settings: ServerSettings, load: ServerLoad) -> None:
    """/health, /ping (SageMaker), /version, /metrics, /load: what load balancers and
    Prometheus call without credentials."""

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, "the engine process is not running")
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker's health check
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": shoal.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def server_load() -> JSONResponse:
        if not settings.enable_server_load_tracking:
            raise OpenAIError(404, "server load tracking is off (--enable-server-load-tracking)")
        return JSONResponse({"server_load": load.value})


def add_model_and_tokenizer_routes(app: FastAPI, models: ServedModels,
                                   tokenization: OpenAIServingTokenization,
                                   settings: ServerSettings) -> None:
    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.list().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        return JSONResponse(models.card(model_id).model_dump())

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        _warn_unknown(req)
        return JSONResponse((await tokenization.tokenize(req)).body())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        _warn_unknown(req)
        return JSONResponse(tokenization.detokenize(req).model_dump())

    if settings.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(tokenization.tokenizer_info())


def add_generation_routes(app: FastAPI, completion: OpenAIServingCompletion,
                          chat: OpenAIServingChat, responses: OpenAIServingResponses) -> None:
    """The routes that run the model; refused with a 503 once the server is draining, and
    with a 400 on a pooling model (it does not generate)."""
    pooling_model = completion.engine.limits.pooling is not None

    def check_intake() -> None:
        if app.state.draining:
            raise ServerShuttingDown("the server is shutting down")
        if pooling_model:
            raise OpenAIError(400, wrong_runner_message(True))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        check_intake()
        _warn_unknown(req)
        with field_names(req.field_name):  # (the request's own names in error bodies)
            return await completion.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        check_intake()
        _warn_unknown(req)
        with field_names(req.field_name):  # (the request's own names in error bodies)
            return await chat.create(req, raw)

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(req: BatchChatCompletionRequest,
                                           raw: Request) -> Response:
        check_intake()
        _warn_unknown(req)
        with field_names(req.field_name):
            return await chat.create_batch(req, raw)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        check_intake()
        _warn_unknown(req)
        with field_names(req.field_name):
            return await responses.create(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        """SageMaker's single entry point: the body's shape picks the API."""
        check_intake()
        return await invoke(raw, completion, chat, responses)


async def invoke(raw: Request, completion: OpenAIServingCompletion, chat: OpenAIServingChat,
                 responses: OpenAIServingResponses) -> Response:
    try:
        body = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"malformed JSON in the request body: {e}") from e
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    routes: list[tuple[str, type[OpenAIBaseModel], Any]] = [
        ("messages", ChatCompletionRequest, chat.create),
        ("prompt", CompletionRequest, completion.create),
        ("input", ResponsesRequest, responses.create)]
    for key, model_cls, handler in routes:
        if key in body:
            try:
                req = model_cls.model_validate(body)
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from e
            _warn_unknown(req)
            with field_names(req.field_name):
                return await handler(req, raw)
    raise OpenAIError(400, "cannot route this request: expected one of ChatCompletionRequest "
                           "(messages), CompletionRequest (prompt) or ResponsesRequest (input)")


def add_pooling_routes(app: FastAPI, pooling: OpenAIServingPooling) -> None:
    """Embeddings, pooling, classification, scores and reranking; on a generation model each
    answers 400 saying it needs a pooling model."""

    def check_intake(req: OpenAIBaseModel) -> None:
        if app.state.draining:
            raise ServerShuttingDown("the server is shutting down")
        _warn_unknown(req)

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request) -> Response:
        check_intake(req)
        return await pooling.embeddings(req, raw)

    cohere = CohereEmbedHandler(pooling)

    @app.post("/v2/embed")  # Cohere's embed API
    async def create_cohere_embed(req: CohereEmbedRequest, raw: Request) -> Response:
        check_intake(req)
        return await cohere.embed(req, raw)

    @app.post("/pooling")
    async def create_pooling(req: PoolingRequest, raw: Request) -> Response:
        check_intake(req)
        return await pooling.embeddings(req, raw, pooling=True)

    @app.post("/classify")
    async def create_classify(req: ClassificationRequest, raw: Request) -> Response:
        check_intake(req)
        return await pooling.classify(req, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(req: ScoreRequest, raw: Request) -> Response:
        check_intake(req)
        return await pooling.score(req, raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(req: RerankRequest, raw: Request) -> Response:
        check_intake(req)
        return await pooling.rerank(req, raw)
