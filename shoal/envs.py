"""shoal's environment variables, each once: its name, type, default and what it does (vLLM
keeps its VLLM_* variables the same way, in vllm/envs.py).

A variable is read and parsed each time its `get()` is called, never at import, so a test's
monkeypatch.setenv (or a Ray actor's copy of the driver's environment) takes effect. No other
module of shoal/ reads a SHOAL_ variable (tests/test_envs.py checks). These are switches for
tracing, A/B runs and where files go; what changes what the engine computes is an engine
argument (EngineArgs) instead. The exception follows vLLM: the pipeline layer partition is a
variable there too (VLLM_PP_LAYER_PARTITION).

Torch-free: the server's frontend and `python -m shoal.cpu_kernels` import it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T  # when the variable is unset
    parse: Callable[[str], T]  # the variable's text -> its value (ValueError if invalid)
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r} is invalid: {e}") from None

    def is_set(self) -> bool:
        return self.name in os.environ


def _switch(raw: str) -> bool:
    """On unless "0": the off switches of the C++ CPU kernels and the like, for A/B runs."""
    return raw.strip() != "0"


def _on(raw: str) -> bool:
    """Off unless "1" or "true" (vLLM's opt-in switches)."""
    return raw.strip().lower() in ("1", "true")


def _optional_text(raw: str) -> str | None:
    return raw.strip() or None


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("it must be a number of seconds > 0")
    return value


SHOAL_STEP_TRACE: EnvVar[str | None] = EnvVar(
    "SHOAL_STEP_TRACE", None, _optional_text,
    "a file the engine core process appends one JSON line per busy loop iteration to (its "
    "timings, requests added, tokens scheduled; shoal/engine/step_trace.py); unset: off")

SHOAL_DP_SYNC_TIMEOUT_S: EnvVar[float] = EnvVar(
    "SHOAL_DP_SYNC_TIMEOUT_S", 30.0, _positive_float,
    "DP+EP: seconds a replica waits for the others at the start of a step before it gives "
    "them up as lost (shoal/engine/dp_lockstep.py)")

SHOAL_EXTENSIONS_DIR: EnvVar[str | None] = EnvVar(
    "SHOAL_EXTENSIONS_DIR", None, _optional_text,
    "the folder the C++ CPU kernels are built into and loaded from (shoal/cpu_kernels.py); "
    "unset: shoal/csrc/build beside the sources")

SHOAL_CPU_DECODE_KERNEL: EnvVar[bool] = EnvVar(
    "SHOAL_CPU_DECODE_KERNEL", True, _switch,
    "0: the CPU paged decode attention runs its torch path instead of the C++ kernel "
    "(shoal/attention/ops/cpu_paged_decode.py)")

SHOAL_CPU_LAYER_KERNELS: EnvVar[bool] = EnvVar(
    "SHOAL_CPU_LAYER_KERNELS", True, _switch,
    "0: the decoder layer's small ops on the CPU (norms, SiLU-and-mul, rotary, KV-cache write, "
    "small linear layers, linear attention's decode step) run their torch paths instead of "
    "the C++ kernels "
    "(shoal/cpu_kernels.py)")

SHOAL_CPU_ADAPTIVE_THREADS: EnvVar[bool] = EnvVar(
    "SHOAL_CPU_ADAPTIVE_THREADS", True, _switch,
    "0: the CPU engine keeps its model threads even when other processes take CPU from it "
    "(A/B runs; shoal/engine/cpu_governor.py)")


def _cpu_dtype(raw: str) -> str | None:
    value = raw.strip().lower() or None
    if value not in (None, "float32", "bfloat16"):
        raise ValueError("it must be float32 or bfloat16")
    return value


SHOAL_CPU_AUTO_DTYPE: EnvVar[str | None] = EnvVar(
    "SHOAL_CPU_AUTO_DTYPE", None, _cpu_dtype,
    "float32 or bfloat16: what dtype=auto means on the CPU; unset: bfloat16 where the CPU has "
    "native bfloat16 matmul, else float32 (shoal/config/cpu_dtype.py). The test suite pins "
    "float32 so its results do not depend on the CI host")

def _count(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("it must be an integer >= 1")
    return value


def _optional_count(raw: str) -> int | None:
    return _count(raw) if raw.strip() else None


SHOAL_MEDIA_THREADS: EnvVar[int | None] = EnvVar(
    "SHOAL_MEDIA_THREADS", None, _optional_count,
    "threads the server's frontend fetches, decodes and preprocesses images and videos on "
    "(off its event loop); the engine argument media_io_threads wins; unset: 4, at most the "
    "usable cores (shoal/engine/mm_frontend.py)")

SHOAL_QUANT_DEQUANT: EnvVar[bool] = EnvVar(
    "SHOAL_QUANT_DEQUANT", False, _on,
    "1: quantized checkpoints are dequantized at load on CUDA too (the path before the FP8 "
    "and W4A16 kernels), for A/B runs (shoal/quantization/fast_path.py)")

SHOAL_W4A16_DENSE_ABOVE_M: EnvVar[int | None] = EnvVar(
    "SHOAL_W4A16_DENSE_ABOVE_M", None, _optional_count,
    "INT4 weight-only layers: steps of more than this many tokens dequantize the weight and "
    "run a dense matmul instead of the W4A16 kernel; unset: always the kernel "
    "(shoal/layers/quantization/methods.py)")

SHOAL_QUANT_TUNING: EnvVar[bool] = EnvVar(
    "SHOAL_QUANT_TUNING", True, _switch,
    "0: quantized layers take their heuristic launch shape for a few decode rows instead of "
    "timing the candidates once per shape on the GPU (shoal/layers/quantization/"
    "launch_tuner.py)")

SHOAL_QUANT_TUNING_COLD: EnvVar[bool] = EnvVar(
    "SHOAL_QUANT_TUNING_COLD", False, _switch,
    "1: the launch tuner times each candidate with the weights out of L2 (a read of twice the "
    "L2 before each call, its own time subtracted), as a decode step meets each layer's "
    "weights, instead of the same weights warm in L2 call after call (launch_tuner.py; "
    "2026-12-07, H100, W2 batch 1: INT4 350.3 -> 349.4, FP8 297.6 -> 299.7 tok/s, and warm "
    "timing picks the tiles that are best cold: off)")

SHOAL_LINEAR_DECODE_FUSED: EnvVar[bool] = EnvVar(
    "SHOAL_LINEAR_DECODE_FUSED", True, _switch,
    "0: a CUDA step of decodes only runs linear attention's older decode path (two in-place "
    "kernels and the gates and output norm as torch ops) instead of the fused kernels "
    "(shoal/layers/ops/linear_decode_fused.py)")

SHOAL_LINEAR_DECODE_SPLIT: EnvVar[int] = EnvVar(
    "SHOAL_LINEAR_DECODE_SPLIT", 1, int,
    "column slices a value head's state is cut into in the fused linear-attention decode "
    "(shoal/layers/ops/linear_decode_fused.py; a power of two): 1 (default) one program a "
    "head, 0 chosen from the batch and the GPU's multiprocessors (up to 4)")

SHOAL_FUSED_GATE_ROUTING: EnvVar[bool] = EnvVar(
    "SHOAL_FUSED_GATE_ROUTING", True, _switch,
    "0: a MoE router at decode sizes (1-8 tokens, CUDA) runs its gate GEMV and the routing "
    "kernel apart instead of one launch (shoal/layers/moe/gate_routing.py)")

SHOAL_DENSE_GEMV: EnvVar[bool] = EnvVar(
    "SHOAL_DENSE_GEMV", True, _switch,
    "0: dense bf16/fp16 layers at decode sizes (1-8 rows, CUDA) keep F.linear instead of "
    "the Triton GEMVs the launch tuner times against it once per shape "
    "(shoal/layers/ops/dense_linear.py; on an H100, 2026-12-07, with PDL: Llama-3.1-8B shape "
    "W2 batch 1 171.7 -> 179.5 tok/s, Qwen3.5-35B-A3B batch 1 307.4 -> 316.3; start-up "
    "+7 s with a cold Triton cache for the 8B, +6 s for the 35B)")


SHOAL_PDL: EnvVar[bool] = EnvVar(
    "SHOAL_PDL", True, _switch,
    "0: the decode step's own Triton kernels (norms, the FP8 and dense bf16 GEMVs, rope and "
    "cache write, paged decode attention, SiLU-mul, the hybrid and MoE decode kernels) launch "
    "plainly instead of with programmatic dependent launch on sm_90+ (shoal/pdl.py; "
    "2026-12-07, W2 batch 1: FP8 334.3 -> 353.0 tok/s on an H200; Qwen3.5-35B-A3B batch 1 "
    "295.8 -> 316.3 on an H100 with the dense GEMVs)")

SHOAL_INT4_PDL: EnvVar[bool] = EnvVar(
    "SHOAL_INT4_PDL", True, _switch,
    "0 (SHOAL_PDL on): the INT4 tensor-core decode GEMV (int4_mma_gemv.py) launches plainly "
    "instead of with programmatic dependent launch (it waits before its first load and lets "
    "the next kernel in after its K loop; 2026-12-07, H100, W2 batch 1 INT4 g128: 306.6 -> "
    "317.7 tok/s, the same tokens)")

SHOAL_INT4_TILED: EnvVar[bool] = EnvVar(
    "SHOAL_INT4_TILED", False, _switch,
    "1 (CUDA): each INT4 linear layer keeps a second copy of its codes with each K step's "
    "tile contiguous (int4_mma_gemv.tile_codes: half a byte a weight more), and the decode "
    "launch tuner times the tensor-core GEMV reading it beside the other candidates; an "
    "experiment (2026-12-07, H100, W2 batch 1 INT4: 317-327 -> 350.5 tok/s, from the "
    "kernel's registers, not the layout, which the GPTQ-layout kernel now matches)")

SHOAL_LORA_SEGMENTED_MIN_TOKENS: EnvVar[int | None] = EnvVar(
    "SHOAL_LORA_SEGMENTED_MIN_TOKENS", None, _optional_count,
    "LoRA on CUDA: steps of at least this many tokens take the segmented Triton kernels, "
    "shorter ones split-K; unset: 64 (shoal/lora/ops/lora_triton.py)")

SHOAL_FREEZE_STARTUP_HEAP: EnvVar[bool] = EnvVar(
    "SHOAL_FREEZE_STARTUP_HEAP", True, _switch,
    "0: the engine core leaves what its start-up built to the garbage collector instead of "
    "freezing it (gc.freeze; shoal/engine/startup_heap.py): for processes that start and drop "
    "many small engines, as the test suite does, where each drop's thaw makes the next "
    "start's collection walk the whole heap")

SHOAL_KV_HUGE_PAGES: EnvVar[bool] = EnvVar(
    "SHOAL_KV_HUGE_PAGES", True, _switch,
    "0: the CPU KV pool is neither marked for transparent huge pages nor populated at "
    "start-up (shoal/worker/host_pages.py)")

SHOAL_OFFLOAD_PREFETCH: EnvVar[bool] = EnvVar(
    "SHOAL_OFFLOAD_PREFETCH", False, _switch,
    "1: with cpu_offload_gb on CUDA, layer k+1's weights are copied on a side stream while "
    "layer k computes, into two staging slots (shoal/loader/offload_copies.py); off by "
    "default until its GPU test has passed on a GPU")
SHOAL_PP_LAYER_PARTITION: EnvVar[str | None] = EnvVar(
    "SHOAL_PP_LAYER_PARTITION", None, _optional_text,
    "decoder layers per pipeline stage, comma-separated (e.g. 13,17), as vLLM's "
    "VLLM_PP_LAYER_PARTITION; unset: as even as possible "
    "(shoal/distributed/parallel_state.py checks it against the model)")

SHOAL_SERVER_DEV_MODE: EnvVar[bool] = EnvVar(
    "SHOAL_SERVER_DEV_MODE", False, _on,
    "1/true: the server's development routes /sleep, /wake_up, /is_sleeping and "
    "/reset_prefix_cache, as vLLM's VLLM_SERVER_DEV_MODE (read too) "
    "(shoal/entrypoints/openai/dev_routes.py)")

SHOAL_ALLOW_RUNTIME_LORA_UPDATING: EnvVar[bool] = EnvVar(
    "SHOAL_ALLOW_RUNTIME_LORA_UPDATING", False, _on,
    "1/true: /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM's "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING (read too) (shoal/entrypoints/openai/lora_routes.py)")

def switched_on(var: EnvVar[bool], vllm_name: str) -> bool:
    """A shoal opt-in switch or its vLLM twin (a vLLM deployment's environment works
    unchanged): on when either is."""
    return var.get() or _on(os.environ.get(vllm_name, ""))


ALL: tuple[EnvVar, ...] = tuple(v for v in tuple(globals().values()) if isinstance(v, EnvVar))


def set_variables() -> dict[str, str]:
    """The variables of this list set in this process, as text: what a process started
    elsewhere needs to behave as this one (the Ray executor's actors)."""
    return {v.name: os.environ[v.name] for v in ALL if v.is_set()}
