"""Build a transformers fast tokenizer from the tokenizer metadata stored in a GGUF file."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from shoal.loader.gguf_file import GGUFFile
from shoal.loader.gguf_pretokenizers import build_normalizer, build_pre_tokenizer, byte_level_split
from shoal.loader.gguf_spm import build_spm_backend

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_CONTROL = 3  # e.g. <|im_start|>: special, never produced by splitting text
TOKEN_USER_DEFINED = 4  # e.g. <think>: always matched whole, but not special

SUPPORTED_MODELS = ("gpt2", "llama")


def build_gguf_tokenizer(gguf: GGUFFile) -> PreTrainedTokenizerFast:
    """The file's tokenizer; ValueError for missing, unsupported or damaged metadata."""
    try:
        return _build(gguf)
    except ValueError:
        raise
    except Exception as exc:  # tokenizers raises plain Exception for a bad vocabulary
        raise ValueError(f"GGUF file {gguf.path} has tokenizer metadata shoal cannot use: "
                         f"{type(exc).__name__}: {exc}") from exc


def _build(gguf: GGUFFile) -> PreTrainedTokenizerFast:
    kind = gguf.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"GGUF file {gguf.path} has no tokenizer (no tokenizer.ggml.model)")
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    if kind == "gpt2":
        backend = _byte_level_backend(gguf, tokens)
    elif kind == "llama":
        backend = _sentencepiece_backend(gguf, tokens)
    else:
        raise ValueError(
            f"GGUF file {gguf.path} uses tokenizer model {kind!r}, which shoal cannot build; "
            f"supported: {', '.join(SUPPORTED_MODELS)}. Pass tokenizer=<folder> to use another one."
        )
    _add_special_tokens(backend, tokens, gguf.get("tokenizer.ggml.token_type") or [])

    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise
    add_bos_default = kind == "llama"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_token(gguf, tokens, "bos_token_id"),
        eos_token=_token(gguf, tokens, "eos_token_id"),
        unk_token=_token(gguf, tokens, "unknown_token_id"),
        pad_token=_token(gguf, tokens, "padding_token_id"),
        add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=gguf.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        name_or_path=str(gguf.path),
    )


def _byte_level_backend(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    merges = [_split_merge(merge) for merge in gguf.require("tokenizer.ggml.merges")]
    split = byte_level_split(gguf.get("tokenizer.ggml.pre"))
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    backend = Tokenizer(
        BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=split.ignore_merges)
    )
    backend.normalizer = build_normalizer(split)
    backend.pre_tokenizer = build_pre_tokenizer(
        split, add_prefix_space=bool(gguf.get("tokenizer.ggml.add_space_prefix", False))
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    scores = gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = _token(gguf, tokens, "unknown_token_id")
    return build_spm_backend(
        tokens,
        [float(score) for score in scores],
        unk_token=unk,
        add_space_prefix=bool(gguf.get("tokenizer.ggml.add_space_prefix", True)),
    )


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from 1 so a merge whose left side is itself a space still splits in the right place.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return merge[:cut], merge[cut + 1 :]


def _add_special_tokens(backend: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    # Every one of these strings is already in the vocabulary, so adding them keeps their ids; it
    # only makes the tokenizer match them whole in text instead of splitting them into bytes.
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_CONTROL
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


def _token(gguf: GGUFFile, tokens: list[str], key: str) -> str | None:
    token_id = gguf.get(f"tokenizer.ggml.{key}")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]
