"""A SentencePiece-style BPE tokenizer (GGUF `tokenizer.ggml.model == "llama"`).

These files carry tokens and scores but no merge list. SentencePiece BPE repeatedly joins the
adjacent pair whose joined piece has the highest score, so the merges are recovered by ranking
every (left, right) split of every token by that token's score.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import BPE

SPACE = "\u2581"  # SentencePiece's visible space


def derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    ids = _first_ids(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[piece_id], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_spm_backend(
    tokens: list[str], scores: list[float], unk_token: str | None, add_space_prefix: bool
) -> Tokenizer:
    model = BPE(
        vocab=_first_ids(tokens),
        merges=derive_merges(tokens, scores),
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,  # unknown characters become <0xNN> byte tokens, as in SentencePiece
    )
    backend = Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _first_ids(tokens: list[str]) -> dict[str, int]:
    # Some vocabularies repeat a string; the first id is the one SentencePiece would produce.
    ids: dict[str, int] = {}
    for index, token in enumerate(tokens):
        ids.setdefault(token, index)
    return ids
