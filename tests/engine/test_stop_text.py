"""What a request's text holds where it stops, as vLLM's: the token that ended it (EOS, a stop
token id) is in token_ids but not in the text unless include_stop_str_in_output; stop
strings count only after min_tokens tokens; a half character at the end is dropped. The real
SmolLM2 (float32, greedy)."""

from __future__ import annotations

from shoal import SamplingParams

PROMPT = "The capital of France is"


def _one(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_a_stop_token_s_text_is_left_out_unless_asked_for(smollm_llm):
    tok = smollm_llm.get_tokenizer()
    free = _one(smollm_llm, PROMPT, max_tokens=16, ignore_eos=True)
    dot = next(t for t in free.token_ids if tok.decode([t]) == ".")  # the first "." token
    cut = free.token_ids.index(dot) + 1
    out = _one(smollm_llm, PROMPT, max_tokens=16, stop_token_ids=[dot])
    assert out.token_ids == free.token_ids[:cut] and out.stop_reason == dot
    assert out.text == tok.decode(free.token_ids[:cut - 1])
    kept = _one(smollm_llm, PROMPT, max_tokens=16, stop_token_ids=[dot],
                include_stop_str_in_output=True)
    assert kept.text == tok.decode(free.token_ids[:cut]) and kept.text.endswith(".")


def test_eos_text_is_left_out_with_special_tokens_shown(smollm_llm):
    out = smollm_llm.chat([{"role": "user", "content": "Say hi"}],
                          SamplingParams(temperature=0, max_tokens=48,
                                         skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    eos = smollm_llm.get_tokenizer().decode(out.token_ids[-1:])
    assert eos.startswith("<|") and not out.text.endswith(eos)


def test_stop_strings_wait_for_min_tokens(smollm_llm):
    tok = smollm_llm.get_tokenizer()
    free = _one(smollm_llm, PROMPT, max_tokens=24, ignore_eos=True)
    first = _one(smollm_llm, PROMPT, max_tokens=24, stop=["."])
    assert first.finish_reason == "stop"
    n_first = len(first.token_ids)
    later = _one(smollm_llm, PROMPT, max_tokens=24, stop=["."], min_tokens=n_first + 1)
    # the "." that stopped `first` lies in the first min_tokens tokens: not a stop any more
    assert len(later.token_ids) > n_first + 1
    assert later.text.startswith(first.text + ".")
    assert free.token_ids[:len(later.token_ids)] == later.token_ids
    if later.finish_reason == "stop":  # a later "." ended it, cut from the text
        full = tok.decode(later.token_ids)
        assert later.stop_reason == "." and later.text == full[:full.rindex(".")]
