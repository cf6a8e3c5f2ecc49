"""Engine configuration: one frozen dataclass per concern, invariants checked on creation.

Nothing changes a config once it is built; what start-up decides (the KV pool's size) is
handed on explicitly (EngineCore -> Scheduler, EngineLimits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.config.lora import LoRAConfig
from shoal.config.speculative import SpeculativeConfig

if TYPE_CHECKING:  # torch is imported where a dtype or device is made, not here: the
    import torch  # scheduler reads these configs and must not load torch

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' means bfloat16 on a GPU; on the CPU, bfloat16 where it multiplies bfloat16
    natively, else float32 (config/cpu_dtype.py)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from shoal.config.cpu_dtype import auto_cpu_dtype

        return getattr(torch, auto_cpu_dtype())
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (got {dtype!r})")
    return getattr(torch, _DTYPES[dtype])


# The KV cache's storage (vLLM's kv_cache_dtype): "auto" is the model dtype; "fp8" and its
# alias "fp8_e4m3" are float8_e4m3fn with a scale per layer for K and one for V
# (shoal/attention/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(got {name!r})")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV cache tensors are allocated in."""
    import torch

    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def default_device() -> torch.device:
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None
    tokenizer: str | None
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    vocab_size: int = 0  # filled from the HF config
    runner: str = "generate"  # "generate" or "pooling" (embeddings, classification, scores)
    pooler_config: dict = field(default_factory=dict)  # pooling_type / normalize overrides
    quantization: str | None = None  # the user's; None: the checkpoint's (shoal/quantization)
    # "auto" | "shoal" | "transformers": shoal's class or the Transformers backend
    # (shoal/models/registry.py resolves it per model, so a draft model picks its own)
    model_impl: str = "auto"
    # every modality's limit_mm_per_prompt 0: a multimodal checkpoint whose text model runs
    # alone loads as that (shoal/loader/text_only.py)
    language_model_only: bool = False
    # --hf-overrides' config fields, which worker ranks set on the config they load
    hf_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling' (got {self.runner!r})")
        if self.model_impl not in ("auto", "shoal", "transformers"):
            raise ValueError(f"model_impl must be auto, shoal or transformers (got "
                             f"{self.model_impl!r})")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # cpu_offload_gb in bytes: this rank's decoder-layer weights kept in host memory (as in
    # vLLM's CacheConfig, the device memory it frees goes to the pool; loader/weight_offload.py)
    cpu_offload_bytes: int = 0

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.cpu_offload_bytes < 0:
            raise ValueError(f"cpu_offload_bytes must be >= 0 (got {self.cpu_offload_bytes})")
        # (a multiple of 64: a hybrid model's pages, sized to hold a linear layer's state)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128) and self.block_size % 64:
            raise ValueError(f"block_size must be a power of two in [1, 128] (got {self.block_size})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0 (got {self.kv_cache_memory_bytes})")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2 (got {self.num_gpu_blocks_override})"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    max_waiting_requests: int | None = None
    # LoRA: distinct adapters the running requests may use at once (0: LoRA off)
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1 (got {self.max_num_batched_tokens})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off "
                f"(got {self.max_num_batched_tokens} < {self.max_model_len})"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority' (got {self.policy!r})")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")
RAY_INSTALL_HINT = "pip install 'ray==2.60.0' (shoal's 'ray' extra)"


def ray_installed() -> bool:
    """Whether Ray can be imported, without importing it (shoal never imports ray unless the
    ray executor is chosen)."""
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def require_ray() -> None:
    if not ray_installed():
        raise ValueError("distributed_executor_backend 'ray' needs Ray, which is not "
                         f"installed: {RAY_INSTALL_HINT}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # uni: the model runner in the engine core's process; mp: one process per rank on this
    # host (shoal/executor/multiproc.py); ray: Ray actors, on this host or several
    # (shoal/executor/ray_executor.py). Default (EngineArgs): uni for one rank, mp for
    # several, ray when they do not fit this host's GPUs and Ray is installed.
    distributed_executor_backend: str = "uni"
    # Stages the decoder layers are split over (world = tp * pp; mp or ray backend).
    pipeline_parallel_size: int = 1
    # MoE layers hold whole experts, E / tp per rank, instead of a slice of every expert
    # (shoal/layers/moe/layer.py); a no-op for dense models and at one rank.
    enable_expert_parallel: bool = False
    # Data parallelism. Only DP+EP (with enable_expert_parallel) reaches the engine core: its
    # replicas join one process group (world = data_parallel_size, rendezvous on this port of
    # 127.0.0.1) and step in lockstep (shoal/engine/dp_lockstep.py). Plain data parallelism
    # never needs it: its replicas share nothing (shoal/engine/dp_client.py).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_master_port: int | None = None

    @property
    def dp_expert_parallel(self) -> bool:
        """Experts split over the data-parallel replicas (DP+EP)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1 (got {self.tensor_parallel_size})"
            )
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1 (got {self.pipeline_parallel_size})"
            )
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)} (got {backend!r})")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank; "
                             f"tensor_parallel_size {self.tensor_parallel_size} needs 'mp'"
                             " or 'ray'")
        if self.pipeline_parallel_size > 1 and backend == "uni":
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size} needs "
                             f"distributed_executor_backend 'mp' or 'ray' (got {backend!r})")
        if backend == "ray":
            require_ray()


@dataclass(frozen=True)
class KVOffloadConfig:
    """Secondary KV tiers (shoal/kv_offload): a CPU tier of cpu_bytes, then optionally a disk
    tier of disk_bytes under disk_path; eviction policy "lru", "arc" or "pkg.module:Class"
    (EngineArgs checks the name: the policies live above the configs, in shoal/kv_offload)."""

    cpu_bytes: int
    disk_path: str | None = None
    disk_bytes: int = 0
    policy: str = "lru"

    def __post_init__(self) -> None:
        if self.cpu_bytes <= 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB (got {self.cpu_bytes} bytes)")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError("kv_offloading_disk_path needs kv_offloading_disk_size > 0 (GiB)")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: torch.device = field(default_factory=default_device)
    enforce_eager: bool = False
    kv_offload_config: KVOffloadConfig | None = None  # None: no secondary KV tiers
    async_scheduling: bool = False  # overlap scheduling of step N+1 with the GPU's step N
    attention_backend: str | None = None  # "torch" | "triton"; None: Triton on CUDA
    use_triton_ops: bool = True  # Triton norm / SiLU-and-mul / rotary kernels on CUDA
    fuse_rope_kv_write: bool = True  # q/k norm + rotary inside the KV-cache write kernel
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    # 4-bit GGUF weights through torch's int4 CPU kernel: "off", "small_steps" (packed for
    # steps of a few tokens, dense beside them for the rest) or "all" (dense weights freed)
    cpu_int4_matmul: str = "off"
    structured_outputs_backend: str = "auto"  # auto | xgrammar | guidance
    lora_config: LoRAConfig | None = None  # None: LoRA off (enable_lora)
