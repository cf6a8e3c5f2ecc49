"""Encoder-only models whose modeling code takes no custom attention function (MPNet,
DeBERTa and DeBERTa-v2/v3, RoFormer, XLM, ... : support.packs_prompts is False), run by
transformers' own forward over padded batches of a pooling step's prompts (encoder.py keeps
the packed path for the families that take shoal's attention).

The step's packed prompts are gathered into [B, L] rows, right-padded with the pad token to
the longest prompt of the chunk, with an attention_mask over the real tokens; the real
tokens' states are scattered back to packed order, so the pooler and the checkpoint's head
see what the packed path gives. Right padding leaves each prompt's positions where the
model numbers them itself (from 0, or RoBERTa-like after the padding index), so no
position_ids are passed; segment ids go in where the step has them (0 under padding), and
XLM-like models get their `lengths`.

Families whose padding changes the real tokens' states are run in chunks of equal-length
prompts, which need no padding: a forward that takes no attention_mask (FNet's Fourier
mixing) and PADDING_CHANGES_RESULTS, whose states change with padding despite the mask
(checked with transformers 5.25: the prompt alone against the prompt in a padded batch). One
forward per distinct prompt length is their cost.

Memory: transformers' eager attention holds [B, H, L, L] scores (and their softmax;
DeBERTa its relative-position terms too), so a chunk holds at most MAX_SCORE_ELEMENTS score
entries, and its padded token slots stay within PAD_SLACK times the step's real tokens (a
long prompt does not make every short one pay its length). A single prompt past the score
cap still runs, alone: that is the model's own attention cost (BERT-base at 8192 tokens:
12 x 8192^2 scores, 3 GiB in float32 per tensor)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.attention.packed import PackedSeqs

# Model types whose padded batch changes a prompt's states even under the attention mask
# (ConvBERT's span convolutions, Nystromformer's convolution over the values, YOSO's hashed
# approximation of attention, BigBird's block-sparse pattern past its length threshold: its
# last block is global, and padding moves it).
PADDING_CHANGES_RESULTS = frozenset({"big_bird", "convbert", "nystromformer", "reformer",
                                     "yoso"})
# Score entries of one chunk's attention (2**27: 512 MiB in float32 per score tensor).
MAX_SCORE_ELEMENTS = 1 << 27
# A chunk's padded token slots stay within this many times the step's real tokens.
PAD_SLACK = 1.5


@dataclass(frozen=True)
class PaddedChunk:
    """Prompts of a step (indices into its seq_lens, shortest first) run as one batch."""

    rows: list[int]
    width: int  # the longest of them: every row's padded length


def plan_chunks(seq_lens: list[int], *, pad: bool, num_heads: int, max_slots: int,
                max_scores: int = MAX_SCORE_ELEMENTS) -> list[PaddedChunk]:
    """The step's prompts, shortest first, cut into batches: each within max_slots padded
    tokens and max_scores attention entries (a prompt over them alone runs alone); without
    `pad`, each batch's prompts are of one length."""
    if num_heads < 1 or max_slots < 1 or max_scores < 1:
        raise ValueError(f"num_heads, max_slots and max_scores must be >= 1 (got {num_heads}, "
                         f"{max_slots}, {max_scores})")
    chunks: list[PaddedChunk] = []
    rows: list[int] = []
    width = 0
    for i in sorted(range(len(seq_lens)), key=seq_lens.__getitem__):
        n, b = seq_lens[i], len(rows) + 1
        fits = ((pad or n == width) and b * n <= max_slots
                and b * num_heads * n * n <= max_scores)
        if rows and not fits:
            chunks.append(PaddedChunk(rows, width))
            rows = []
        rows.append(i)
        width = n
    if rows:
        chunks.append(PaddedChunk(rows, width))
    return chunks


class PaddedEncoder:
    """A base model's forward over a pooling step's packed prompts, in padded batches."""

    def __init__(self, base: nn.Module, hf_config: Any, architecture: str):
        self.base = base
        self.architecture = architecture
        accepts = inspect.signature(base.forward).parameters
        self._takes = {k for k in ("attention_mask", "token_type_ids", "lengths", "use_cache")
                       if k in accepts}
        model_type = getattr(hf_config, "model_type", None)
        self.pads = "attention_mask" in self._takes and model_type not in PADDING_CHANGES_RESULTS
        vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
        pad = getattr(hf_config, "pad_token_id", None)
        # (masked out: any id in the vocabulary would do; the pad id keeps RoBERTa-like
        # position numbering as a tokenizer's batch has it)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
        heads = getattr(hf_config, "num_attention_heads", None)
        self.num_heads = heads if isinstance(heads, int) and heads > 0 else 1
        self.hidden_size = self._probe_width()

    def _probe_width(self) -> int:
        """One pass over two made-up prompts (lengths 3 and 2): the width of the states it
        returns per token (Reformer's are twice hidden_size). A base model that does not
        return one state per token (it pools or downsamples) is refused."""
        dev = next(self.base.parameters()).device
        seqs = PackedSeqs.build([3, 2], False, dev)
        ids = torch.full((5,), 1 if self.pad_id != 1 else 2, dtype=torch.long, device=dev)
        try:
            with torch.no_grad():
                out = self._forward_chunk(ids, seqs, [0, 3], PaddedChunk([0, 1], 3))[0]
        except Exception as e:  # (whatever the modeling code raises: a refusal naming it)
            raise ValueError(f"the Transformers backend cannot run {self.architecture}: its "
                             f"forward fails on a batch of 2 prompts padded to 3 tokens "
                             f"({type(e).__name__}: {e})") from e
        if out.dim() != 3 or tuple(out.shape[:2]) != (2, 3):
            raise ValueError(f"the Transformers backend cannot run {self.architecture}: its "
                             f"base model returns states of shape {tuple(out.shape)} for 2 "
                             "prompts of 3 token slots, not one state per token")
        return int(out.shape[-1])

    def __call__(self, input_ids: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        """[T] packed prompts -> [T, hidden_size] final hidden states, in packed order."""
        lens = seqs.seq_lens
        starts = [0] * len(lens)
        for i in range(1, len(lens)):
            starts[i] = starts[i - 1] + lens[i - 1]
        total = seqs.num_tokens
        chunks = plan_chunks(lens, pad=self.pads, num_heads=self.num_heads,
                             max_slots=max(int(PAD_SLACK * total), max(lens, default=1)),
                             max_scores=MAX_SCORE_ELEMENTS)
        hidden: torch.Tensor | None = None
        for chunk in chunks:
            out, real, index = self._forward_chunk(input_ids, seqs, starts, chunk)
            if hidden is None:
                hidden = out.new_empty((total, out.shape[-1]))
            hidden.index_copy_(0, index[real], out[real])
        if hidden is None:
            raise ValueError("a pooling step needs at least one prompt")
        return hidden

    def _forward_chunk(self, input_ids: torch.Tensor, seqs: PackedSeqs, starts: list[int],
                       chunk: PaddedChunk
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batch: its [B, L, W] states, the [B, L] mask of real tokens and the [B, L]
        packed index of each slot (0 under padding)."""
        dev = input_ids.device
        first = torch.tensor([starts[i] for i in chunk.rows], dtype=torch.long).to(dev)
        lens = torch.tensor([seqs.seq_lens[i] for i in chunk.rows], dtype=torch.long).to(dev)
        cols = torch.arange(chunk.width, device=dev)
        real = cols < lens[:, None]
        index = torch.where(real, first[:, None] + cols, 0)
        kw: dict[str, Any] = {"input_ids": torch.where(real, input_ids[index], self.pad_id)}
        if "attention_mask" in self._takes:  # (all ones in a chunk of one length)
            kw["attention_mask"] = real.long()
        if seqs.token_type_ids is not None and "token_type_ids" in self._takes:
            # (a model without segment embeddings ignores a pair's segment ids, as
            # transformers does)
            kw["token_type_ids"] = torch.where(real, seqs.token_type_ids[index], 0)
        if "lengths" in self._takes:
            kw["lengths"] = lens
        if "use_cache" in self._takes:
            kw["use_cache"] = False
        return self.base(**kw)[0], real, index
