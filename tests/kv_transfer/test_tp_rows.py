"""A tensor-parallel producer's rows gathered on rank 0 (kv_transfer/tp_rows.py): split KV
heads in head order, replicated ones (fewer KV heads than ranks) once each, a latent row from
rank 0 alone, linear states one a rank; and which layers replicate, from the model's KV
heads. (The gather itself runs over gloo in test_p2p_engines' two-rank engines.)"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from shoal.core.kv_cache_spec import FullAttentionSpec, LatentAttentionSpec, LinearStateSpec
from shoal.kv_transfer import tp_rows
from shoal.kv_transfer.tp_rows import gather_to_first, kv_head_replicas, model_kv_heads

WORLD = 4


def _rank_rows(rank: int, heads: int, seed: int) -> torch.Tensor:
    """[planes, tokens, heads, width] uint8: what rank `rank` reads of a layer."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randint(0, 256, (2, 3, heads, 8), generator=gen, dtype=torch.uint8)


def test_rank_zero_keeps_every_head_once(monkeypatch) -> None:
    # layer 0: 8 heads split 2 a rank; layer 1: 2 heads over 4 ranks (each pair of ranks
    # holds one); layer 2: a latent row every rank holds; layer 3: a state a rank
    replicas = (1, 2, WORLD, 1)
    ranks = [[_rank_rows(r, 2, 0), _rank_rows(r // 2, 1, 1), _rank_rows(0, 1, 2),
              _rank_rows(r, 1, 3)[:1, :1]] for r in range(WORLD)]
    flat = [torch.cat([t.reshape(-1) for t in rows]) for rows in ranks]
    monkeypatch.setattr(tp_rows, "tp_gather_to_first", lambda x: flat)
    got = gather_to_first(ranks[0], replicas)
    assert [list(t.shape) for t in got] == [[2, 3, 8, 8], [2, 3, 2, 8], [2, 3, 1, 8],
                                            [1, 1, 4, 8]]
    assert torch.equal(got[0], torch.cat([ranks[r][0] for r in range(WORLD)], dim=2))
    assert torch.equal(got[1], torch.cat([ranks[0][1], ranks[2][1]], dim=2))
    assert torch.equal(got[2], ranks[0][2])
    assert torch.equal(got[3], torch.cat([ranks[r][3] for r in range(WORLD)], dim=2))
    monkeypatch.setattr(tp_rows, "tp_gather_to_first", lambda x: None)
    assert gather_to_first(ranks[1], replicas) is None  # not rank 0


def test_which_layers_replicate_their_heads() -> None:
    specs = [FullAttentionSpec(1, 16, 2), LatentAttentionSpec(1, 576, 2),
             LinearStateSpec(1, 16, 2, conv_dim=8, conv_width=3, state_heads=1, key_dim=4,
                             value_dim=4), FullAttentionSpec(2, 16, 2)]
    assert kv_head_replicas(specs, 2, 4) == (2, 4, 1, 1)
    assert kv_head_replicas(specs, 4, 4) == (1, 4, 1, 1)  # one head a rank: split
    assert kv_head_replicas(specs, 2, 1) == (1, 1, 1, 1)
    assert model_kv_heads(LlamaConfig(num_attention_heads=8, num_key_value_heads=2)) == 2
    assert model_kv_heads(None) is None
