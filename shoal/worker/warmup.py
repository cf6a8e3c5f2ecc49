"""Start-up passes on the device: the profile run that sizes the KV pool and the warmup that
compiles every kernel variant before the engine reports ready, so no request waits on a JIT
compile (vLLM v0.27's kernel warmup)."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch
from torch import nn

from shoal.attention.backend import AttentionBackend
from shoal.config import EngineConfig
from shoal.core.kv_cache_spec import KVCacheGroup, LatentAttentionSpec, pool_partitions
from shoal.distributed.parallel_state import pp_is_first
from shoal.layers.paged_rows import PagedRows
from shoal.worker.step_forward import StepForwarder

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What these passes use of shoal.worker.model_runner.ModelRunner (named here rather
    than imported: the runner imports this module)."""

    config: EngineConfig
    model: nn.Module
    backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    block_size: int
    null_block: int
    vocab_size: int
    kv_groups: tuple[KVCacheGroup, ...]
    forwarder: StepForwarder

    def bind_kv_cache(self, num_blocks: int) -> None: ...

    def unbind_kv_cache(self) -> None: ...


def dummy_forward(runner: Runner, query_lens: list[int], num_decodes: int,
                  sample: bool = True, first_block: int = 0) -> None:
    """A forward over made-up requests whose blocks are taken from first_block on in the bound
    cache (never the null block), the same ids in every group's tables. Writes garbage into
    those blocks: only call it before any request has run."""
    bs = runner.block_size
    tables, next_block = [], first_block
    context = [0] * len(query_lens)
    for q in query_lens:
        n = -(-q // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    md = runner.forwarder.metadata(query_lens, context, [tables] * len(runner.kv_groups),
                                   num_decodes)
    total = sum(query_lens)
    ids = torch.randint(0, runner.vocab_size, (total,), device=runner.device)
    pos = torch.cat([torch.arange(q, device=runner.device) for q in query_lens])
    hidden = runner.model(ids, pos, md)
    if isinstance(hidden, tuple):  # a pipeline stage before the last: (hidden, residual)
        hidden = hidden[0]
    if sample and pp_is_first():  # only stage 0 holds lm_head (later stages have none)
        last = torch.tensor([sum(query_lens[: i + 1]) - 1 for i in range(len(query_lens))],
                            device=runner.device)
        runner.model.compute_logits(hidden[last]).argmax(-1)


def profile_split(max_tokens: int, max_model_len: int, max_seqs: int) -> list[int]:
    """Requests that fill one step's token budget, as the scheduler could."""
    per = min(max_tokens, max_model_len - 1)
    lens = [per] * (max_tokens // per)
    if max_tokens % per:
        lens.append(max_tokens % per)
    return lens[:max_seqs]


@torch.inference_mode()
def profile_activation_bytes(runner: Runner) -> int:
    """Peak device memory of the largest step beyond what is held before it (weights)."""
    sc = runner.config.scheduler_config
    lens = profile_split(sc.max_num_batched_tokens, sc.max_model_len, sc.max_num_seqs)
    blocks = sum(-(-q // runner.block_size) for q in lens) + 1
    runner.bind_kv_cache(blocks)
    _create_blas_workspace(runner.device, runner.dtype)
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    t0 = time.perf_counter()
    dummy_forward(runner, lens, num_decodes=0)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    runner.unbind_kv_cache()
    torch.cuda.empty_cache()
    logger.info("profile run: %d tokens in %d requests, peak activations %.2f GiB (%.1f s)",
                sum(lens), len(lens), peak / 2**30, time.perf_counter() - t0)
    return peak


def _create_blas_workspace(device: torch.device, dtype: torch.dtype) -> None:
    """cuBLAS allocates its workspace (32 MiB a stream on Hopper, held by torch for the
    process) at its first call on a stream. Made before the profile's baseline, it is counted
    once, as memory in use, and not a second time as activations."""
    a = torch.zeros(16, 16, device=device, dtype=dtype)
    torch.matmul(a, a)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Every power of two up to the budget: cuBLAS picks (and lazily loads) a different kernel
    for each range of rows, and a first use costs milliseconds."""
    out, n = [], 1
    while n < max_tokens:
        out.append(n)
        n *= 2
    out.append(max_tokens)
    return out


def group_softcaps(layers: list[nn.Module], group: KVCacheGroup) -> set[float | None]:
    """The attention soft-caps of a cache group's layers (None: uncapped): the capped kernel
    variants are compiled only for a model that runs them."""
    return {getattr(layers[i], "softcap", None) for i in group.layers}


def dummy_blocks(runner: Runner) -> tuple[int, int]:
    """(first block, count): the ids a dummy step may take in every group's tables. A shared
    pool: [0, null_block). A partitioned one (DeepSeek-V4, worker/kv_pool_split.py): the
    tables hold each group's pages, 0 its null page and its blocks from 1, as many as the
    smallest partition has."""
    if pool_partitions(runner.kv_groups):
        return 1, min(g.num_blocks for g in runner.kv_groups)
    return 0, runner.null_block


@torch.inference_mode()
def warmup(runner: Runner) -> float:
    """Runs each kind of step once per size bucket so Triton kernels are compiled (and the
    caching allocator warmed) before the first request."""
    t0 = time.perf_counter()
    sc = runner.config.scheduler_config
    first_block, free_blocks = dummy_blocks(runner)

    def fits(lens: list[int]) -> bool:
        return sum(-(-q // runner.block_size) for q in lens) <= free_blocks

    # Up to the whole token budget: the first full-budget step of real traffic must not be
    # the one that grows the caching allocator or loads cuBLAS's large-M kernels.
    steps = [(profile_split(n, sc.max_model_len, sc.max_num_seqs), 0)
             for n in prefill_buckets(sc.max_num_batched_tokens)]
    steps += [([1] * b, b) for b in sorted({1, min(8, sc.max_num_seqs), sc.max_num_seqs})]
    steps += [([n], 0) for n in (3, 6, 12)]  # short chunks take the small prefill tiles
    steps.append(([1, 1, 17], 2))  # a mixed step: decodes and a prefill chunk
    for lens, num_decodes in steps:
        if fits(lens):
            dummy_forward(runner, lens, num_decodes, first_block=first_block)
    # Long contexts pick attention variants (decode splits, prefill tiles) that the short
    # dummy steps above never reach: once per KV cache group (each its own window).
    layers = runner.model.attention_layers()
    variants = 0
    for group in runner.kv_groups:
        layer = layers[group.layers[0]]
        if group.holds_state or isinstance(layer, PagedRows):
            continue  # (paged rows are read by the model's own torch code: no backend kernel)
        if isinstance(group.spec, LatentAttentionSpec):
            variants += runner.backend.warm_mla_kernels(
                layer.kv_cache, layer.num_heads, layer.scale, runner.block_size, layer.v_dim,
                q_dtype=runner.dtype)
        else:
            variants += runner.backend.warm_kernels(
                layer.kv_cache, layer.num_heads, layer.scale, runner.block_size,
                group.sliding_window, q_dtype=runner.dtype,
                softcaps=group_softcaps(layers, group))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    took = time.perf_counter() - t0
    logger.info("warmup done in %.1f s (%d attention kernel variants)", took, variants)
    return took
