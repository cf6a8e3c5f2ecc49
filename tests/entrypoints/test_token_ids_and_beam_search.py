"""allowed_token_ids, logprob_token_ids and beam search through `shoal serve` with the openai
client: vLLM 0.28's request and response shapes (its test_logprob_token_ids[_stream] and the
beam-search half of test_batch_completions), the values against full-vocabulary logprobs, and
a 400 naming the field for every combination vLLM refuses."""

from __future__ import annotations

import openai
import pytest

from .conftest import RemoteServer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
VOCAB = 49152
MESSAGES = [{"role": "user", "content": "Name a colour."}]
IDS = {"logprob_token_ids": [5000], "allowed_token_ids": [42], "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def server(smollm2_server) -> RemoteServer:
    return smollm2_server  # --max-logprobs -1 among its flags; prefix caching is the default


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_logprob_token_ids_as_vllm(client):
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0.0,
                                  logprobs=5, extra_body=IDS)
    lp = c.choices[0].logprobs
    assert lp.tokens == ["token_id:42"]
    assert set(lp.top_logprobs[0]) == {"token_id:42", "token_id:5000"}
    # The raw logprobs of the model, as the whole vocabulary shows them.
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1,
                                     temperature=0.0, logprobs=-1,
                                     extra_body={"return_tokens_as_token_ids": True})
    truth = full.choices[0].logprobs.top_logprobs[0]
    assert lp.top_logprobs[0]["token_id:5000"] == pytest.approx(truth["token_id:5000"], abs=1e-4)
    assert lp.token_logprobs[0] == pytest.approx(truth["token_id:42"], abs=1e-4)


def test_logprob_token_ids_stream_as_vllm(client):
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1,
                                       temperature=0.0, logprobs=5, stream=True, extra_body=IDS)
    tops = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
            for t in chunk.choices[0].logprobs.top_logprobs or [] if t is not None]
    assert len(tops) == 1 and set(tops[0]) == {"token_id:42", "token_id:5000"}


def test_allowed_token_ids_restrict_sampling_and_chat_logprob_token_ids(client, server):
    allowed = [330, 2113, 3001]
    for temperature in (0.0, 1.0):
        c = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8,
                                      temperature=temperature, seed=3,
                                      extra_body={"allowed_token_ids": allowed,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert c.choices[0].token_ids and set(c.choices[0].token_ids) <= set(allowed)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          temperature=0.0, logprobs=True, top_logprobs=5,
                                          extra_body={"logprob_token_ids": [5000, 17],
                                                      "return_tokens_as_token_ids": True})
    for tok in chat.choices[0].logprobs.content:
        # The sampled token and the asked ids, in that order (vLLM's return-all shape).
        assert [t.token for t in tok.top_logprobs][1:] == ["token_id:5000", "token_id:17"]
        assert tok.top_logprobs[0].token == tok.token


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hi", "logprob_token_ids": [5]}, "logprob_token_ids"),  # needs logprobs
    ({"prompt": "Hi", "logprobs": 1, "logprob_token_ids": [VOCAB]}, "logprob_token_ids"),
    ({"prompt": "Hi", "logprobs": 1, "logprob_token_ids": list(range(129))},
     "logprob_token_ids"),
    ({"prompt": "Hi", "allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"prompt": "Hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "Hi", "echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [5]},
     "logprob_token_ids"),
    ({"prompt": "Hi", "use_beam_search": True, "n": 2, "stream": True}, "use_beam_search"),
    ({"prompt": "Hi", "use_beam_search": True, "logprobs": 1, "logprob_token_ids": [5]},
     "logprob_token_ids"),
    ({"prompt": "Hi", "length_penalty": 0.5}, "length_penalty"),
    ({"prompt": "Hi", "use_beam_search": True, "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "Hi", "use_beam_search": True, "max_tokens": 4000}, "max_tokens"),
    ({"prompt": "Hi", "use_beam_search": True, "stop": ["x"]}, "stop"),  # beams ignore it
    ({"prompt": "Hi", "use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"prompt": "Hi", "use_beam_search": True, "n": 0}, "n"),
    ({"prompt": "Hi", "use_beam_search": True, "n": 129}, "n"),  # > max_n (128)
    ({"messages": MESSAGES, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ({"messages": MESSAGES, "use_beam_search": True, "stream": True}, "use_beam_search"),
])
def test_refusals_name_the_field(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = server.post(path, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_beam_search_batch_completions_as_vllm(client):
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5,
                                          temperature=0.0,
                                          extra_body={"use_beam_search": True})
        texts = [c.text for c in batch.choices]
        assert len(texts) == 4
        assert texts[0] != texts[1], "beam search should be different"
        assert texts[0] == texts[2] and texts[1] == texts[3]
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.usage.completion_tokens <= 4 * 5


def test_beam_width_one_is_greedy_and_beams_are_ranked(client):
    greedy = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=6, temperature=0.0, logprobs=0,
                                       extra_body={"ignore_eos": True})
    beam = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=6, temperature=0.0, logprobs=0,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text
    wide = client.completions.create(model=MODEL, prompt="The capital of France is", n=3,
                                     max_tokens=6, temperature=0.0, logprobs=0,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    sums = [sum(c.logprobs.token_logprobs) for c in wide.choices]
    assert sums == sorted(sums, reverse=True)
    assert sums[0] >= sum(greedy.choices[0].logprobs.token_logprobs) - 1e-4
    assert len({c.text for c in wide.choices}) == 3


def test_chat_beam_search(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4,
                                       temperature=0.0, extra_body={"use_beam_search": True})
    assert len(r.choices) == 2 and r.choices[0].message.content != r.choices[1].message.content
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.0)
    greedy = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    one = client.chat.completions.create(**kw, extra_body={"use_beam_search": True,
                                                           "ignore_eos": True})
    assert one.choices[0].message.content == greedy.choices[0].message.content


def test_server_still_serves_after_refusals(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                  extra_body={"allowed_token_ids": [VOCAB + 5]})
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert c.choices[0].finish_reason in ("stop", "length")


def test_request_to_params_without_a_server():
    from shoal.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    req = CompletionRequest(prompt="a", logprobs=5, logprob_token_ids=[7, 8],
                            allowed_token_ids=[3])
    sp = req.to_sampling_params(4, req.logprobs, None)
    # The explicit ids replace the top-k, as vLLM's protocol does.
    assert (sp.logprobs, sp.num_logprobs, sp.logprob_token_ids) == (None, 2, [7, 8])
    assert sp.allowed_token_ids == [3]
    bp = CompletionRequest(prompt="a", n=3, use_beam_search=True, length_penalty=0.5,
                           ignore_eos=True).to_beam_search_params(7)
    assert (bp.beam_width, bp.max_tokens, bp.length_penalty, bp.ignore_eos,
            bp.temperature) == (3, 7, 0.5, True, 0.0)
    assert CompletionRequest(prompt="a", use_beam_search=True, seed=1).unsupported()[0] == "seed"
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 use_beam_search=True).unsupported() is None
