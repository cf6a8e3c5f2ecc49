"""The OpenAI server end to end: a real `shoal serve` process, the official client and raw
HTTP. One server (with an API key) for the whole module; the last test SIGTERMs it.

The box is slow (about one decode step a second when busy), so outputs are a few tokens."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest

from .conftest import RemoteServer

API_KEY = "sk-shoal-test"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server():
    # Two sequences at a time and one waiting: a fourth sequence gets a 503.
    srv = RemoteServer("--max-num-seqs", "2", "--max-waiting-requests", "1", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def sse_events(resp: httpx.Response) -> list[str]:
    """The data payloads of a Server-Sent Events body, checking the framing on the way."""
    body = resp.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-2]  # drop [DONE] and the empty tail
    assert all(e.startswith("data: ") for e in events), body[:500]
    return [e[len("data: "):] for e in events]


# ---- health, auth, listing --------------------------------------------------------------------
OPEN = {"/health", "/ping", "/version", "/metrics", "/load"}


def test_auth_route_by_route(server):
    """Every route of the running server, from its own OpenAPI schema: the key is needed on
    all of them but the probes and scrape targets (so a new route cannot slip through)."""
    schema = server.get("/openapi.json").json()
    routes = [(path, method) for path, ops in schema["paths"].items() for method in ops]
    assert ("/tokenize", "post") in routes and ("/v1/models/{model_id}", "get") in routes
    for path, method in routes + [("/openapi.json", "get"), ("/docs", "get")]:
        url = server.base_url + path.replace("{model_id}", "x").replace("{response_id}", "x")
        r = httpx.request(method.upper(), url, json={}, timeout=30)
        if path in OPEN:
            assert r.status_code != 401, (path, method)
        else:
            assert r.status_code == 401, (path, method, r.status_code)
            assert r.json()["error"]["code"] == 401
            bad = httpx.request(method.upper(), url, json={}, timeout=30,
                                headers={"Authorization": "Bearer wrong"})
            assert bad.status_code == 401 and "invalid" in bad.json()["error"]["message"]
    assert {p for p, _ in routes} >= OPEN - {"/load"}
    assert httpx.get(server.base_url + "/metrics").status_code == 200  # Prometheus, keyless
    assert httpx.get(server.base_url + "/version").json()["version"]
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"})
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_models(client, model):
    assert model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


# ---- completions ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_completion(client, model):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)


def test_completion(greedy_completion):
    c = greedy_completion
    assert c.object == "text_completion" and len(c.choices) == 1
    assert c.choices[0].text and c.choices[0].finish_reason == "length"
    u = c.usage
    assert u.completion_tokens == 5 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is None  # as vLLM: only with --enable-prompt-tokens-details


def test_completion_stream_equals_non_stream(client, model):
    prompts = [PROMPT, "Once upon a time"]
    full = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0)
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=3,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                assert ch.index not in finishes
                finishes[ch.index] = ch.finish_reason
    assert texts == {ch.index: ch.text for ch in full.choices}
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == full.usage.completion_tokens == 6
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_with_seed_is_reproducible(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=3, n=2, seed=1234, temperature=1.0)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_stop_string(client, model, greedy_completion):
    text = greedy_completion.choices[0].text
    stop = text.strip()[:2]
    assert stop
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_token_ids_echo_logprobs(server, client, model):
    ids = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    ch = r.choices[0]
    lp = ch.logprobs
    n = len(ids) + 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    detok = server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert ch.text.startswith(detok)
    assert r.usage.prompt_tokens == len(ids)


# ---- chat -------------------------------------------------------------------------------------
def test_chat_stream_equals_non_stream(server, client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant"
    resp = server.post("/v1/chat/completions", json={
        "model": model, "messages": MESSAGES, "max_completion_tokens": 4, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(e) for e in sse_events(resp)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks[1:] if c["choices"]]
    finishes = [c["choices"][0]["finish_reason"] for c in content]
    assert finishes[-1] == "length" and finishes.count(None) == len(finishes) - 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) \
        == full.choices[0].message.content
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert full.usage.completion_tokens == 4


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        assert tok.token == tok.top_logprobs[0].token  # greedy picks the top token
    assert "".join(t.token for t in content) == r.choices[0].message.content


# ---- errors -----------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ("{not json", 400),
    ("[1, 2]", 400),
    ({"prompt": PROMPT, "max_tokens": "five"}, 400),
    ({"prompt": PROMPT, "temperature": "hot"}, 400),
    ({"prompt": PROMPT, "stream": "yes"}, 400),
    ({"prompt": PROMPT, "temperature": -1}, 400),
    ({"prompt": PROMPT, "top_p": 1.5}, 400),
    ({"prompt": PROMPT, "n": 0}, 400),
    ({"prompt": PROMPT, "max_tokens": 0}, 400),
    ({"prompt": PROMPT, "logprobs": 99}, 400),
    ({"prompt": PROMPT, "logit_bias": {"99999999": 1}}, 400),
    ({"prompt": PROMPT, "stop_token_ids": [-1]}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": []}, 400),
    ({"prompt": [1, "a"]}, 400),
    ({"prompt": [99999999]}, 400),
    ({"prompt": [1] * 2048}, 400),  # longer than max_model_len
    ({"prompt": PROMPT, "max_tokens": 2048}, 400),  # prompt + completion too long
    ({"prompt": PROMPT, "suffix": "!"}, 400),
    ({"prompt": PROMPT, "best_of": 3}, 400),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404),
]
BAD_CHATS = [
    ({"messages": []}, 400),
    ({"messages": [{"role": "", "content": "hi"}]}, 400),  # any role the template takes, not none
    ({"messages": MESSAGES, "use_beam_search": True, "stream": True}, 400),
    ({"messages": MESSAGES, "use_beam_search": True, "response_format": {"type": "json_object"}},
     400),
    ({"messages": MESSAGES, "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400),
    ({"messages": MESSAGES, "seed": 2**64}, 400),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ({"messages": MESSAGES, "tool_choice": "auto"}, 400),
    ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400),
    ({"messages": MESSAGES, "functions": [{"name": "f"}]}, 400),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400),
    ({"messages": MESSAGES, "max_completion_tokens": -3}, 400),
    ({"messages": MESSAGES, "max_completion_tokens": 4096}, 400),
]


@pytest.mark.parametrize("path,body,status", [("/v1/completions", b, s) for b, s in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", b, s) for b, s in BAD_CHATS])
def test_bad_requests(server, path, body, status):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = server.post(path, headers={**server.headers, "Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]


def test_chat_logprobs_may_come_as_text(server):
    """"logprobs": "true" (a boolean sent as a string) works as in vLLM; other text is a 400."""
    body = {"messages": MESSAGES, "max_tokens": 2, "logprobs": "true", "top_logprobs": 1}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["content"]
    r = server.post("/v1/chat/completions", json={**body, "logprobs": "FALSE",
                                                  "top_logprobs": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    assert server.post("/v1/chat/completions",
                       json={**body, "logprobs": "yes"}).status_code == 400


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1] * 2048}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2048}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 4096}),
])
def test_context_length_errors_use_vllms_phrase(server, path, body):
    """LiteLLM and many scripts recognise a context-length error by vLLM's phrase."""
    r = server.post(path, json=body)
    assert r.status_code == 400
    assert "This model's maximum context length is 2048 tokens" in r.json()["error"]["message"]


def test_unsupported_says_so(server):
    r = server.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                  "functions": [{"name": "f"}]})
    assert "not supported" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [{}]})
    assert r.status_code == 400 and "tools[0]" in r.json()["error"]["message"]


def test_still_correct_after_bad_input(client, model, greedy_completion):
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert again.choices[0].text == greedy_completion.choices[0].text


def test_tokenize_roundtrip(server):
    ids = server.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 2048
    text = server.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("Hello world")
    chat = server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > ids["count"]


# ---- disconnects, metrics ---------------------------------------------------------------------
def test_hang_up_mid_stream_frees_kv(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    aborted_before = server.metric("request_success_total")
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # it is generating
        assert server.metric("kv_cache_usage_perc") > 0
    # The client hung up: the request must be aborted and its blocks freed at once.
    assert server.wait_metric("kv_cache_usage_perc", lambda v: v == 0, 30) == 0
    assert server.wait_metric("num_requests_running", lambda v: v == 0, 10) == 0
    assert server.metric("request_success_total") == aborted_before + 1


def test_hang_up_non_streaming_frees_kv(server, model):
    # 2000 tokens take tens of seconds on the CPU: the client hangs up after 2 s, and the KV
    # must be free within 5 s of that, long before the request could have ended by itself.
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    done = threading.Event()

    def post():
        try:
            httpx.post(server.base_url + "/v1/completions", json=body, headers=server.headers,
                       timeout=httpx.Timeout(60, read=2))
        except httpx.ReadTimeout:
            pass  # the client gives up and closes the connection
        done.set()

    t = threading.Thread(target=post)
    t.start()
    assert server.wait_metric("kv_cache_usage_perc", lambda v: v > 0, 30) > 0
    t.join()
    assert server.wait_metric("kv_cache_usage_perc", lambda v: v == 0, 5) == 0


def test_metrics_exposed(server):
    text = server.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket"):
        assert f'shoal:{name}{{' in text, name
    assert 'model_name="HuggingFaceTB/SmolLM2-135M-Instruct"' in text
    assert server.metric("generation_tokens_total") > 0
    assert server.metric("time_to_first_token_seconds_count") > 0
    assert server.metric("prefix_cache_queries_total") > 0


def test_queue_full_gives_503(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        # Two running and one waiting are accepted (each answers with its headers only once
        # the engine has it); the fourth finds the waiting queue full.
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        try:
            for st in streams:
                assert st.__enter__().status_code == 200
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == 503
        finally:
            for st in streams:
                st.__exit__(None, None, None)
    assert server.wait_metric("kv_cache_usage_perc", lambda v: v == 0, 30) == 0
    assert server.wait_metric("num_requests_waiting", lambda v: v == 0, 10) == 0


# ---- shutdown (last: it stops the module's server) --------------------------------------------
def test_sigterm_drains_in_flight_request(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      headers=server.headers, timeout=120) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # in flight
        server.proc.send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    # The request finished normally after the signal.
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"] == 10
    assert server.proc.wait(60) == 0, server.log_tail()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=5)
