"""The GGUF tokenizer on tiny vocabularies, checked against transformers' own GGUF tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter
from transformers import AutoTokenizer

from shoal.loader import load_model, load_tokenizer
from shoal.loader.gguf_file import open_gguf
from shoal.loader.gguf_tokenizer import build_gguf_tokenizer

BYTE_LEVEL_TEXTS = [
    "the world in a the",
    "  two  spaces   and\n\nnewlines\t\ttabs ",
    "digits 345 x9y22",  # no "12": see test_smollm_pre_tokenizer_splits_digits
    "héllo wörld 日本 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<think>hmm</think>",
    "",
]


def _reference(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_byte_level_matches_transformers(tiny_llama):
    ours = load_model(str(tiny_llama.path), load_format="dummy").tokenizer
    reference = _reference(tiny_llama.path)
    for text in BYTE_LEVEL_TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )


def test_byte_level_special_tokens(tiny_llama):
    tok = load_tokenizer(str(tiny_llama.path))
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_end|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    # control and user-defined tokens keep their own ids and are matched whole
    ids = tok.encode("<|im_start|><think><|im_end|>")
    assert ids == [1, tok.convert_tokens_to_ids("<think>"), 2]
    assert len(tok) == tok.vocab_size  # nothing was appended past the file's vocabulary
    assert tok.encode("the")[0] != tok.bos_token_id  # add_bos_token is false in the file


def test_chat_template_from_metadata(tiny_llama):
    tok = load_tokenizer(str(tiny_llama.path))
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm_pre_tokenizer_splits_digits(tiny_llama):
    tok = load_tokenizer(str(tiny_llama.path))
    # The tiny vocabulary has a "12" merge, but llama.cpp's "smollm" pre-tokenizer (like SmolLM2's
    # original tokenizer.json) splits every digit off first. transformers' GGUF tokenizer omits
    # that split; the real SmolLM2 vocabulary has no multi-digit tokens, so there it agrees.
    assert tok.tokenize("12") == ["1", "2"]
    assert tok.tokenize("a 12") == ["a", "Ġ", "1", "2"]


def test_sentencepiece_matches_transformers_on_plain_text(make_gguf):
    tiny = make_gguf(name="spm.gguf", tokenizer="llama")
    ours = load_tokenizer(str(tiny.path))
    reference = _reference(tiny.path)
    for text in ["the world in a the", "hello there", "UPPER ü 日本 😀", "a  b   c", ""]:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids), text
    assert ours.encode("the")[0] == ours.bos_token_id == 1  # add_bos_token is true


def test_sentencepiece_space_prefix_follows_llama_cpp(make_gguf):
    # llama.cpp (and SentencePiece's add_dummy_prefix) always prepend a space, also to text that
    # already starts with one and to text right after a special token; transformers' GGUF
    # tokenizer skips both, so these two differ from it on purpose.
    tiny = make_gguf(name="spm.gguf", tokenizer="llama")
    tok = load_tokenizer(str(tiny.path))
    assert tok.tokenize(" in") == ["▁", "▁in"]
    assert tok.tokenize("<s>in", add_special_tokens=False) == ["<s>", "▁in"]


def test_unsupported_tokenizer_model(tmp_path: Path):
    path = tmp_path / "bert_vocab.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'bert'") as info:
        build_gguf_tokenizer(open_gguf(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_other_byte_level_pre_tokenizers_match_transformers(make_gguf, pre):
    tiny = make_gguf(name=f"{pre}.gguf", pre=pre)
    ours = load_tokenizer(str(tiny.path))
    reference = _reference(tiny.path)
    for text in [*BYTE_LEVEL_TEXTS, "digits 12345 x1y22", "it's THEY'LL", "a\r\n\r\n  b  "]:
        assert ours.encode(text) == reference.encode(text), (pre, text)


def test_unknown_pre_tokenizer_falls_back_to_gpt2(make_gguf, caplog):
    tiny = make_gguf(name="odd.gguf", pre="something-new")
    with caplog.at_level("WARNING"):
        tok = load_tokenizer(str(tiny.path))
    assert "something-new" in caplog.text
    assert tok.tokenize("the 12") == ["t", "he", "Ġ", "12"]  # digits stay together
