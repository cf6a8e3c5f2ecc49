"""What the completion, chat and responses handlers share: response ids, the server's
request-level defaults, the token decoder of the logprobs fields, ORCA load headers, the
data-parallel replica a request names."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request

from shoal.engine.async_llm import AsyncLLM
from shoal.engine.dp_client import check_data_parallel_rank
from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.logprobs import decode_token
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.token_bytes import token_bytes_fn
from shoal.entrypoints.openai.tool_choice import ToolPlan, ToolsError, plan_tools

ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
# vLLM's header that sends a request to one data-parallel replica (a cache-aware router's pick)
DP_RANK_HEADER = "X-data-parallel-rank"


def response_id(prefix: str, requested: str | None, raw: Request | None) -> str:
    """The id clients see: the request's request_id, else its X-Request-Id header (as vLLM),
    else a fresh one. The engine gets its own unique id, since clients may reuse these."""
    base = requested or (raw.headers.get("x-request-id") if raw is not None else None)
    return f"{prefix}-{base or uuid.uuid4().hex}"


def data_parallel_rank(raw: Request | None, size: int) -> int | None:
    """The replica the request's X-data-parallel-rank header names (None: no header); a 400
    naming the header unless it is an integer in [0, data_parallel_size)."""
    value = raw.headers.get(DP_RANK_HEADER) if raw is not None else None
    if value is None:
        return None
    try:
        rank: object = int(value)
    except ValueError:
        rank = value
    try:
        return check_data_parallel_rank(rank, size, DP_RANK_HEADER)
    except ValueError as e:
        raise OpenAIError(400, str(e), DP_RANK_HEADER) from None


class ServingBase:
    def __init__(self, engine: AsyncLLM, models: ServedModels, settings: ServerSettings):
        self.engine = engine
        self.models = models
        self.settings = settings
        self._token_bytes: Callable[[int], bytes] | None = None

    def _decode(self, token_id: int) -> str:
        return decode_token(self.engine.tokenizer, token_id)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's generation config: defaults of the sampling fields a request leaves
        unset (engine/generation_defaults.py)."""
        return self.engine.inputs.limits.generation.sampling

    def token_bytes(self) -> Callable[[int], bytes] | None:
        """A token id's own bytes for the logprobs `bytes` field (token_bytes.py); None
        without a tokenizer (the bytes of the shown text then)."""
        if self.engine.tokenizer is None:
            return None
        if self._token_bytes is None:
            self._token_bytes = token_bytes_fn(self.engine.tokenizer, self._decode)
        return self._token_bytes

    def token_decoder(self, as_token_ids: bool | None) -> Callable[[int], str] | None:
        """The decoder of the logprobs fields; None shows tokens as "token_id:N"."""
        if as_token_ids is None:
            as_token_ids = self.settings.return_tokens_as_token_ids
        if as_token_ids or self.engine.tokenizer is None:
            return None
        return self._decode

    def tool_plan(self, tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
                  constrained_by: str | None) -> ToolPlan:
        """The request's tool plan (400s that say what is wrong); constrained_by: the
        request's own output constraint's field names, which a constraining plan excludes."""
        try:
            plan = plan_tools(tools, tool_choice, parallel, self.settings.tool_call_parser,
                              self.settings.enable_auto_tool_choice)
        except ToolsError as e:
            raise OpenAIError(400, str(e), e.param) from None
        if plan.constraint is not None and constrained_by is not None:
            raise OpenAIError(400, f"tool_choice {plan.mode!r} constrains the output already; "
                                   f"it cannot be combined with {constrained_by}",
                              "tool_choice")
        return plan

    def cached(self, num_cached: int) -> int | None:
        """usage.prompt_tokens_details.cached_tokens whenever the server reports it, 0 on a
        miss (vLLM 0.28's test_single_completion expects {"cached_tokens": 0})."""
        return num_cached if self.settings.enable_prompt_tokens_details else None

    def replica(self, raw: Request | None) -> int | None:
        """The data-parallel replica the request names (see data_parallel_rank)."""
        return data_parallel_rank(raw, self.engine.engine_args.data_parallel_size)

    def load_headers(self, raw: Request | None) -> dict[str, str] | None:
        """vLLM's ORCA `endpoint-load-metrics` header, when the request asks for it."""
        fmt = raw.headers.get(ORCA_FORMAT_HEADER, "") if raw is not None else ""
        return orca_header(fmt, self.engine)


def orca_header(fmt: str, engine: AsyncLLM) -> dict[str, str] | None:
    """`TEXT named_metrics.kv_cache_usage_perc=0.1, ...` or `JSON {"named_metrics": {...}}`
    (the ORCA load report), or None for a format other than TEXT and JSON."""
    kind = fmt.strip().lower()
    if kind not in ("text", "json"):
        return None
    stats = engine.last_stats
    named: dict[str, Any] = {"kv_cache_usage_perc": float(stats.kv_cache_usage),
                             "num_requests_waiting": float(stats.num_waiting)}
    if kind == "text":
        body = ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
        return {"endpoint-load-metrics": f"TEXT {body}"}
    return {"endpoint-load-metrics": "JSON " + json.dumps({"named_metrics": named})}
