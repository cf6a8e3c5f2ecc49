"""`LLM` calls a vLLM user makes that shoal took differently before (an audit of the offline
API against vLLM's): chat's continue_final_message and tools, truncate_prompt_tokens on
generation and pooling, a flat list of token ids as one prompt, and prompts that are no
prompt at all refused with ValueError. The real SmolLM2 (float32); pooling's in
tests/pooling/test_pooling_truncation.py."""

from __future__ import annotations

import pytest

from shoal import SamplingParams, TokensPrompt

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def test_chat_continues_the_final_message(smollm_llm):
    msgs = [{"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "Hello! My name"}]
    out = smollm_llm.chat(msgs, GREEDY, add_generation_prompt=False,
                          continue_final_message=True, use_tqdm=False)[0]
    tok = smollm_llm.get_tokenizer()
    text = tok.decode(out.prompt_token_ids)
    assert text.endswith("Hello! My name")  # the turn is left open, no end marker after it
    new_turn = smollm_llm.chat(msgs, GREEDY, add_generation_prompt=False, use_tqdm=False)[0]
    assert new_turn.prompt_token_ids != out.prompt_token_ids
    with pytest.raises(ValueError, match="add_generation_prompt"):
        smollm_llm.chat(msgs, GREEDY, continue_final_message=True, use_tqdm=False)


def test_chat_hands_tools_to_the_template(smollm_llm):
    template = ("{% for t in tools %}TOOL:{{ t['function']['name'] }};{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = smollm_llm.chat([{"role": "user", "content": "hi"}], GREEDY, tools=tools,
                          chat_template=template, use_tqdm=False)[0]
    assert smollm_llm.get_tokenizer().decode(out.prompt_token_ids) == "TOOL:get_weather;hi"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        smollm_llm.chat([{"role": "user", "content": "hi"}], GREEDY,
                        chat_template_content_format="openai", use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        smollm_llm.chat([{"role": "user", "content": "hi"}], GREEDY,
                        mm_processor_kwargs={"num_crops": 4}, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_end(smollm_llm):
    tok = smollm_llm.get_tokenizer()
    text = "one two three four five six seven eight nine ten"
    ids = tok.encode(text)
    want = ids[-4:]  # vLLM's generation side, whatever the tokenizer's own (right here)
    assert tok.truncation_side == "right"
    for prompt in (text, TokensPrompt(prompt_token_ids=ids)):
        out = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2,
                                                         truncate_prompt_tokens=4),
                                  use_tqdm=False)[0]
        assert out.prompt_token_ids == want
    plain = smollm_llm.generate({"prompt_token_ids": want}, SamplingParams(
        temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    long = "word " * 3000  # past max_model_len (2048): -1 keeps what fits
    out = smollm_llm.generate(long, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                              use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 2047
    assert out.prompt_token_ids == tok.encode(long)[-2047:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        smollm_llm.generate(text, SamplingParams(truncate_prompt_tokens=5000), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_prompt_shapes(smollm_llm):
    ids = smollm_llm.get_tokenizer().encode("The capital of France is")
    flat = smollm_llm.generate(ids, GREEDY, use_tqdm=False)
    assert len(flat) == 1 and flat[0].prompt_token_ids == ids
    nested = smollm_llm.generate([ids, ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in nested] == [flat[0].outputs[0].token_ids] * 2
    for bad in (None, 3, b"bytes"):
        with pytest.raises(ValueError, match="prompt"):
            smollm_llm.generate(bad, GREEDY, use_tqdm=False)


def test_bad_words_keep_words_out(smollm_llm):
    """The greedy output's words, banned: none of them comes back as a word (a word after a
    space is its own token sequence: both forms are banned); token id sequences too."""
    tok = smollm_llm.get_tokenizer()
    free = smollm_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    words = free.text.split()[:2]
    out = smollm_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=8, bad_words=words), use_tqdm=False)[0].outputs[0]
    assert not set(words) & set(out.text.split()), (words, out.text)
    first = free.token_ids[0]
    by_ids = smollm_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=3, bad_words_token_ids=[[first]]), use_tqdm=False)[0]
    assert first not in by_ids.outputs[0].token_ids
    for bad in ([""], [3], "   "):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        smollm_llm.generate("x", SamplingParams(bad_words_token_ids=[[len(tok) + 5]]),
                            use_tqdm=False)


def test_a_cut_keeps_the_special_tokens_a_tokenizer_adds():
    from shoal.prompt_truncation import encode_kept

    plain = [5, 6, 7, 8, 9]
    bos = {True: [1, *plain], False: plain}
    assert encode_kept(bos.__getitem__, 4, "left") == [1, 7, 8, 9]
    bert = {True: [101, *plain, 102], False: plain}
    assert encode_kept(bert.__getitem__, 4, "right") == [101, 5, 6, 102]
    assert encode_kept(bert.__getitem__, 2, "right") == [101, 5]  # only the specials fit
    assert encode_kept(bert.__getitem__, 10, "right") == [101, *plain, 102]


def test_chat_prompts_are_cut_too(smollm_llm):
    msgs = [{"role": "user", "content": "one two three four five six seven eight"}]
    full = smollm_llm.chat(msgs, GREEDY, use_tqdm=False)[0].prompt_token_ids
    cut = smollm_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2,
                                               truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == full[-5:]


def test_bad_words_that_are_not_unicode_and_untokenized_ones_are_refused(smollm_llm):
    from shoal.core.types import EngineCoreRequest
    from shoal.engine.request_checks import validate_core_request

    with pytest.raises(ValueError, match="bad_words"):
        smollm_llm.generate("x", SamplingParams(bad_words=["a\ud800"]), use_tqdm=False)
    limits = smollm_llm.llm_engine.inputs.limits
    req = EngineCoreRequest("r", [1, 2], SamplingParams(bad_words=["Paris"]), 0.0)
    with pytest.raises(ValueError, match="bad_words"):
        validate_core_request(limits, req)
