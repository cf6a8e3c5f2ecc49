"""`python -m shoal.entrypoints.openai.run_batch -i requests.jsonl -o results.jsonl` (or
`shoal run-batch -i ... -o ...`, vLLM's two spellings): an OpenAI batch file, run offline
through shoal.LLM.

Each input line is {"custom_id", "method": "POST", "url", "body"} with url /v1/completions,
/v1/chat/completions or /v1/embeddings; each output line is {"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}, in input order. The bodies are checked and
answered by the server's own request and response code, so a line gets what `shoal serve`
would answer (a 400 body for a bad request, an embeddings line to a generative model
included); the valid generation requests run in one batch through the engine, the embedding
requests in another. --enable-metrics serves the run's Prometheus series on --host:--port
while the runner lives (batch_metrics.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from shoal.engine.request_errors import RequestError, first_request_error
from shoal.entrypoints.cli_args import add_run_batch_args, engine_args_from
from shoal.entrypoints.openai.batch_metrics import BatchMetrics
from shoal.entrypoints.openai.errors import OpenAIError, error_body, error_from_exception
from shoal.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from shoal.entrypoints.openai.protocol_pooling import EmbeddingRequest
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_chat import OpenAIServingChat
from shoal.entrypoints.openai.serving_completion import (
    DEFAULT_MAX_TOKENS,
    OpenAIServingCompletion,
    normalize_prompts,
)
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.entrypoints.openai.serving_pooling import OpenAIServingPooling, embedding_body
from shoal.loader.resolve import DEFAULT_MODEL_NAME

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")



class _OfflineEngine:
    """What the server's request handlers read from an engine, over an offline LLMEngine."""

    def __init__(self, llm: Any):
        eng = llm.llm_engine
        self.tokenizer = eng.tokenizer
        self.inputs = eng.inputs
        self.limits = eng.core.limits
        self.max_model_len = self.limits.max_model_len
        self.vocab_size = self.limits.vocab_size


class _Handlers:
    """The server's request handlers, over the offline engine."""

    def __init__(self, llm: Any, model_name: str):
        engine: Any = _OfflineEngine(llm)
        settings = ServerSettings()
        models = ServedModels([model_name], None, engine.max_model_len)
        self.model_name = model_name
        self.completion = OpenAIServingCompletion(engine, models, settings)
        self.chat = OpenAIServingChat(engine, models, settings)
        self.pooling = OpenAIServingPooling(engine, models, settings)
        # the model's generation config: defaults of the fields a line leaves unset
        self.defaults = self.completion.sampling_defaults


@dataclass
class _Line:
    custom_id: Any
    request: Any = None
    prompts: list[Any] = field(default_factory=list)  # ProcessedPrompts
    params: Any = None
    k: int | None = None
    plan: Any = None  # a chat line's ToolPlan (tool calls parsed from its answer)
    jobs: list[Any] = field(default_factory=list)  # an embeddings line's (prompt, params, _)
    model: str = ""  # an embeddings line's served model name
    outputs: list[Any] = field(default_factory=list)
    error: dict[str, Any] | None = None
    status: int = 200

    def fail(self, e: Exception) -> None:
        """What the server would answer for the exception."""
        err = error_from_exception(e)
        self.status, self.error = err.status, error_body(err.status, err.message, err.param)


def _parse(raw: str, h: _Handlers) -> _Line:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as e:
        return _Line(None, error=error_body(400, f"malformed JSON line: {e}"), status=400)
    line = _Line(item.get("custom_id") if isinstance(item, dict) else None)
    defaults = h.defaults
    try:
        if not isinstance(item, dict) or not isinstance(item.get("body"), dict):
            raise ValueError("each line must be an object with custom_id, method, url, body")
        if item.get("url") not in URLS:
            raise ValueError(f"url must be one of {', '.join(URLS)} (got {item.get('url')!r})")
        if item.get("method", "POST") != "POST":
            raise ValueError("method must be POST")
        if item["url"] == "/v1/completions":
            req = CompletionRequest.model_validate(item["body"])
            _check(req, h.completion)
            scoring = req.echo and req.max_tokens == 0
            max_tokens = 1 if scoring else (req.max_tokens or DEFAULT_MAX_TOKENS)
            line.prompts = [h.completion._process(p, req, max_tokens)
                            for p in normalize_prompts(req.prompt)]
            k, pk = req.logprobs, req.prompt_logprobs
            if req.echo and k is not None:
                pk = -1 if -1 in (k, pk) else max(k, pk or 0)
            line.params = req.to_sampling_params(max_tokens, k, pk, req.constraint(), defaults)
        elif item["url"] == "/v1/chat/completions":
            req = ChatCompletionRequest.model_validate(item["body"])
            _check(req, h.chat)
            line.k, max_tokens = h.chat._prepare(req)
            line.plan = h.chat._plan(req)
            line.prompts = [h.chat.render(req)]
            line.params = req.to_sampling_params(max_tokens, line.k, req.prompt_logprobs,
                                                 line.plan.constraint or req.constraint(),
                                                 defaults)
        else:
            req = EmbeddingRequest.model_validate(item["body"])
            line.model, line.jobs = h.pooling.embedding_jobs(req)
        line.request = req
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        line.status, line.error = 400, error_body(400, f"{where}: {first.get('msg')}", where)
    except Exception as e:  # what the server would answer for it
        line.fail(e)
    return line


def _check(req: Any, handler: Any) -> None:
    handler.models.check(req.model)
    if req.stream:
        raise ValueError("stream must be false in a batch file")
    bad = req.unsupported()
    if bad is not None:
        raise OpenAIError(400, bad[1], bad[0])
    if req.use_beam_search:
        raise OpenAIError(400, "beam search is not supported in batch files (only by the "
                               "server and LLM.beam_search)", "use_beam_search")


def _generate(llm: Any, lines: list[_Line]) -> list[Any]:
    prompts = [{"prompt_token_ids": p.prompt_token_ids, "prompt": p.prompt}
               for ln in lines for p in ln.prompts]
    return llm.generate(prompts, [ln.params for ln in lines for _ in ln.prompts],
                        use_tqdm=False)


def _embed(llm: Any, lines: list[_Line]) -> list[Any]:
    jobs = [job for ln in lines for job in ln.jobs]
    return llm.encode([p for p, _, _ in jobs], [params for _, params, _ in jobs],
                      use_tqdm=False)


def _in_one_batch(llm: Any, lines: list[_Line], runner: Callable[[Any, list[_Line]], list[Any]],
                  size: Callable[[_Line], int]) -> None:
    """Runs the lines' requests together and hands each line its outputs. A request the
    engine refuses up front (a ValueError) fails its line alone: the lines run one by one
    then. A request the engine failed while running is found in its line's outputs."""
    if not lines:
        return
    try:
        outs = iter(runner(llm, lines))
    except RequestError as e:  # the batch ran; the engine failed some lines (see _result)
        outs = iter(e.outputs or [])
    except ValueError:
        for ln in lines:
            try:
                ln.outputs = runner(llm, [ln])
            except (ValueError, RequestError) as e:
                ln.fail(e)
        return
    for ln in lines:
        ln.outputs = [next(outs) for _ in range(size(ln))]


def run(lines: Iterable[str], llm: Any, model_name: str) -> list[dict[str, Any]]:
    h = _Handlers(llm, model_name)
    parsed = [_parse(raw, h) for raw in lines if raw.strip()]
    ok = [ln for ln in parsed if ln.error is None]
    _in_one_batch(llm, [ln for ln in ok if not ln.jobs], _generate, lambda ln: len(ln.prompts))
    _in_one_batch(llm, [ln for ln in ok if ln.jobs], _embed, lambda ln: len(ln.jobs))
    return [_result(ln, h) for ln in parsed]


def _result(ln: _Line, h: _Handlers) -> dict[str, Any]:
    rid = f"batch_req_{uuid.uuid4().hex}"
    failed = first_request_error(ln.outputs)
    if failed is not None and ln.error is None:  # what the server answers for it
        ln.fail(failed)
    if ln.error is not None:
        body = ln.error
    elif isinstance(ln.request, CompletionRequest):
        body = h.completion._response(ln.request, h.model_name, f"cmpl-{uuid.uuid4().hex}",
                                      ln.outputs).model_dump()
    elif isinstance(ln.request, ChatCompletionRequest):
        body = h.chat._response(ln.request, h.model_name, f"chatcmpl-{uuid.uuid4().hex}",
                                ln.outputs[0], ln.k, plan=ln.plan).model_dump()
    else:
        body = embedding_body(ln.request, ln.model, ln.outputs, f"embd-{uuid.uuid4().hex}")
    return {"id": rid, "custom_id": ln.custom_id,
            "response": {"status_code": ln.status, "request_id": rid, "body": body},
            "error": None}


def run_from(ns: argparse.Namespace) -> int:
    from shoal.llm import LLM

    args = engine_args_from(ns)
    metrics: BatchMetrics | None = None
    try:
        with (sys.stdin if ns.input_file == "-" else open(ns.input_file)) as f:
            lines = f.readlines()
        if ns.enable_metrics:  # up before the model loads, as vLLM's
            metrics = BatchMetrics(ns.host, ns.port)
        llm = LLM(**vars(args))
        name = ns.served_model_name or args.model or DEFAULT_MODEL_NAME
        with metrics.recording(llm, name) if metrics else contextlib.nullcontext():
            results = run(lines, llm, name)
    except (OSError, ValueError) as e:
        print(f"run_batch: error: {e}", file=sys.stderr)
        return 2
    finally:
        if metrics is not None:
            metrics.close()
    text = "".join(json.dumps(r) + "\n" for r in results)
    if ns.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(ns.output_file, "w") as f:
            f.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.entrypoints.openai.run_batch",
                                description=__doc__.split("\n\n")[0])
    add_run_batch_args(p)
    return run_from(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
