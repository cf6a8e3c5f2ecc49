"""Engine arguments with vLLM's names, turned into an EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from shoal.config import (
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_device,
    resolve_dtype,
)

# On the CPU fewer sequences run at once: each step's cost grows with the batch.
CPU_MAX_NUM_SEQS = 64


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    # Kernel choices (were SHOAL_* environment switches): the attention backend ("torch" or
    # "triton"; None: Triton on CUDA), the Triton norm / SiLU-and-mul / rotary kernels on CUDA
    # (off: the PyTorch path), and q/k-norm + rotary fused into the KV-cache write.
    attention_backend: str | None = None
    use_triton_ops: bool = True
    fuse_rope_kv_write: bool = True
    # Schedule step N+1 while the GPU runs step N. None: on with CUDA, off on the CPU (where
    # the host does the model's work too, so there is nothing to overlap).
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    device: str | None = None
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int | None = None
    # Tiered KV offloading (shoal/kv_offload): sizes in GiB; None = off.
    kv_offloading_size: float | None = None
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    kv_offloading_policy: str = "lru"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def create_engine_config(self, hf_config: Any) -> EngineConfig:
        device = torch.device(self.device) if self.device else default_device()
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size must be 1 for now (got {self.tensor_parallel_size})"
            )
        model_max = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
        max_len = self.max_model_len or model_max
        if max_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (got {max_len})")
        if max_len > model_max:
            raise ValueError(
                f"max_model_len ({max_len}) is larger than the model's max_position_embeddings "
                f"({model_max})"
            )
        max_seqs = self.max_num_seqs or (256 if device.type == "cuda" else CPU_MAX_NUM_SEQS)
        dtype = resolve_dtype(self.dtype, device)
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be auto, gguf, safetensors or dummy (got {self.load_format!r})"
            )
        return EngineConfig(
            model_config=ModelConfig(self.model, self.tokenizer, dtype, max_len, self.load_format,
                                     self.seed, vocab_size=hf_config.vocab_size),
            cache_config=CacheConfig(self.block_size, self.enable_prefix_caching,
                                     self.gpu_memory_utilization, self.kv_cache_memory_bytes,
                                     self.num_gpu_blocks_override),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=max_seqs, max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                max_waiting_requests=self.max_waiting_requests,
            ),
            parallel_config=ParallelConfig(self.tensor_parallel_size),
            device=device,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            use_triton_ops=self.use_triton_ops,
            fuse_rope_kv_write=self.fuse_rope_kv_write,
            kv_offload_config=self._kv_offload_config(),
            async_scheduling=(device.type == "cuda" if self.async_scheduling is None
                              else bool(self.async_scheduling)),
        )

    def _kv_offload_config(self) -> KVOffloadConfig | None:
        if self.kv_offloading_size is None:
            if self.kv_offloading_disk_path is not None or self.kv_offloading_disk_size is not None:
                raise ValueError("the disk KV tier sits below the CPU tier: set "
                                 "kv_offloading_size (GiB) too")
            return None
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching (blocks are found "
                             "by their prefix hash)")
        if self.kv_offloading_disk_size is not None and self.kv_offloading_disk_path is None:
            raise ValueError("kv_offloading_disk_size needs kv_offloading_disk_path")
        return KVOffloadConfig(
            cpu_bytes=int(self.kv_offloading_size * 2**30),
            disk_path=self.kv_offloading_disk_path,
            disk_bytes=int((self.kv_offloading_disk_size or 0) * 2**30),
            policy=self.kv_offloading_policy,
        )
