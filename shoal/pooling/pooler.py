"""Hidden states of a packed pooling step -> one result per request.

embed: the sequence pooled (CLS, MEAN, LAST), truncated to `dimensions`, then normalized;
token_embed: every token's state (ALL pooling), truncated and normalized the same way;
classify / score: the model's classifier over its own pooling (BERT: [CLS] through the
pooler; decoders: the last token), then softmax (sigmoid for one label) unless
use_activation is off. Everything is computed in float32 and copied to the host once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from shoal.pooling_params import PoolingInfo, PoolingParams

if TYPE_CHECKING:
    from shoal.models.interface import PoolingModel


@dataclass
class PoolingRow:
    serial: int
    start: int  # first token in the packed step
    length: int
    params: PoolingParams


def pool(hidden: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
         pooling_type: str) -> torch.Tensor:
    """[T, H] packed states -> [N, H] (float32) for the N sequences at starts/lens."""
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[starts + lens - 1].float()
    if pooling_type == "MEAN":
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seg, hidden.float())
        return sums / lens[:, None].float()
    raise ValueError(f"pooling type {pooling_type!r} has no per-sequence result")


def pooled_results(model: PoolingModel, hidden: torch.Tensor, rows: list[PoolingRow],
                   info: PoolingInfo) -> dict[int, np.ndarray]:
    """One float32 array per request serial: [D] embeddings, [L, D] token embeddings,
    [num_labels] probabilities (or logits), [1] scores."""
    dev = hidden.device
    out: list[torch.Tensor | None] = [None] * len(rows)
    per_token = ("token_embed", "token_classify") + (("embed",) if info.pooling_type == "ALL"
                                                    else ())
    seq = [i for i, r in enumerate(rows) if r.params.task not in per_token]
    if seq:
        starts = torch.tensor([rows[i].start for i in seq], device=dev)
        lens = torch.tensor([rows[i].length for i in seq], device=dev)
        embeds = [i for i in seq if rows[i].params.task == "embed"]
        heads = [i for i in seq if rows[i].params.task in ("classify", "score")]
        if embeds:
            sel = torch.tensor([seq.index(i) for i in embeds], device=dev)
            vecs = pool(hidden, starts[sel], lens[sel], info.pooling_type)
            for j, i in enumerate(embeds):
                out[i] = _finish_embedding(vecs[j], rows[i].params, info)
        if heads:
            sel = torch.tensor([seq.index(i) for i in heads], device=dev)
            states = pool(hidden, starts[sel], lens[sel], model.classifier_pooling_type)
            logits = model.classify(states.to(hidden.dtype)).float()
            for j, i in enumerate(heads):
                out[i] = _activate(logits[j], rows[i].params)
    for i, r in enumerate(rows):
        if r.params.task in per_token:
            states = hidden[r.start:r.start + r.length]
            if model.has_token_heads:  # the model's own per-token heads (BGE-M3)
                out[i] = model.token_output(r.params.task, states)
            else:
                out[i] = _finish_embedding(states.float(), r.params, info)
    return _to_host(rows, out)


def _finish_embedding(x: torch.Tensor, p: PoolingParams, info: PoolingInfo) -> torch.Tensor:
    if p.dimensions is not None:
        x = x[..., :p.dimensions]
    normalize = info.normalize if p.normalize is None else p.normalize
    return F.normalize(x, p=2, dim=-1) if normalize else x


def _activate(logits: torch.Tensor, p: PoolingParams) -> torch.Tensor:
    if p.use_activation is False:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def _to_host(rows: list[PoolingRow], out: list[torch.Tensor | None]) -> dict[int, np.ndarray]:
    tensors = [t for t in out if t is not None]
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu().numpy()
    results, pos = {}, 0
    for r, t in zip(rows, tensors):
        n = t.numel()
        results[r.serial] = flat[pos:pos + n].reshape(tuple(t.shape))
        pos += n
    return results
