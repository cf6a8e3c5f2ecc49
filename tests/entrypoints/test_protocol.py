"""Request parsing, error bodies, auth and logprob formats, on a small app without an engine."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from shoal.engine.async_llm import QueueFullError
from shoal.entrypoints.openai.auth import ApiKeyMiddleware
from shoal.entrypoints.openai.errors import install_error_handlers
from shoal.entrypoints.openai.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs
from shoal.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_context_length,
)
from shoal.entrypoints.openai.serving_completion import normalize_prompts
from shoal.kv_offload.request_params import check_tier_names
from shoal.outputs import Logprob


@pytest.fixture(scope="module")
def http() -> TestClient:
    app = FastAPI(strict_content_type=False)
    install_error_handlers(app)
    app.add_middleware(ApiKeyMiddleware, api_key="k")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        bad = req.unsupported()
        if bad:
            raise ValueError(bad[1])
        req.to_sampling_params(req.max_tokens or 16, req.logprobs, None)
        if req.prompt == "busy":
            raise QueueFullError("busy", retry_after=3)
        if req.prompt == "bug":
            raise RuntimeError("boom")
        return {"prompts": normalize_prompts(req.prompt)}

    @app.get("/health")
    async def health() -> dict:
        return {}

    return TestClient(app, headers={"Authorization": "Bearer k"}, raise_server_exceptions=False)


def _err(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    return body


def test_malformed_and_mistyped_bodies_are_400(http):
    assert "malformed JSON" in _err(http.post("/v1/completions", content=b"{x"), 400)["message"]
    assert "JSON object" in _err(http.post("/v1/completions", content=b"[1]"), 400)["message"]
    e = _err(http.post("/v1/completions", json={"prompt": "a", "temperature": "hot"}), 400)
    assert e["param"] == "temperature" and "hot" in e["message"]
    e = _err(http.post("/v1/completions", json={"prompt": "a", "n": 1.5}), 400)
    assert e["param"] == "n"
    # no Content-Type (curl -d) still parses as JSON
    assert http.post("/v1/completions", content=b'{"prompt": "a"}').json() == {"prompts": ["a"]}


def test_value_errors_name_the_field(http):
    e = _err(http.post("/v1/completions", json={"prompt": "a", "top_p": 2}), 400)
    assert e["param"] == "top_p" and "top_p" in e["message"]
    assert _err(http.post("/v1/completions", json={"prompt": "a", "suffix": "z"}), 400)


def test_kv_transfer_params_pass_through_and_are_checked(http):
    req = CompletionRequest(prompt="a", kv_transfer_params={"skip_tiers": ["disk"]})
    sp = req.to_sampling_params(max_tokens=4, logprobs=None, prompt_logprobs=None)
    assert sp.kv_transfer_params == {"skip_tiers": ["disk"]}
    e = _err(http.post("/v1/completions",
                       json={"prompt": "a", "kv_transfer_params": {"skip_tiers": "disk"}}), 400)
    assert "kv_transfer_params" in e["message"]
    # Tier names are the request validator's (the tiers live below the frontend's protocol).
    with pytest.raises(ValueError, match="tape"):
        check_tier_names(sp.__class__(kv_transfer_params={"skip_tiers": ["tape"]})
                         .kv_transfer_params)


def test_queue_full_is_503_with_retry_after(http):
    r = http.post("/v1/completions", json={"prompt": "busy"})
    _err(r, 503)
    assert r.headers["Retry-After"] == "3"


def test_internal_errors_are_500_with_a_body(http):
    assert "boom" in _err(http.post("/v1/completions", json={"prompt": "bug"}), 500)["message"]


def test_api_key(http):
    raw = TestClient(http.app)
    _err(raw.post("/v1/completions", json={"prompt": "a"}), 401)
    _err(raw.post("/v1/completions", json={"prompt": "a"},
                  headers={"Authorization": "Bearer nope"}), 401)
    assert raw.get("/health").status_code == 200
    _err(raw.get("/no-such-route"), 401)  # even a 404 needs the key first
    _err(http.get("/no-such-route"), 404)


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_normalize_prompts(prompt, expected):
    assert normalize_prompts(prompt) == expected


@pytest.mark.parametrize("prompt", [None, [], [1, "a"], [[1], "a"], [[1, "x"]], 5, [True]])
def test_normalize_prompts_rejects(prompt):
    with pytest.raises(ValueError):
        normalize_prompts(prompt)


def test_context_length_check():
    check_context_length(10, 6, 16)
    check_context_length(10, None, 16)  # the engine fills the rest
    # vLLM's phrase, which LiteLLM and scripts match to recognise the error
    with pytest.raises(ValueError, match="^This model's maximum context length is 16 tokens. "
                                         "However, you requested 17 tokens.*max_completion_tokens "
                                         "is too large"):
        check_context_length(10, 7, 16, "max_completion_tokens")


def test_chat_unsupported_fields():
    msgs = [{"role": "user", "content": "hi"}]

    def bad(**kw):
        return ChatCompletionRequest(messages=msgs, **kw).unsupported()

    assert bad() is None
    assert bad(tool_choice="none", tools=[{"type": "function"}]) is None
    # tools and constraints are checked where they are used (tool_choice.py, constraints.py)
    assert bad(tools=[{"type": "function"}]) is None
    assert bad(response_format={"type": "json_object"}) is None
    assert bad(response_format={"type": "text"}) is None
    assert bad(functions=[{"name": "f"}])[0] == "functions"
    assert bad(top_logprobs=2)[0] == "top_logprobs"
    assert bad(n=1, best_of=2)[0] == "best_of"
    assert bad(stream_options={"include_usage": True})[0] == "stream_options"


def test_completion_logprobs_format():
    positions = [None,
                 {5: Logprob(-0.5, 1, "b"), 6: Logprob(-1.0, 2, "c")},
                 {7: Logprob(float("-inf"), 9, "d"), 5: Logprob(-0.1, 1, "b")}]
    lp = completion_logprobs([4, 5, 7], positions, 1, decode=lambda t: "A")
    assert lp.tokens == ["A", "b", "d"] and lp.text_offset == [0, 1, 2]
    assert lp.token_logprobs == [None, -0.5, MIN_LOGPROB]
    assert lp.top_logprobs == [None, {"b": -0.5}, {"b": -0.1, "d": MIN_LOGPROB}]


def test_chat_logprobs_format():
    positions = [{7: Logprob(-2.0, 3, "x"), 5: Logprob(-0.1, 1, "y"), 6: Logprob(-1.0, 2, "z")}]
    (tok,) = chat_logprobs([7], positions, 2, decode=str)
    assert (tok.token, tok.logprob, tok.bytes) == ("x", -2.0, [120])
    assert [t.token for t in tok.top_logprobs] == ["y", "z"]  # exactly top_logprobs entries


def test_not_implemented_fields_are_named_and_defaults_pass():
    from shoal.entrypoints.openai.protocol import NOT_IMPLEMENTED

    assert CompletionRequest(prompt="a", guided_decoding_backend="x").unsupported() == \
        ("guided_decoding_backend", NOT_IMPLEMENTED["guided_decoding_backend"][1])
    assert CompletionRequest(prompt="a", structured_outputs={"regex": "a"}).unsupported() is None
    assert CompletionRequest(prompt="a", guided_json={}).unsupported() is None  # empty: unset
    assert CompletionRequest(prompt="a", use_beam_search=False, length_penalty=1.0,
                             bad_words=[]).unsupported() is None
    assert CompletionRequest(prompt="a", include_reasoning=False).unsupported()[0] == \
        "include_reasoning"
    assert CompletionRequest(prompt="a", max_tokens=0).unsupported()[0] == "max_tokens"
    assert CompletionRequest(prompt="a", max_tokens=0, echo=True).unsupported() is None
    assert CompletionRequest(prompt="a", some_new_field=1).unknown_fields() == ["some_new_field"]


def test_truncate_prompt_and_stream_usage():
    from shoal.prompt_truncation import truncate_prompt

    ids = list(range(10))
    assert truncate_prompt(ids, 3, None, 100) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "right", 100) == [0, 1, 2]
    assert truncate_prompt(ids, -1, "left", 4) == [6, 7, 8, 9]
    assert truncate_prompt(ids, None, None, 4) == ids and truncate_prompt(ids, 20, None, 30) == ids
    req = CompletionRequest(prompt="a", stream=True,
                            stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert req.stream_usage() == (False, False) and req.stream_usage(force=True) == (True, True)
    assert CompletionRequest(prompt="a").stream_usage(force=True) == (False, False)


def test_chat_template_kwargs_carry_tools_documents_and_effort():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice="none",
                                tools=[{"type": "function"}], documents=[{"text": "d"}],
                                reasoning_effort="low", chat_template_kwargs={"a": 1})
    assert req.unsupported() is None
    assert req.template_kwargs() == {"a": 1, "tools": [{"type": "function"}],
                                     "documents": [{"text": "d"}], "reasoning_effort": "low"}
    both = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 continue_final_message=True)
    assert both.unsupported()[0] == "continue_final_message"


def test_each_request_names_the_engine_s_fields_its_own_way():
    from shoal.entrypoints.openai.protocol import ChatCompletionRequest
    from shoal.entrypoints.openai.responses_api import ResponsesRequest

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 response_format={"type": "json_object"})
    assert [chat.field_name(p) for p in ("logprobs", "prompt", "structured_outputs", "n")] \
        == ["top_logprobs", "messages", "response_format", "n"]
    plain = CompletionRequest(prompt="a", structured_outputs={"regex": "a"})
    assert plain.field_name("structured_outputs") == "structured_outputs"
    assert plain.field_name("prompt") == "prompt"
    resp = ResponsesRequest(input="x")
    assert (resp.field_name("prompt"), resp.field_name("max_tokens")) == \
        ("input", "max_output_tokens")
