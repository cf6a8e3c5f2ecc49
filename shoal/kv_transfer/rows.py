"""The worker side of KV transfer: a request's token rows of every paged layer read out of the
paged cache (gather) and written into another engine's (scatter), whatever the two engines'
block sizes, each tensor-parallel rank taking its share of the KV heads.

A layer's cache is [planes, slots, Hk, D] (slot = block * block_size + offset; planes: K and
V, or MLA's one latent row). The payload (msgpack) holds per layer the rows [planes, N, H, D]
of tokens [0, N) with all H KV heads (the producer runs one rank), in the cache dtype."""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from shoal.distributed.parallel_state import get_tp_rank, get_tp_world_size


def _slots(block_ids: list[int], block_size: int, start: int, end: int,
           device: torch.device) -> torch.Tensor:
    pos = torch.arange(start, end)
    table = torch.tensor(block_ids, dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)


def gather_rows(caches: list[torch.Tensor], block_ids: list[int], block_size: int,
                num_tokens: int) -> bytes:
    """Tokens [0, num_tokens) of every layer, as a payload (read back to the host)."""
    slots = _slots(block_ids, block_size, 0, num_tokens, caches[0].device)
    layers = []
    for kv in caches:  # as bytes: float8 has no index kernels on some devices
        rows = kv.view(torch.uint8).index_select(1, slots).contiguous().cpu()
        layers.append({"shape": list(rows.shape), "data": rows.numpy().tobytes()})
    dtype = str(caches[0].dtype).removeprefix("torch.")
    return msgspec.msgpack.encode({"dtype": dtype, "num_tokens": num_tokens, "layers": layers})


def _head_slice(total: int, local: int, rank: int, world: int) -> slice:
    """The KV heads this rank holds of `total` (split, or one replicated head per rank)."""
    if local * world == total:
        return slice(rank * local, (rank + 1) * local)
    if local == 1 and total < world:
        h = rank * total // world
        return slice(h, h + 1)
    if local == total:
        return slice(0, total)
    raise ValueError(f"cannot place {total} transferred KV heads on a rank holding {local}")


def scatter_rows(caches: list[torch.Tensor], payload: bytes, block_ids: list[int],
                 block_size: int, start: int, num_tokens: int) -> None:
    """Writes rows [start, start + num_tokens) of a payload into the request's blocks."""
    msg: dict[str, Any] = msgspec.msgpack.decode(payload)
    layers = msg["layers"]
    if len(layers) != len(caches):
        raise ValueError(f"the transferred KV has {len(layers)} layers, this model "
                         f"{len(caches)}")
    if msg["dtype"] != str(caches[0].dtype).removeprefix("torch."):
        raise ValueError(f"the transferred KV is {msg['dtype']}, this cache "
                         f"{caches[0].dtype}")
    slots = _slots(block_ids, block_size, start, start + num_tokens, caches[0].device)
    rank, world = get_tp_rank(), get_tp_world_size()
    for kv, layer in zip(caches, layers):
        planes, n, total, width = layer["shape"]  # width: bytes of a head's row
        raw = torch.frombuffer(bytearray(layer["data"]), dtype=torch.uint8)
        rows = raw.view(planes, n, total, width)[:, start:start + num_tokens]
        heads = _head_slice(total, kv.shape[2], rank, world)
        kv.view(torch.uint8).index_copy_(1, slots, rows[:, :, heads].to(kv.device))
