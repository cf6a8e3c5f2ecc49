"""A token's own bytes, for the logprobs `bytes` field: OpenAI's clients join a position's
bytes to rebuild text, which a token's decoded text cannot give where a token is part of a
UTF-8 character (it decodes to U+FFFD, whose three bytes are not the token's).

Byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen) writes each byte as one printable
character of a fixed table; a SentencePiece vocabulary writes a raw byte as <0xHH> and a
space as U+2581. Anything else (special and other added tokens, other decoders) falls back to
the decoded text's UTF-8."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> character table, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    text = repr(decoder) if decoder is not None else ""
    if "ByteLevel" in text:
        return "byte_level"
    if "ByteFallback" in text or "Metaspace" in text or "Replace" in text:
        return "sentencepiece"
    return "text"


def token_bytes_fn(tokenizer: Any, decode: Callable[[int], str]) -> Callable[[int], bytes]:
    """token id -> its bytes, for this tokenizer (decode: the id's text, the fallback)."""
    kind = _decoder_kind(tokenizer)
    # special and other added tokens are stored as their text, not in the byte table
    as_text = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "get_added_vocab", None)
    if callable(added):
        as_text.update(added().values())
    table = _byte_level_table()

    def token_bytes(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id) if token_id not in as_text else None
        if isinstance(piece, str):
            if kind == "byte_level" and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            if kind == "sentencepiece":
                raw = _BYTE_TOKEN.match(piece)
                return bytes([int(raw.group(1), 16)]) if raw else \
                    piece.replace("\u2581", " ").encode("utf-8")
        return decode(token_id).encode("utf-8")

    return functools.lru_cache(maxsize=65536)(token_bytes)
