"""Model construction: the registered class for the checkpoint's architecture, built on the
engine's device in its dtype, its weights loaded (and checked complete) or set at random for
load_format="dummy", in eval mode."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch import nn

from shoal.config import EngineConfig
from shoal.distributed.parallel_state import expert_parallel
from shoal.layers import rotary_share
from shoal.layers.linear import triton_ops_while_building
from shoal.layers.moe.deferred_stacks import check_none_deferred, packed_experts_expected
from shoal.layers.shared_input_linear import settle_all
from shoal.loader.dummy import initialize_dummy_weights
from shoal.loader.kv_scales import apply_kv_scales
from shoal.loader.loaded_model import LoadedModel
from shoal.loader.weight_offload import WeightOffloader
from shoal.models.interface import as_pooling_model
from shoal.models.registry import model_path, resolve_model_class
from shoal.quantization.fast_path import FastPath

logger = logging.getLogger(__name__)


def build_model(config: EngineConfig, loaded: LoadedModel) -> nn.Module:
    """A model following shoal/models/interface.py (a CausalLM, or under runner="pooling" a
    PoolingModel), ready for the runner to bind KV caches."""
    t0 = time.perf_counter()
    pooling = config.model_config.runner == "pooling"
    cls = resolve_model_class(loaded.hf_config, config.model_config.runner,
                              config.model_config.model_impl)
    if pooling:  # a PoolingModel; a causal LM serves as an embedder
        cls = as_pooling_model(cls)
    ep = config.parallel_config.enable_expert_parallel  # read by FusedMoE's constructor
    # cpu_offload_gb: the first decoder layers move to host memory as they are built
    offload = config.cache_config.cpu_offload_bytes
    offloader = WeightOffloader(offload, config.device) if offload else None
    dummy = config.model_config.load_format == "dummy"
    # FP8 / INT4 weights kept packed on CUDA (shoal/quantization/fast_path.py); MoE experts
    # expected packed are built without their dense stacks (layers/moe/deferred_stacks.py)
    fast = None if offload else FastPath.plan(loaded.quantization, config.model_config.dtype,
                                              config.device, dummy=dummy)
    # (rotary tables shared by this model's layers only: layers/rotary_share.py)
    with torch.device(config.device), expert_parallel(ep), rotary_share.one_model() as rope, (
            offloader.building() if offloader else contextlib.nullcontext()), \
            packed_experts_expected(fast.experts_plan() if fast else None), \
            triton_ops_while_building(config.use_triton_ops):
        model = cls(loaded.hf_config, config.model_config.dtype,
                    use_triton_ops=config.use_triton_ops)
    rotary_share.remember(model, rope)  # (a drafter's head shares them)
    if dummy:  # (drawn on the device, offloaded or not)
        initialize_dummy_weights(model, seed=config.model_config.seed, device=config.device)
    else:
        weights = loaded.weights if fast is None else fast.weights(loaded.weights)
        with fast.loading(model) if fast else contextlib.nullcontext():
            names = model.load_weights(weights())
        if pooling:  # heads stored beside the safetensors (BGE-M3)
            names |= model.load_extra_files(Path(loaded.source))
        check_all_loaded(model, names, loaded.source)
        apply_kv_scales(model, loaded.kv_scales)  # (filled by the pass just made)
    if fast is not None:
        fast.finish(model)
    check_none_deferred(model)
    # By default only a GGUF's weights are looked at (another format has no 4-bit groups to
    # find, and the search reads every weight); asked for, any model is tried.
    if config.cpu_int4_matmul == "all" or (config.cpu_int4_matmul == "small_steps"
                                           and loaded.load_format == "gguf"):
        convert_to_int4(model, loaded.source, config.cpu_int4_matmul)
    settle_all(model)  # (joined projections one of which was packed: each keeps its own half)
    model.eval()
    if offloader is not None:
        offloader.activate(model)
    logger.info("model %s loaded in %.2f s: %s", getattr(model, "architecture", cls.__name__),
                time.perf_counter() - t0, model_path(cls))
    return model


def convert_to_int4(model: nn.Module, source: str, mode: str) -> None:
    """mode "all": every step packed, an error if nothing is 4-bit (the user asked for it);
    "small_steps" (the CPU default): packed beside dense, nothing to do for other weights."""
    from shoal.layers.int4_cpu import SMALL_STEP_ROWS, convert_linears

    t0 = time.perf_counter()
    stats = convert_linears(model, small_steps_only=mode == "small_steps")
    if not stats["converted"]:
        if mode == "all":
            raise ValueError(f"cpu_int4_matmul: {source} has no 4-bit (Q4_0/Q4_1) linear "
                             "weights")
        return
    when = (f"steps of <= {SMALL_STEP_ROWS} tokens (dense weights kept for larger ones)"
            if mode == "small_steps" else "every step (dense weights freed)")
    logger.info("int4 CPU matmuls for %s: %d linear layers (%.0f MiB dense, %.0f MiB packed), "
                "%d left dense, converted in %.2f s", when, stats["converted"],
                stats["dense_bytes"] / 2**20, stats["int4_bytes"] / 2**20, stats["dense"],
                time.perf_counter() - t0)


def check_all_loaded(model: nn.Module, loaded_names: set[str], source: str) -> None:
    """Raises when the checkpoint left a parameter unfilled (a tied lm_head needs none)."""
    missing = {n for n, _ in model.named_parameters()} - loaded_names
    if model.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {sorted(missing)[:5]}...")
