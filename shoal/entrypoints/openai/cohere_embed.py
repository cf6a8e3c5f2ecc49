"""Cohere's embed API, POST /v2/embed (vLLM's): texts in, embeddings by type out.

Built on the /v1/embeddings machinery (the same pooling and normalization, so float
embeddings equal /v1/embeddings' for the same texts). Images and mixed `inputs` need
multimodal or chat-rendered inputs, which shoal's pooling models do not take: refused."""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictInt, StrictStr

from shoal.engine.request_checks import check_text
from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.protocol import OpenAIBaseModel
from shoal.entrypoints.openai.protocol_pooling import EmbeddingRequest
from shoal.entrypoints.openai.serving_common import response_id
from shoal.entrypoints.openai.serving_pooling import OpenAIServingPooling, _encode
from shoal.loader.resolve import resolve_model
from shoal.pooling_params import PoolingParams

# vLLM 0.28's embedding types (Cohere's int8/uint8 are not among them).
CohereEmbeddingType = Literal["float", "binary", "ubinary", "base64"]


class CohereEmbedContent(OpenAIBaseModel):
    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: dict[str, StrictStr] | None = None


class CohereEmbedInput(OpenAIBaseModel):
    content: list[CohereEmbedContent]


class CohereEmbedRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    input_type: StrictStr | None = None
    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = None
    inputs: list[CohereEmbedInput] | None = None
    output_dimension: StrictInt | None = None
    embedding_types: list[CohereEmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: StrictInt | None = None
    priority: StrictInt = 0


def pack_bits(vecs: np.ndarray, signed: bool) -> list[list[int]]:
    """Cohere's binary types: one bit a dimension (>= 0 -> 1), MSB first, 8 to a byte;
    `binary` shifts each byte by -128 into int8's range."""
    if vecs.shape[1] % 8:
        raise OpenAIError(400, f"embedding dimension must be a multiple of 8 for binary "
                               f"embedding types, but got {vecs.shape[1]}", "embedding_types")
    packed = np.packbits(vecs >= 0, axis=-1).astype(np.int16)
    return (packed - 128 if signed else packed).tolist()


def embeddings_by_type(vecs: list[np.ndarray], types: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in types:
        if t == "float":
            out[t] = [_encode(v, "float") for v in vecs]
        elif t == "base64":  # little-endian float32, as vLLM's
            out[t] = [_encode(v, "base64") for v in vecs]
        else:
            out[t] = pack_bits(np.stack(vecs), signed=(t == "binary"))
    return out


class CohereEmbedHandler:
    """POST /v2/embed on top of the pooling server's helpers."""

    def __init__(self, pooling: OpenAIServingPooling):
        self.pooling = pooling
        self.engine = pooling.engine

    @cached_property
    def task_instructions(self) -> dict[str, str] | None:
        """input_type -> prompt prefix, as vLLM finds them: config.json's task_instructions,
        else config_sentence_transformers.json's prompts."""
        try:
            folder = resolve_model(self.engine.engine_args.model).path
        except Exception:  # noqa: BLE001 - no model folder: no prefixes
            return None
        if not folder.is_dir():
            return None
        for name, key in (("config.json", "task_instructions"),
                          ("config_sentence_transformers.json", "prompts")):
            try:
                found = json.loads((folder / name).read_text()).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(found, dict):
                found = {k: v for k, v in found.items() if isinstance(v, str)}
                if found:
                    return found
        return None

    def _validate(self, req: CohereEmbedRequest) -> None:
        given = [f for f in ("texts", "images", "inputs") if getattr(req, f) is not None]
        if len(given) != 1 or not getattr(req, given[0]):
            raise OpenAIError(400, "Exactly one of texts, images, or inputs must be provided, "
                                   "and it must be non-empty", given[0] if given else "texts")
        if req.images is not None:
            raise OpenAIError(400, "images are not supported: this server takes text inputs "
                                   "only (send texts)", "images")
        if req.inputs is not None:
            for i, inp in enumerate(req.inputs):
                for c in inp.content:
                    if c.type == "image_url":
                        raise OpenAIError(400, f"inputs[{i}]: image_url content is not "
                                               "supported: this server takes text inputs only",
                                          "inputs")
            raise OpenAIError(400, "inputs (content rendered through a chat template) is not "
                                   "supported for embeddings: send texts", "inputs")
        if req.input_type is not None:
            ti = self.task_instructions
            if ti is None:
                raise OpenAIError(400, f"Unsupported input_type {req.input_type!r}. This model "
                                       "does not define any input_type task instructions.",
                                  "input_type")
            if req.input_type not in ti:
                raise OpenAIError(400, f"Unsupported input_type {req.input_type!r}. Supported "
                                       f"values: {', '.join(sorted(ti))}", "input_type")
        if req.max_tokens is not None:
            if req.max_tokens < 1:
                raise OpenAIError(400, f"max_tokens must be >= 1 (got {req.max_tokens})",
                                  "max_tokens")
            if req.truncate != "NONE" and req.max_tokens > self.engine.max_model_len:
                raise OpenAIError(400, f"max_tokens ({req.max_tokens}) must not be greater "
                                       f"than max_model_len ({self.engine.max_model_len})",
                                  "max_tokens")

    def _prompt(self, text: str, prefix: str | None, proxy: EmbeddingRequest,
                side: str | None) -> Any:
        if prefix is not None and getattr(self.engine.tokenizer, "chat_template", None):
            # vLLM renders the prefix as the system prompt through the chat template
            messages = [{"role": "system", "content": prefix}, {"role": "user", "content": text}]
            rendered = self.engine.inputs.apply_chat_template(messages,
                                                              add_generation_prompt=False)
            ids = self.engine.inputs.encode(rendered, False, "input")
            return self.pooling._prompt(ids, proxy, side)
        if prefix is not None:
            text = prefix + text
        keep = proxy.truncate_prompt_tokens
        tok = self.engine.tokenizer
        if side == "right" and keep is not None and text and \
                getattr(tok, "truncation_side", None) == "right":
            # END, as vLLM's: the tokenizer truncates, keeping the special tokens ([SEP])
            check_text(text, "input")
            limit = self.engine.max_model_len if keep < 0 else keep
            ids = tok.encode(text, add_special_tokens=True, truncation=True, max_length=limit)
            # (a limit below the special tokens' count leaves it untruncated: cut it then)
            return {"prompt_token_ids": ids[:limit]}
        return self.pooling._prompt(text, proxy, side)

    async def embed(self, req: CohereEmbedRequest, raw: Request) -> Response:
        _ = self.pooling.info  # a 400 on a generation model, first
        self._validate(req)
        texts = req.texts or []
        # END (Cohere's default) drops the end of a long input, START its start; NONE refuses
        # one longer than the model takes (or than max_tokens).
        keep = None if req.truncate == "NONE" else (
            req.max_tokens if req.max_tokens is not None else -1)
        side = {"START": "left", "END": "right"}.get(req.truncate)
        proxy = EmbeddingRequest(model=req.model, input=texts, priority=req.priority,
                                 truncate_prompt_tokens=keep)
        self.pooling._check(proxy, "embed")
        try:
            params = PoolingParams(task="embed", dimensions=req.output_dimension)
            params.check_against(self.pooling.info)
        except ValueError as e:
            raise OpenAIError(400, str(e).replace("dimensions", "output_dimension", 1),
                              "output_dimension") from e
        prefix = (self.task_instructions or {}).get(req.input_type or "") or None
        try:
            jobs = [(self._prompt(t, prefix, proxy, side), params, None) for t in texts]
        except ValueError as e:
            raise OpenAIError(400, f"texts: {e}", "texts") from e
        outs = await self.pooling._answer(jobs, req.priority, raw)
        if isinstance(outs, Response):
            return outs
        if req.truncate == "NONE" and req.max_tokens is not None:
            for o in outs:
                n = len(o.prompt_token_ids)
                if n > req.max_tokens:
                    raise OpenAIError(400, f"Input of {n} tokens exceeds max_tokens="
                                           f"{req.max_tokens} with truncate=NONE. Set truncate "
                                           "to END or START to allow truncation.", "max_tokens")
        vecs = [o.outputs.data for o in outs]  # as /v1/embeddings encodes them
        body: dict[str, Any] = {
            "id": response_id("embd", None, raw),
            "embeddings": embeddings_by_type(vecs, list(req.embedding_types or ["float"])),
            "texts": req.texts,
            "meta": {"api_version": {"version": "2"},
                     "billed_units": {"input_tokens": sum(len(o.prompt_token_ids)
                                                          for o in outs),
                                      "image_tokens": 0}},
            "response_type": "embeddings_by_type",
        }
        return JSONResponse(body)
