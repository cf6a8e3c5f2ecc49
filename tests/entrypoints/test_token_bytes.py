"""The logprobs `bytes` field from a token's own bytes (token_bytes.py): a position's bytes
rebuild the text where tokens are parts of UTF-8 characters, for byte-level BPE (the
embedded SmolLM2's tokenizer) and SentencePiece's <0xHH> pieces; and completions'
text_offset counts the characters the tokens complete."""

from __future__ import annotations

from shoal.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from shoal.entrypoints.openai.token_bytes import _byte_level_table, token_bytes_fn
from shoal.loader import load_frontend_tokenizer
from shoal.outputs import Logprob

TEXT = "日本の首都は 東京 😀!"


def test_byte_level_tokens_give_their_own_bytes():
    tok = load_frontend_tokenizer(None, None)
    raw = token_bytes_fn(tok, lambda i: tok.decode([i]))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some tokens are half a character
    assert b"".join(raw(i) for i in ids).decode("utf-8") == TEXT
    assert raw(tok.eos_token_id) == tok.decode([tok.eos_token_id]).encode()
    assert len(_byte_level_table()) == 256 and sorted(_byte_level_table().values()) == \
        list(range(256))


def test_sentencepiece_byte_pieces():
    class Piece:  # a SentencePiece vocabulary's shape: <0xHH> bytes, U+2581 spaces
        backend_tokenizer = type("B", (), {"decoder": "Sequence([Replace, ByteFallback])"})()
        all_special_ids = [0]
        pieces = {1: "<0xE6>", 2: "<0x97>", 3: "<0xA5>", 4: "\u2581Tokyo"}

        def convert_ids_to_tokens(self, i):
            return self.pieces[i]

    raw = token_bytes_fn(Piece(), lambda i: "<s>")
    assert b"".join(raw(i) for i in (1, 2, 3, 4)).decode() == "日 Tokyo"
    assert raw(0) == b"<s>"


def _response():
    """TEXT's tokens as a response: (tokenizer, ids, decode, token bytes, logprob positions)."""
    tok = load_frontend_tokenizer(None, None)
    ids = tok.encode(TEXT, add_special_tokens=False)

    def decode(i):
        return tok.decode([i])

    positions = [{i: Logprob(-0.5, 1, decode(i))} for i in ids]
    return tok, ids, decode, token_bytes_fn(tok, decode), positions


def test_logprob_fields_rebuild_the_text():
    tok, ids, decode, raw, positions = _response()
    content = chat_logprobs(ids, positions, 1, decode, raw)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8") == TEXT
    legacy = completion_logprobs(ids, positions, 1, decode, token_bytes=raw)
    text = tok.decode(ids)
    assert legacy.text_offset[-1] < len(text) and text[legacy.text_offset[-1]:] == "!"
    starts = [text[o] for o in legacy.text_offset]
    assert starts[0] == "日"


def test_added_tokens_give_their_text_s_bytes():
    tok = load_frontend_tokenizer(None, None)
    added = dict(tok.get_added_vocab())
    tid = next(iter(added.values()))
    raw = token_bytes_fn(tok, lambda i: tok.decode([i], skip_special_tokens=False))
    assert raw(tid) == tok.decode([tid], skip_special_tokens=False).encode("utf-8")


def test_stream_offsets_carry_a_character_across_chunks():
    """A character whose bytes start in one chunk and end in the next counts once: the
    stream's decoder is carried (the offsets equal the whole response's)."""
    from shoal.entrypoints.openai.logprobs import utf8_counter

    _, ids, decode, raw, positions = _response()
    whole = completion_logprobs(ids, positions, 1, decode, token_bytes=raw).text_offset
    cut = next(n for n in range(1, len(ids)) if decode(ids[n]) == "\ufffd"
               and decode(ids[n - 1]) == "\ufffd")  # between two parts of one character
    chars = utf8_counter()
    first = completion_logprobs(ids[:cut], positions[:cut], 1, decode, token_bytes=raw,
                                chars=chars).text_offset
    sent = len(b"".join(raw(i) for i in ids[:cut]).decode("utf-8", "ignore"))
    second = completion_logprobs(ids[cut:], positions[cut:], 1, decode, token_bytes=raw,
                                 chars=chars).text_offset
    assert first + [o + sent for o in second] == whole
