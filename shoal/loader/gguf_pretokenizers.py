"""Pre-tokenizers for byte-level BPE vocabularies, keyed by GGUF's `tokenizer.ggml.pre`.

A BPE vocabulary only reproduces its training segmentation when text is split into words the same
way it was during training; llama.cpp records which splitter a model used in `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers.normalizers import Normalizer
from tokenizers.pre_tokenizers import PreTokenizer

logger = logging.getLogger(__name__)

# Llama 3 style: letters with one optional leading non-letter, numbers in groups of up to three.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 uses the same pattern with single digits.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5 also keeps combining marks (\p{M}) inside words.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ByteLevelSplit:
    """How one `tokenizer.ggml.pre` family splits text before the BPE merges."""

    regex: str | None = None  # a custom split regex; None means GPT-2's built-in one
    individual_digits: bool = False  # split every digit off on its own first (StarCoder family)
    nfc: bool = False  # NFC-normalize first (Qwen2)
    ignore_merges: bool = False  # whole words found in the vocab skip the merges (llama.cpp llama3)


GPT2 = ByteLevelSplit()
DIGITS_THEN_GPT2 = ByteLevelSplit(individual_digits=True)
LLAMA3 = ByteLevelSplit(regex=LLAMA3_SPLIT, ignore_merges=True)
QWEN2 = ByteLevelSplit(regex=QWEN2_SPLIT, nfc=True)
QWEN35 = ByteLevelSplit(regex=QWEN35_SPLIT, nfc=True)

SPLITS: dict[str, ByteLevelSplit] = {
    "default": GPT2,
    "gpt2": GPT2,
    "gpt-2": GPT2,
    "phi-2": GPT2,
    "smollm": DIGITS_THEN_GPT2,
    "starcoder": DIGITS_THEN_GPT2,
    "refact": DIGITS_THEN_GPT2,
    "codeshell": DIGITS_THEN_GPT2,
    "llama3": LLAMA3,
    "llama-bpe": LLAMA3,
    "llama-v3": LLAMA3,
    "falcon3": LLAMA3,
    "smaug-bpe": LLAMA3,
    "dbrx": LLAMA3,
    "qwen2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
    "qwen35": QWEN35,
}


def byte_level_split(pre: str | None) -> ByteLevelSplit:
    if pre is None:
        return GPT2
    split = SPLITS.get(pre)
    if split is None:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting words like GPT-2", pre)
        return GPT2
    return split


def build_pre_tokenizer(split: ByteLevelSplit, add_prefix_space: bool) -> PreTokenizer:
    steps: list[PreTokenizer] = []
    if split.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split.regex is not None:
        steps.append(pre_tokenizers.Split(Regex(split.regex), behavior="isolated"))
    # ByteLevel maps bytes to the printable alphabet the vocabulary is spelled in; it only applies
    # GPT-2's own word regex when no custom one ran before it.
    steps.append(
        pre_tokenizers.ByteLevel(
            add_prefix_space=add_prefix_space, use_regex=split.regex is None, trim_offsets=False
        )
    )
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def build_normalizer(split: ByteLevelSplit) -> Normalizer | None:
    return normalizers.NFC() if split.nfc else None
