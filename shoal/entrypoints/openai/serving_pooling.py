"""/v1/embeddings, /pooling, /classify, /score and /rerank (vLLM's and Cohere/Jina's response
shapes). Each input is one pooling request; all are validated and submitted, or none.

Scores: a cross-encoder (a one-label classifier) reads each (text_1, text_2) pair as one
sequence; an embedding model embeds both sides and answers their cosine similarity."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shoal.engine.async_llm import RequestStream
from shoal.engine.request_checks import wrong_runner_message
from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingBaseRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    normalize_inputs,
)
from shoal.entrypoints.openai.responses import now_s, random_id
from shoal.entrypoints.openai.serving_common import ServingBase, response_id
from shoal.entrypoints.openai.streaming import ClientDisconnected, cancel_on_disconnect
from shoal.outputs import PoolingRequestOutput
from shoal.pooling.scoring import cosine, score_pairs
from shoal.pooling_params import PoolingInfo, PoolingParams
from shoal.prompt_truncation import encode_kept, kept_tokens, pooling_side, truncate_prompt

# One engine request: (prompt, params, token type ids of a pair)
_Job = tuple[Any, PoolingParams, list[int] | None]


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _encode(vec: np.ndarray, fmt: str) -> list | str:
    if fmt == "base64":  # what the openai client decodes: float32 bytes, little-endian
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode()
    return vec.tolist()


def embedding_body(req: EmbeddingRequest, model: str, outs: list[PoolingRequestOutput],
                   rid: str, *, pooling: bool = False) -> dict[str, Any]:
    """The /v1/embeddings (or /pooling) response for the outputs of embedding_jobs."""
    obj, key = ("pooling", "data") if pooling else ("embedding", "embedding")
    data = [{"index": i, "object": obj,
             key: _encode(np.asarray(o.outputs.data), req.encoding_format)}
            for i, o in enumerate(outs)]
    return {"id": rid, "object": "list", "created": now_s(), "model": model, "data": data,
            "usage": _usage(sum(len(o.prompt_token_ids) for o in outs))}


class OpenAIServingPooling(ServingBase):
    @property
    def info(self) -> PoolingInfo:
        info = self.engine.limits.pooling
        if info is None:
            raise OpenAIError(400, wrong_runner_message(False))
        return info

    def _check(self, req: PoolingBaseRequest, task: str) -> str:
        model = self.models.check(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, bad[1], bad[0])
        if task not in self.info.tasks:
            raise OpenAIError(400, f"this model does not support {task!r} (it supports "
                                   f"{', '.join(self.info.tasks)})")
        return model

    def _prompt(self, item: Any, req: PoolingBaseRequest, side: str | None = None) -> Any:
        """Text or ids -> what the input processor takes, truncated when asked. side: which
        end the ids lose (Cohere's START / END), as truncate_prompt's; by default the
        tokenizer's, else the right, and a text keeps the special tokens the tokenizer adds
        ([CLS] and [SEP]), as the offline PoolingParams.truncate_prompt_tokens."""
        inputs = self.engine.inputs
        k = req.truncate_prompt_tokens
        max_len = self.engine.max_model_len
        keep = kept_tokens(k, max_len, max_len)
        default = side is None
        side = side or pooling_side(self.engine.tokenizer)
        if isinstance(item, str) and (k is not None or not req.add_special_tokens):
            if not item:
                raise ValueError("input must not be empty")
            if req.add_special_tokens and default:
                item = encode_kept(lambda special: inputs.encode(item, special, "input"),
                                   keep, side)
            else:
                item = inputs.encode(item, req.add_special_tokens, "input")
        if keep is not None and isinstance(item, list):
            item = truncate_prompt(item, keep, side)
        return item if isinstance(item, str) else {"prompt_token_ids": item}

    async def _run(self, jobs: list[_Job], priority: int, raw: Request
                   ) -> list[PoolingRequestOutput]:
        self.engine.inputs.check_num_prompts(len(jobs))
        engine_id = random_id("pool")
        streams: list[RequestStream] = []
        try:  # validate and submit every input, or none
            for i, (prompt, params, tt) in enumerate(jobs):
                streams.append(self.engine.add_pooling_request(
                    f"{engine_id}-{i}", prompt, params, priority=priority, token_type_ids=tt))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        try:
            return await cancel_on_disconnect(raw, self._collect(streams))
        finally:
            for s in streams:
                s.abort()

    @staticmethod
    async def _collect(streams: list[RequestStream]) -> list[PoolingRequestOutput]:
        return [(await s.drain())[-1] for s in streams]

    async def _answer(self, jobs: list[_Job], priority: int, raw: Request
                      ) -> list[PoolingRequestOutput] | Response:
        try:
            return await self._run(jobs, priority, raw)
        except ClientDisconnected:
            return Response(status_code=499)

    def embedding_jobs(self, req: EmbeddingRequest, *, pooling: bool = False
                       ) -> tuple[str, list[_Job]]:
        """The served model's name and one engine request per input of an /v1/embeddings
        (or /pooling) body; what is wrong with it is an error here, before any runs (the
        server and the batch runner share this)."""
        task = (req.task if isinstance(req, PoolingRequest) and req.task else
                self.info.tasks[0] if pooling else "embed")
        model = self._check(req, task)
        params = PoolingParams(task=task, dimensions=req.dimensions, normalize=req.normalize)
        params.check_against(self.info)
        return model, [(self._prompt(x, req), params, None) for x in normalize_inputs(req.input)]

    # ---- endpoints ----------------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, raw: Request, *, pooling: bool = False
                         ) -> Response:
        model, jobs = self.embedding_jobs(req, pooling=pooling)
        outs = await self._answer(jobs, req.priority, raw)
        if isinstance(outs, Response):
            return outs
        rid = response_id("pool" if pooling else "embd", req.request_id, raw)
        return JSONResponse(embedding_body(req, model, outs, rid, pooling=pooling))

    async def classify(self, req: ClassificationRequest, raw: Request) -> Response:
        model = self._check(req, "classify")
        params = PoolingParams(task="classify", use_activation=req.use_activation)
        jobs = [(self._prompt(x, req), params, None) for x in normalize_inputs(req.input)]
        outs = await self._answer(jobs, req.priority, raw)
        if isinstance(outs, Response):
            return outs
        labels = self.info.id2label
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(o.outputs.data))
            data.append({"index": i, "label": labels.get(best, f"LABEL_{best}"),
                         "probs": probs, "num_classes": len(probs)})
        return JSONResponse({
            "id": response_id("classify", req.request_id, raw), "object": "list",
            "created": now_s(), "model": model, "data": data,
            "usage": _usage(sum(len(o.prompt_token_ids) for o in outs))})

    async def _scores(self, req: PoolingBaseRequest, left: Any, right: Any, raw: Request,
                      use_activation: bool | None) -> tuple[list[float], int] | Response:
        """The score of each pair, and the tokens read."""
        pairs = score_pairs(left, right)
        if self.info.is_cross_encoder:
            params = PoolingParams(task="score", use_activation=use_activation)
            enc = [self.engine.inputs.encode_pair(a, b) for a, b in pairs]
            jobs: list[_Job] = [({"prompt_token_ids": ids}, params, tt) for ids, tt in enc]
        else:
            for a, b in pairs:
                if not a or not b:
                    raise ValueError("texts to score must not be empty")
            params = PoolingParams(task="embed")
            jobs = [(self._prompt(t, req), params, None) for pair in pairs for t in pair]
        outs = await self._answer(jobs, req.priority, raw)
        if isinstance(outs, Response):
            return outs
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        if self.info.is_cross_encoder:
            return [float(o.outputs.data[0]) for o in outs], tokens
        return [cosine(a.outputs.data, b.outputs.data)
                for a, b in zip(outs[::2], outs[1::2])], tokens

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        model = self._check(req, "score")
        res = await self._scores(req, req.text_1, req.text_2, raw, req.use_activation)
        if isinstance(res, Response):
            return res
        scores, tokens = res
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse({
            "id": response_id("score", req.request_id, raw), "object": "list",
            "created": now_s(), "model": model, "data": data, "usage": _usage(tokens)})

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        model = self._check(req, "score")
        if not req.documents:
            raise OpenAIError(400, "documents must not be empty", "documents")
        if req.top_n < 0:
            raise OpenAIError(400, "top_n must be >= 0 (0: every document)", "top_n")
        res = await self._scores(req, req.query, req.documents, raw, req.use_activation)
        if isinstance(res, Response):
            return res
        scores, tokens = res
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": req.documents[i]}} if req.return_documents
                       else {})} for i in order]
        return JSONResponse({"id": response_id("rerank", req.request_id, raw), "model": model,
                             "usage": {"total_tokens": tokens}, "results": results})
