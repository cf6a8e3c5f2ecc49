"""vLLM parity: the request extensions, routes, headers and flags vLLM users rely on, on one
`shoal serve` with vLLM's optional features switched on. Every unsupported extension must be a
400 that names it; every supported one is checked for what it returns."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from shoal.entrypoints.openai.protocol import NOT_IMPLEMENTED

from .conftest import RemoteServer

PROMPT = "The capital of France is"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
VOCAB = 49152


@pytest.fixture(scope="module")
def server(smollm2_server) -> RemoteServer:
    return smollm2_server  # conftest.PARITY_ARGS: the flags checked here


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def tokenizer(server):
    info = server.get("/tokenizer_info").json()
    assert info["tokenizer_class"]
    from shoal.loader import load_frontend_tokenizer

    return load_frontend_tokenizer(None, None)


def events(resp: httpx.Response) -> list[dict]:
    body = resp.text
    assert body.endswith("data: [DONE]\n\n"), body[-300:]
    return [json.loads(e[len("data: "):]) for e in body.split("\n\n")[:-2]]


# ---- refused extensions -----------------------------------------------------------------------
REFUSED = {"guided_decoding_backend": "outlines", "prompt_embeds": "AAAA", "include_reasoning": False,
           "vllm_xargs": {"a": 1}, "stream_interval": 4}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unimplemented_extensions_are_400_naming_the_field(server, path, field):
    assert field in NOT_IMPLEMENTED
    body = ({"prompt": PROMPT} if "chat" not in path
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = server.post(path, json={**body, "max_tokens": 1, field: REFUSED[field]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_thinking_budget_needs_a_reasoning_model(server, path):
    body = ({"prompt": PROMPT} if "chat" not in path
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = server.post(path, json={**body, "max_tokens": 1, "thinking_token_budget": 5})
    assert r.status_code == 400 and "</think>" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body,needle", [
    # tools default to tool_choice "auto", which needs the server's flags (as in vLLM)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "schema"),
])
def test_tool_and_constraint_misuse_is_400(server, body, needle):
    r = server.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_bad_words_keep_a_word_out_of_the_output(client):
    """vLLM's bad_words: the greedy output's second word never comes with it banned."""
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    word = free.choices[0].text.split()[1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [word]})
    assert word not in r.choices[0].text.split(), (word, r.choices[0].text)
    bad = client.with_options(max_retries=0).completions
    with pytest.raises(openai.BadRequestError) as e:
        bad.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"bad_words": [""]})
    assert "bad_words" in e.value.message


def test_defaults_of_refused_fields_pass(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={
        "use_beam_search": False, "length_penalty": 1.0, "structured_outputs": None,
        "bad_words": [], "include_reasoning": True})
    assert r.choices[0].finish_reason == "length"


def test_seed_beyond_int64_is_400(client):
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, seed=seed)
        assert "seed" in e.value.message and "_than_equal" in e.value.message


# ---- prompt scoring, logprobs ------------------------------------------------------------------
def test_echo_with_max_tokens_0_scores_the_prompt(server, client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # the same numbers as prompt_logprobs, the engine's own scoring of the prompt
    pr = server.post("/v1/completions", json={"prompt": ids, "max_tokens": 1,
                                              "prompt_logprobs": 0}).json()
    want = [None] + [pos[str(t)]["logprob"] for pos, t in
                     zip(pr["choices"][0]["prompt_logprobs"][1:], ids[1:])]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    with pytest.raises(openai.BadRequestError):  # 0 without echo generates nothing: refused
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


def test_logprobs_minus_one_is_the_whole_vocabulary(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=-1,
                                  extra_body={"return_tokens_as_token_ids": True})
    top = r.choices[0].logprobs.top_logprobs[0]
    assert len(top) == VOCAB
    assert abs(sum(2.718281828 ** v for v in top.values()) - 1) < 1e-3


def test_chat_prompt_logprobs_are_returned(server):
    msgs = [{"role": "user", "content": "Hi"}]
    r = server.post("/v1/chat/completions",
                    json={"messages": msgs, "max_tokens": 1, "prompt_logprobs": 1}).json()
    plp = r["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(1 <= len(p) <= 2 for p in plp[1:])
    assert {"logprob", "rank", "decoded_token"} <= set(next(iter(plp[1].values())))
    r = server.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                  "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_return_token_ids_and_tokens_as_ids(client, server, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=1, echo=True, extra_body={
                                      "return_token_ids": True, "return_tokens_as_token_ids": True})
    ch = r.choices[0]
    assert ch.prompt_token_ids == tokenizer.encode(PROMPT) and len(ch.token_ids) == 3
    assert ch.logprobs.tokens == [f"token_id:{t}" for t in ch.prompt_token_ids + ch.token_ids]
    assert all(next(iter(top)) == tok for tok, top in
               zip(ch.logprobs.tokens[1:], ch.logprobs.top_logprobs[1:]))
    plain = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_token_ids"] is None  # the key is always there
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, extra_body={"return_token_ids": True,
                                                  "return_tokens_as_token_ids": True})
    assert tokenizer.decode(chat.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    assert [c.token for c in chat.choices[0].logprobs.content] == \
        [f"token_id:{t}" for t in chat.choices[0].token_ids]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, stream=True, extra_body={"return_token_ids": True})
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["prompt_token_ids"] == chat.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == \
        chat.choices[0].token_ids


@pytest.mark.parametrize("side,expect", [("left", slice(-4, None)), ("right", slice(0, 4)),
                                         (None, slice(-4, None))])  # (vLLM's default: left)
def test_truncate_prompt_tokens(client, side, expect):
    ids = list(range(100, 110))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 4, "return_token_ids": True,
        **({"truncation_side": side} if side else {})})
    assert r.choices[0].prompt_token_ids == ids[expect] and r.usage.prompt_tokens == 4


# ---- chat options ------------------------------------------------------------------------------
def test_continue_final_message_with_echo(client, server, tokenizer):
    msgs = [{"role": "user", "content": "Tell me about Paris."},
            {"role": "assistant", "content": "Paris is"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"continue_final_message": True,
                                                   "add_generation_prompt": False,
                                                   "echo": True, "return_token_ids": True})
    assert r.choices[0].message.content.startswith("Paris is")
    want = tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert tokenizer.decode(r.prompt_token_ids) == want
    tok = server.post("/tokenize", json={"messages": msgs, "continue_final_message": True,
                                         "add_generation_prompt": False}).json()
    assert tok["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    bad = server.post("/v1/chat/completions", json={"messages": msgs,
                                                    "continue_final_message": True})
    assert bad.status_code == 400  # add_generation_prompt defaults to true


@pytest.mark.parametrize("role", ["developer", "my-custom-role"])
def test_any_role_the_template_handles(client, role):
    a = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                       messages=[{"role": role, "content": "what is 1+1?"}])
    b = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": role, "content": [{"type": "text", "text": "what is 1+1?"}]}])
    assert a.choices[0].message.content == b.choices[0].message.content


def test_continuous_usage_and_forced_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    usages = [c.usage.completion_tokens for c in stream]
    assert usages[0] == 0 and usages[-1] == 3 and usages == sorted(usages)
    # --enable-force-include-usage: usage on every chunk and a usage chunk at the end, asked
    # for or not (vLLM's should_include_usage)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == sorted(
        c.usage.completion_tokens for c in chunks)


def test_cached_tokens_reported_on_a_miss_too(client):
    """--enable-prompt-tokens-details: prompt_tokens_details on every response, cached_tokens
    0 on a miss (vLLM 0.28's own test_single_completion asserts it)."""
    prompt = "A fresh prompt for the prefix cache: " + "lorem ipsum dolor sit amet " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_batch_chat_completions(server):
    r = server.post("/v1/chat/completions/batch", json={
        "messages": [[{"role": "user", "content": "Hi"}],
                     [{"role": "user", "content": "Yo"}, {"role": "assistant", "content": "A"}]],
        "max_tokens": 2, "temperature": 0, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True})
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][1]["message"]["content"].startswith("A")  # its own conversation
    assert server.post("/v1/chat/completions/batch", json={
        "messages": [[{"role": "user", "content": "Hi"}]], "stream": True}).status_code == 400


# ---- routes and headers ------------------------------------------------------------------------
def test_models_by_id_and_root_path(server):
    card = server.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] == 2048
    assert server.get("/v1/models/nope").status_code == 404
    # --root-path /llm: routes answer with and without the prefix
    prefixed = server.get(f"/llm/v1/models/{MODEL}").json()
    assert {**prefixed, "created": 0} == {**card, "created": 0}
    assert server.get("/llm/health").status_code == 200


def test_tokenize_token_strs_and_tokenizer_info(server, tokenizer):
    r = server.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert server.post("/tokenize", json={"prompt": "Hi"}).json()["token_strs"] is None
    info = server.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "chat_template" in info
    assert not any("file" in k for k in info) and "name_or_path" not in info


def test_request_id_and_orca_headers(server):
    r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                    headers={"X-Request-Id": "abc123", "endpoint-load-metrics-format": "TEXT"})
    assert r.headers["x-request-id"] == "abc123" and r.json()["id"] == "cmpl-abc123"
    orca = r.headers["endpoint-load-metrics"]
    assert orca.startswith("TEXT ") and "named_metrics.kv_cache_usage_perc=" in orca
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 1},
                    headers={"endpoint-load-metrics-format": "JSON"})
    report = json.loads(r.headers["endpoint-load-metrics"][len("JSON "):])
    assert set(report["named_metrics"]) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert len(r.headers["x-request-id"]) == 32
    assert "endpoint-load-metrics" not in server.get("/health").headers


def test_server_load(server):
    assert server.get("/load").json() == {"server_load": 0}
    seen, done = [], threading.Event()

    def poll():  # until the request is answered (not a fixed 100 polls: seconds idle)
        while not done.is_set():
            seen.append(server.get("/load").json()["server_load"])
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True})
    done.set()
    t.join()
    assert max(seen) == 1 and server.get("/load").json() == {"server_load": 0}


def test_invocations_route_by_body(server):
    chat = server.post("/invocations", json={"messages": [{"role": "user", "content": "x"}],
                                             "max_tokens": 1})
    assert chat.json()["object"] == "chat.completion"
    cmpl = server.post("/invocations", json={"prompt": "x", "max_tokens": 1})
    assert cmpl.json()["object"] == "text_completion"
    bad = server.post("/invocations", json={"nothing": 1})
    assert bad.status_code == 400 and "ChatCompletionRequest" in bad.json()["error"]["message"]
    assert server.post("/ping").status_code == 200 and server.get("/ping").status_code == 200


# ---- Responses API -----------------------------------------------------------------------------
def test_responses_text_previous_id_and_stream(client):
    r = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=3,
                                temperature=0)
    assert r.id.startswith("resp_") and r.status == "incomplete" and r.output_text
    assert r.usage.output_tokens == 3
    again = client.responses.create(model=MODEL, input="Again", previous_response_id=r.id,
                                    max_output_tokens=2, instructions="Be brief")
    assert again.usage.input_tokens > r.usage.input_tokens  # the conversation came along
    assert client.responses.retrieve(r.id).output_text == r.output_text
    with client.responses.stream(model=MODEL, input="Count", max_output_tokens=3,
                                 temperature=0) as s:
        evs = list(s)
    kinds = [e.type for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds
    assert evs[-1].response.output[0].content[0].text == \
        "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    # at most --max-stored-responses (2) are kept: the first is gone by now
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])


def test_previous_response_id_malformed_is_400_unknown_is_404(server):
    bad = server.post("/v1/responses", json={"model": MODEL, "input": "x",
                                             "previous_response_id": "bad"})
    assert bad.status_code == 400
    assert "Expected an ID that begins with 'resp'" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "previous_response_id"
    unknown = server.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                 "previous_response_id": "resp_0123"})
    assert unknown.status_code == 404


def test_chat_responses_carry_service_tier(server):
    """The openai SDK (2.31, as vLLM's tests pin it) expects the key, null here."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = server.post("/v1/chat/completions", json=body)
    assert "service_tier" in r.json() and r.json()["service_tier"] is None
    streamed = server.post("/v1/chat/completions", json={**body, "stream": True})
    lines = [ln for ln in streamed.text.splitlines() if ln.startswith("data: {")]
    assert lines and all('"service_tier": null' in ln or '"service_tier":null' in ln
                         for ln in lines)


# ---- metrics -----------------------------------------------------------------------------------
VLLM_FAMILIES = ["num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason",
                 "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "iteration_tokens_total", "cache_config_info", "request_success_total",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"]


def test_vllm_metric_names_and_counts(server, client):
    def value(text: str, name: str) -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith(name + "{") or ln.startswith(name + " "))

    before = server.get("/metrics").text
    ids = list(range(200, 210))
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=4,
                                  extra_body={"ignore_eos": True})
    text = server.get("/metrics").text
    for fam in VLLM_FAMILIES:
        assert f"vllm:{fam}" in text and f"shoal:{fam}" in text, fam
    for prefix in ("vllm", "shoal"):
        def delta(name: str, p: str = prefix) -> float:
            return value(text, f"{p}:{name}") - value(before, f"{p}:{name}")

        assert delta("request_prompt_tokens_sum") == 30
        assert delta("request_generation_tokens_sum") == 12
        assert delta("request_params_max_tokens_sum") == 12
        assert delta("request_params_n_count") == 3
        assert delta("iteration_tokens_total_sum") >= 12
        for phase in ("queue", "prefill", "decode", "inference"):
            assert delta(f"request_{phase}_time_seconds_count") == 3
        assert delta("inter_token_latency_seconds_count") == 9
    assert 'kv_cache_size_tokens="' in text and 'kv_cache_max_concurrency="' in text


_SCHEMA_X = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}


@pytest.mark.parametrize("path,body,param", [
    # the engine's names, as the request names them (routes.field_names)
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
    ("/v1/chat/completions", {"response_format": _SCHEMA_X}, "response_format"),
    ("/v1/completions", {"response_format": _SCHEMA_X}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]},
     "messages"),
    ("/v1/completions", {"prompt": "word " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(100)]}, "stop"),
])
def test_error_bodies_name_the_request_s_field(server, path, body, param):
    base = ({"prompt": PROMPT} if "chat" not in path
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = server.post(path, json={**base, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
