"""Runs the scheduler's KV transfer plan for a step: device <-> CPU-tier block copies.

Built by the engine core (factory.py) over the runner's KV cache and handed to the model
runner, which runs each step's plan before the forward pass. Device KV is one
[planes, slots, Hk, D] tensor per layer (planes: 2 for K and V, 1 for MLA latents; slot =
block * block_size + offset); a CPU-tier slot holds one block of every layer as
[num_layers, planes, block_size * Hk * D].

On the CPU the copies are plain indexed assignments, done when `run` returns. On CUDA they
run on a side stream: stores gather the blocks into a device staging buffer and copy it to
pinned host memory, loads copy pinned host memory into a staging buffer and scatter it into
the blocks. The compute stream waits on the plan's event before the forward pass (a reused
block must be copied out before it is overwritten, a loaded one must have arrived before it
is read), so `run` never makes the host wait. The host learns that a plan is done from
`wait(plan_id)`, which the runner calls once the step's results are in (they come after
the forward pass, so the wait is free by then); until then the scheduler keeps the plan's
host slots pinned."""

from __future__ import annotations

import time
from collections import deque

import torch

from shoal.core.kv_transfer_plan import KVTransferPlan
from shoal.host_to_device import to_device
from shoal.kv_offload.stats import TierStats

# Blocks per staging buffer on CUDA (64 blocks of Llama-3.1-8B at 16 tokens: 128 MiB).
CUDA_CHUNK_BLOCKS = 64


class KVTransfer:
    def __init__(self, kv_caches: list[torch.Tensor], cpu_pool: torch.Tensor, block_size: int,
                 cpu_stats: TierStats | None = None):
        self.block_bytes = cpu_pool[0].numel() * cpu_pool.element_size() if len(cpu_pool) else 0
        # Per layer: [planes, num_blocks + 1, block bytes], a view of the cache tensor. Copies
        # move bytes: an FP8 cache's float8 has no index kernels on some devices.
        self.views = [kv.view(torch.uint8).view(kv.shape[0], kv.shape[1] // block_size, -1)
                      for kv in kv_caches]
        self.pool = cpu_pool.view(torch.uint8)
        self._init_copier(kv_caches[0].device, cpu_stats)

    def _init_copier(self, device: torch.device, stats: TierStats | None) -> None:
        self.stats = stats
        self.device = device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # (plan id, event after its copies) of the plans run on CUDA and not waited for yet,
        # in the order they ran: the side stream runs them in that order.
        self._events: deque[tuple[int, torch.cuda.Event]] = deque()

    def _nbytes(self, blocks: list[int]) -> int:
        """The bytes of these device blocks."""
        return len(blocks) * self.block_bytes

    def wait(self, plan_id: int) -> None:
        """Returns once the copies of this plan (and of every plan run before it) are done:
        the host may then read, evict or reuse its slots. At once on the CPU."""
        while self._events:
            done_id, event = self._events.popleft()
            if done_id == plan_id:
                event.synchronize()
                return

    def wait_all(self) -> None:
        if self._events:
            self.wait(self._events[-1][0])

    @torch.inference_mode()
    def run(self, plan: KVTransferPlan) -> None:
        """Queues the plan's copies ahead of the next forward pass; never waits (on CUDA)."""
        if not plan:
            return
        t0 = time.perf_counter()
        if self.stream is None:
            if plan.stores:
                self._store_cpu(plan.stores)
            if plan.loads:
                self._load_cpu(plan.loads)
        else:
            self._run_cuda(plan)
        dt = time.perf_counter() - t0
        if self.stats is not None:
            # Time is what the step spent issuing (and, on the CPU, doing) the copies; split
            # between stores and loads by bytes.
            ns, nl = len(plan.stores), len(plan.loads)
            self.stats.record_store(ns, self._nbytes([d for d, _ in plan.stores]),
                                    dt * ns / (ns + nl))
            self.stats.record_load(nl, self._nbytes([d for _, d in plan.loads]),
                                   dt * nl / (ns + nl))

    # -- CPU device: the "device" cache is host memory too ------------------------------------
    def _store_cpu(self, stores: list[tuple[int, int]]) -> None:
        dev = torch.tensor([d for d, _ in stores])
        slots = torch.tensor([s for _, s in stores])
        for layer, v in enumerate(self.views):
            self.pool[slots, layer] = v[:, dev].transpose(0, 1)

    def _load_cpu(self, loads: list[tuple[int, int]]) -> None:
        slots = torch.tensor([s for s, _ in loads])
        dev = torch.tensor([d for _, d in loads])
        for layer, v in enumerate(self.views):
            v[:, dev] = self.pool[slots, layer].transpose(0, 1)

    # -- CUDA: side stream, pinned host memory, one event -------------------------------------
    def _run_cuda(self, plan: KVTransferPlan) -> None:
        assert self.stream is not None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            # Blocks to store were last written by the compute stream. Earlier plans ran on
            # this stream, so a load after a store into the same slot sees its bytes.
            self.stream.wait_stream(compute)
            for i in range(0, len(plan.stores), CUDA_CHUNK_BLOCKS):
                self._store_cuda(plan.stores[i:i + CUDA_CHUNK_BLOCKS])
            for i in range(0, len(plan.loads), CUDA_CHUNK_BLOCKS):
                self._load_cuda(plan.loads[i:i + CUDA_CHUNK_BLOCKS])
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)
        self._events.append((plan.plan_id, event))

    def _staging(self, n: int) -> torch.Tensor:
        # Allocated on the side stream, so the caching allocator only reuses it after the
        # copies queued on that stream.
        return torch.empty((n, *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)

    def _store_cuda(self, stores: list[tuple[int, int]]) -> None:
        dev = to_device([d for d, _ in stores], torch.long, self.device)
        staging = self._staging(len(stores))
        for layer, v in enumerate(self.views):
            staging[:, layer] = v[:, dev].transpose(0, 1)
        for i, s, n in _runs([s for _, s in stores]):
            self.pool[s:s + n].copy_(staging[i:i + n], non_blocking=True)

    def _load_cuda(self, loads: list[tuple[int, int]]) -> None:
        dev = to_device([d for _, d in loads], torch.long, self.device)
        staging = self._staging(len(loads))
        for i, s, n in _runs([s for s, _ in loads]):
            staging[i:i + n].copy_(self.pool[s:s + n], non_blocking=True)
        for layer, v in enumerate(self.views):
            v[:, dev] = staging[:, layer].transpose(0, 1)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in the list, first slot, length) of runs of consecutive slots, so contiguous
    host memory moves in one copy."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s and runs[-1][0] + runs[-1][2] == i:
            j, first, n = runs[-1]
            runs[-1] = (j, first, n + 1)
        else:
            runs.append((i, s, 1))
    return runs
