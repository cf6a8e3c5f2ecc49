"""Builds the tiers from the engine configuration and wires them to the model runner."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import xxhash

from shoal.config import EngineConfig
from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.disk_tier import DiskTier
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.kv_offload.policy import make_policy
from shoal.kv_offload.store import TieredKVStore
from shoal.worker.kv_transfer import KVTransfer

logger = logging.getLogger(__name__)


def model_identity(source: str, load_format: str, seed: int) -> str:
    """The model part of the disk key: the source path plus the size and modification time of
    its files, so weights rewritten in place are not mistaken for the old ones. Random
    (dummy) weights depend on the seed."""
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
    return f"{ident}#seed{seed}" if load_format == "dummy" else ident


def block_layout(kv_caches: list[torch.Tensor], block_size: int) -> BlockLayout:
    shapes = {tuple(kv.shape) for kv in kv_caches}
    if len(shapes) != 1:
        raise ValueError(f"KV offloading needs one KV shape for every layer (got {shapes})")
    two, slots, heads, head_dim = next(iter(shapes))
    if two != 2 or slots % block_size:
        raise ValueError(f"unexpected KV cache shape {kv_caches[0].shape} for offloading")
    return BlockLayout(len(kv_caches), (2, block_size, heads, head_dim), kv_caches[0].dtype)


def build_kv_offload(config: EngineConfig, runner: Any, loaded: Any) -> TieredKVStore | None:
    """None when offloading is off. Gives the runner its KVTransfer (runner.kv_transfer)."""
    oc = config.kv_offload_config
    if oc is None:
        return None
    layout = block_layout(runner.kv_caches, config.cache_config.block_size)
    cpu_blocks = oc.cpu_bytes // layout.nbytes
    if cpu_blocks < 1:
        raise ValueError(f"kv_offloading_size ({oc.cpu_bytes / 2**30:.6f} GiB) is smaller than one "
                         f"KV block of this model ({layout.nbytes} bytes)")
    cpu = CPUTier(layout, oc.cpu_bytes, make_policy(oc.policy, cpu_blocks),
                  pin_memory=config.device.type == "cuda")
    disk = None
    if oc.disk_path is not None:
        mc = config.model_config
        key = StoreKey.of(model_identity(loaded.source, loaded.load_format, mc.seed), layout)
        disk_blocks = oc.disk_bytes // layout.nbytes
        disk = DiskTier(os.fspath(oc.disk_path), key, layout, oc.disk_bytes,
                        make_policy(oc.policy, disk_blocks))
    store = TieredKVStore(cpu, disk)
    transfer = KVTransfer(runner.kv_caches, cpu.pool, layout.block_size, cpu.stats)
    runner.kv_transfer = transfer
    store.fence = transfer.synchronize
    logger.info("KV offloading: CPU tier %d blocks (%.2f GiB, %s)%s", cpu.capacity_blocks,
                cpu.capacity_bytes / 2**30, oc.policy,
                f", disk tier {disk.capacity_blocks} blocks in {disk.dir}" if disk else "")
    return store
