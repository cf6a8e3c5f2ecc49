"""Builds the tiers and the device <-> CPU copier from the engine configuration.

The engine core calls `build_kv_offload` once the KV cache exists, keeps the store for the
scheduler and hands the transfer to the model runner: nothing here reaches into either."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash

from shoal.config import EngineConfig
from shoal.core.kv_cache_spec import KVCacheGroup
from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.grouped_cpu_tier import GroupedCPUTier
from shoal.kv_offload.grouped_transfer import GroupedKVTransfer, page_bytes, page_groups
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.kv_offload.lower_tiers import LOWER_TIERS
from shoal.kv_offload.policy import make_policy
from shoal.kv_offload.store import TieredKVStore
from shoal.kv_offload.tier import KVTier, LowerTier, TierContext
from shoal.kv_offload.transfer import KVTransfer

if TYPE_CHECKING:
    from shoal.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass
class KVOffload:
    store: TieredKVStore  # the tiers, for the scheduler
    transfer: KVTransfer  # the per-step device <-> CPU-tier copies, for the model runner


def model_identity(source: str, load_format: str, seed: int,
                   quantization: str | None = None) -> str:
    """The model part of the store key: the source path plus the size and modification time
    of its files, so weights rewritten in place are not mistaken for the old ones. Random
    (dummy) weights depend on the seed; a quantization asked for (online FP8 rounds a dense
    checkpoint's weights) changes them too."""
    path = Path(source)
    files = [path] if path.is_file() else sorted(
        p for p in path.glob("*") if p.suffix in (".safetensors", ".gguf", ".json"))
    h = xxhash.xxh3_64()
    for p in files:
        try:
            st = p.stat()
        except OSError:
            continue
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    ident = f"{path.resolve()}#{load_format}#{h.hexdigest()}"
    if quantization is not None:
        ident += f"#{quantization}"
    return f"{ident}#seed{seed}" if load_format == "dummy" else ident


def block_layout(kv_caches: list[torch.Tensor], groups: Sequence[KVCacheGroup],
                 block_size: int) -> BlockLayout:
    """A CPU-tier block: one block of every cache tensor, as the layers' cache spec lays it
    out. A hybrid's groups (full attention beside sliding windows or linear states) share
    the tensors (a block id holds one group's pages, kv_cache_tensors.py), so a block copies
    the same way whichever group it belongs to. Where pages differ in shape (a partitioned
    pool's groups, DeepSeek-V4; one group of layers with rows of two widths, DeepSeek-V3.2's
    latents and indexer keys) a block is its copy group's pages as bytes
    (BlockLayout.grouped, grouped_transfer.py)."""
    pages = page_groups(kv_caches, groups, block_size)
    if pages is not None:
        return BlockLayout.grouped(
            tuple(sum(page_bytes(kv, block_size) for kv in pg.tensors) for pg in pages),
            block_size, kv_caches[0].dtype)
    spec = groups[0].spec
    row = (spec.planes, spec.num_kv_heads, spec.head_size)
    for kv in kv_caches:  # [planes, slots, heads, head size] each, as the spec says
        if (kv.shape[0], *kv.shape[2:]) != row or kv.shape[1] % block_size:
            raise ValueError(f"KV offloading needs one KV shape for every layer: a tensor "
                             f"of {tuple(kv.shape)} beside {spec}")
    return BlockLayout(len(kv_caches), (spec.planes, block_size, spec.num_kv_heads,
                                        spec.head_size), kv_caches[0].dtype)


def build_lower_tiers(ctx: TierContext) -> list[LowerTier]:
    """Every tier of lower_tiers.py that its settings turn on, fastest first."""
    tiers = []
    for name, path in LOWER_TIERS.items():
        module_name, _, func = path.partition(":")
        tier = getattr(importlib.import_module(module_name), func)(ctx)
        if tier is None:
            continue
        if tier.name != name:
            raise ValueError(f"KV tier builder {path} made a tier named {tier.name!r}, "
                             f"listed as {name!r}")
        tiers.append(tier)
    return tiers


def build_kv_offload(config: EngineConfig, kv_caches: list[torch.Tensor], loaded: LoadedModel,
                     groups: Sequence[KVCacheGroup]) -> KVOffload | None:
    """None when offloading is off."""
    oc = config.kv_offload_config
    if oc is None:
        return None
    layout = block_layout(kv_caches, groups, config.cache_config.block_size)
    pin = config.device.type == "cuda"
    cpu: CPUTier
    transfer: KVTransfer
    if layout.group_bytes:  # slots of each group's size, the bytes split as the device's
        shares = [(g.num_blocks or 1) * b for g, b in zip(groups, layout.group_bytes)]
        cpu = GroupedCPUTier(layout, oc.cpu_bytes, oc.policy, shares, pin_memory=pin)
        pages = page_groups(kv_caches, groups, layout.block_size)
        assert pages is not None
        transfer = GroupedKVTransfer(pages, cpu, layout.block_size, cpu.stats)
    else:
        cpu_blocks = oc.cpu_bytes // layout.nbytes
        if cpu_blocks < 1:
            raise ValueError(f"kv_offloading_size ({oc.cpu_bytes / 2**30:.6f} GiB) is smaller "
                             f"than one KV block of this model ({layout.nbytes} bytes)")
        cpu = CPUTier(layout, oc.cpu_bytes, make_policy(oc.policy, cpu_blocks), pin_memory=pin)
        transfer = KVTransfer(kv_caches, cpu.pool, layout.block_size, cpu.stats)
    key = StoreKey.of(model_identity(loaded.source, loaded.load_format,
                                     config.model_config.seed,
                                     config.model_config.quantization), layout)
    tiers: list[KVTier] = [cpu, *build_lower_tiers(TierContext(oc, layout, key))]
    store = TieredKVStore(tiers)
    logger.info("KV offloading (%s): %s", oc.policy, ", ".join(
        f"{t.name} tier {t.capacity_blocks} blocks ({t.capacity_bytes / 2**30:.2f} GiB)"
        for t in tiers))
    return KVOffload(store, transfer)
