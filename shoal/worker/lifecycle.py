"""A rank's side of engines inside training loops (vLLM's RL lifecycle): sleep and wake
(sleep_mode.py), weight updates in place from tensors, a checkpoint folder or a process group
the trainer joins, and named methods run on every rank (collective_rpc). Mixed into
ModelRunner; the engine core makes sure no request is running when these are called."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.loader.weight_offload import host_weights, offloader_of
from shoal.worker.sleep_mode import HostCopies, SleepingWeights, kept_sizes, put_to_sleep, wake

logger = logging.getLogger(__name__)

# Methods collective_rpc may name: the lifecycle's own and a few read-only ones (never an
# arbitrary attribute: the name comes from the user).
RPC_METHODS = frozenset({"sleep", "wake_up", "update_weights_from_path",
                         "update_weights_from_file",
                         "init_weight_update_group", "update_weights_from_group",
                         "close_weight_update_group", "weights_checksum", "rank_info"})


class RunnerLifecycle:
    # (set by ModelRunner)
    model: Any
    device: torch.device
    dtype: torch.dtype
    drafter: Any
    kv_transfer: Any
    config: Any
    lora: Any  # a shoal.lora.slots.LoRASlots, or None

    _asleep: SleepingWeights | None = None
    _host: HostCopies | None = None  # level 1's host buffers, kept from sleep to sleep
    _kv_asleep: int | None = None  # the pool's block count while the KV cache is dropped
    _had_graphs = False
    _update_group: Any = None
    _update_rank = 0

    # ---- sleep ----------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._asleep is not None or self._kv_asleep is not None

    @property
    def host_copies(self) -> HostCopies:
        """Level 1's host buffers (sleep_mode.py): allocated by the first sleep, reused by
        the next ones, released by a level-2 sleep, a weight update that changes a storage's
        size, or shutdown."""
        if self._host is None:
            self._host = HostCopies()
        return self._host

    def _scratch(self) -> list[torch.Tensor]:
        """Storages a sleep frees without keeping their bytes (weight offloading's staging)."""
        offloader = offloader_of(self.model)
        return offloader.scratch_storages() if offloader is not None else []

    def sleep(self, level: int = 1) -> dict[str, float]:
        """Frees the KV cache (its content is lost) and the weights (level 1: kept in host
        memory; level 2: dropped). Returns the bytes freed, the host buffers this sleep had
        to allocate (0 once level 1's are kept) and the seconds taken."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (got {level!r})")
        if self.is_sleeping:
            raise ValueError("the engine is asleep already")
        if self.kv_transfer is not None:
            raise ValueError("sleep does not support KV offloading (kv_offloading_size) yet")
        if self.drafter is not None and self.drafter.kv_layers():
            raise ValueError("sleep does not support a drafter with its own KV cache yet")
        t0 = time.perf_counter()
        self._had_graphs = self.graphs is not None
        self.graphs = None  # they point at the storages about to go
        # (layers' caches may be views of one storage: each storage counted once)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.kv_caches}
        kv_bytes = sum(storages.values())
        self._kv_asleep = self.null_block  # (the pool's size: the null block is past it)
        self.unbind_kv_cache()
        allocated = self.host_copies.allocations
        self._asleep = put_to_sleep([self.model], level, self.host_copies, self._scratch())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return {"kv_cache_bytes": kv_bytes, "weight_bytes": self._asleep.nbytes,
                "host_buffers_allocated": self.host_copies.allocations - allocated,
                "seconds": time.perf_counter() - t0}

    def wake_up(self, tags: list[str] | None = None) -> dict[str, float]:
        """tags: "weights" and/or "kv_cache" (None: both). CUDA graphs are captured again once
        both are back (their addresses moved). On CUDA the weights' copies may still be under
        way on return (the seconds do not count them): the device's stream waits for them
        before the next forward."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' or 'kv_cache' (got "
                             f"{sorted(unknown)})")
        t0 = time.perf_counter()
        if "weights" in tags and self._asleep is not None:
            wake(self._asleep)
            self._asleep = None
        if "kv_cache" in tags and self._kv_asleep is not None:
            self.bind_kv_cache(self._kv_asleep)
            self._kv_asleep = None
        if not self.is_sleeping and self._had_graphs:
            self._had_graphs = False
            self._capture_graphs()
        return {"seconds": time.perf_counter() - t0}

    # ---- weight updates ---------------------------------------------------------------------
    def _check_updatable(self) -> None:
        if self._asleep is not None:
            raise ValueError("the weights are asleep: wake_up(tags=['weights']) before an "
                             "update")
        if any(getattr(m, "int4", None) is not None for m in self.model.modules()):
            raise ValueError("weight updates do not reach the packed int4 copies of "
                             "cpu_int4_matmul: start the engine with cpu_int4_matmul=False")
        if any(getattr(m, "quant", None) is not None for m in self.model.modules()):
            raise ValueError("weight updates do not reach quantized layers' packed weights "
                             "(FP8 / INT4 on CUDA): set SHOAL_QUANT_DEQUANT=1 to load them "
                             "dequantized")

    @torch.inference_mode()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Checkpoint-named tensors (full, unsharded) into the model in place: each rank takes
        its slice, fused projections their part (offloaded layers': into their host copies,
        which the next forward copies in). Returns the number of tensors loaded."""
        self._check_updatable()
        count = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, tensor

        with host_weights(self.model):
            self.model.load_weights(counted())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._host is not None and self._host.buffers:
            self._host.keep_if(kept_sizes([self.model], self._scratch()))
        return count

    def update_weights_from_path(self, path: str) -> int:
        """A checkpoint folder (safetensors, quantized ones dequantized) of this model."""
        from shoal.loader.load import checkpoint_weights

        only = self.config.model_config.language_model_only
        return self.update_weights(checkpoint_weights(path, language_model_only=only)())

    def update_weights_from_file(self, file: str) -> int:
        """One safetensors file of checkpoint-named tensors (the state-dict route over several
        ranks: the driver writes it, every rank reads it)."""
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            return self.update_weights((name, f.get_tensor(name)) for name in f.keys())

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 backend: str | None = None) -> None:
        """Joins the trainer's process group (the trainer is rank 0 and broadcasts): this rank
        is rank_offset + its rank in the engine. NCCL on CUDA, gloo on the CPU."""
        rank = rank_offset + (dist.get_rank() if dist.is_initialized() else 0)
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        store = dist.TCPStore(master_address, int(master_port), int(world_size),
                              is_master=False, timeout=timedelta(seconds=300))
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(store, rank, int(world_size))
        elif backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, int(world_size))
        else:
            raise ValueError(f"backend must be nccl or gloo (got {backend!r})")
        self._update_group, self._update_rank = group, rank
        logger.info("joined the weight-update group as rank %d of %d (%s)", rank, world_size,
                    backend)

    def update_weights_from_group(self, names: list[str], dtypes: list[str],
                                  shapes: list[list[int]]) -> int:
        """Receives each named tensor from the group's rank 0, in order, and loads it."""
        group = self._update_group
        if group is None:
            raise ValueError("no weight-update group: call init_weight_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have one entry per tensor")

        def received() -> Iterable[tuple[str, torch.Tensor]]:
            for name, dtype, shape in zip(names, dtypes, shapes):
                t = torch.empty(tuple(shape), dtype=getattr(torch, dtype.removeprefix("torch.")),
                                device=self.device)
                group.broadcast(t, 0).wait()
                yield name, t

        return self.update_weights(received())

    def close_weight_update_group(self) -> None:
        self._update_group = None

    # ---- read-only helpers (collective_rpc) ---------------------------------------------------
    @torch.inference_mode()
    def weights_checksum(self) -> float:
        """The sum of every parameter of this rank (float64): tells whether an update landed."""
        with host_weights(self.model):
            return float(sum(p.double().sum() for p in self.model.parameters()))

    def rank_info(self) -> dict[str, Any]:
        offloader = offloader_of(self.model)
        stats = offloader.stats if offloader is not None else None
        return {"rank": dist.get_rank() if dist.is_initialized() else 0,
                "device": str(self.device), "sleeping": self.is_sleeping,
                # cpu_offload_gb: this rank's decoder layers in host memory, and their bytes
                "offloaded_layers": list(stats.layers) if stats else [],
                "offloaded_bytes": stats.offloaded_bytes if stats else 0,
                # level-1 sleep's host copies of the weights, kept between sleeps
                "host_copy_bytes": self._host.nbytes if self._host is not None else 0,
                # enable_lora: the adapter ids this rank holds in host memory (its stage's
                # tensors of them under pipeline parallelism)
                "lora_adapters": sorted(self.lora.host) if self.lora is not None else []}

    def shutdown(self) -> None:
        """Releases the host copies of the weights (kept between sleeps, or a sleeping
        engine's), the CUDA graphs and the KV pool, then whatever the runner's other parts
        release. (The layers drop their pool: a caller still holding the model's modules
        would otherwise keep the whole pool on the device, and the next engine's budget
        from gpu_memory_utilization would count it as another's.)"""
        self._asleep = None
        if self._host is not None:
            self._host.release()
        self.graphs = None
        self.unbind_kv_cache()
        super().shutdown()  # type: ignore[misc]

    def rpc(self, method: str, args: list[Any]) -> Any:
        if method not in RPC_METHODS:
            raise ValueError(f"collective_rpc: unknown method {method!r} (one of "
                             f"{', '.join(sorted(RPC_METHODS))})")
        return getattr(self, method)(*args)

