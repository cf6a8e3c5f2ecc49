"""Which engine settings do not work together (yet): one table, checked once.

Each row names two settings or features (vLLM's names), or a feature and a condition on the
model, says when a configuration falls on it, and what the user is told. EngineArgs.
create_engine_config checks the whole table after the runner, the device and max_model_len
are resolved and before anything is built, and raises one ValueError listing every row the
configuration falls on. A combination that becomes supported loses its row here, and nothing
else needs to know it was ever refused.

What stays elsewhere: the check of one setting's own value (`tensor_parallel_size must be an
integer >= 1`, an unknown speculative method), made where that setting is read, and whether
this host has the GPUs the ranks need (engine_args.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResolvedArgs:
    """What the rows read: the user's EngineArgs (each field's own value already checked)
    and what create_engine_config resolved from them and the model's config."""

    args: Any  # the EngineArgs (not imported: engine_args.py imports this module)
    runner: str  # "generate" or "pooling" (EngineArgs.resolve_runner)
    device_type: str  # "cpu" or "cuda"
    max_model_len: int
    hf_config: Any
    serving: bool = False  # an engine process of `shoal serve`; False: the offline LLM

    @property
    def tp(self) -> int:
        return self.args.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.args.pipeline_parallel_size

    @property
    def dp(self) -> int:
        return self.args.data_parallel_size

    @property
    def dp_ep(self) -> bool:
        return self.args.dp_expert_parallel()

    @property
    def pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def speculative(self) -> bool:
        return self.args.speculative_config is not None

    @property
    def offloading(self) -> bool:
        return self.args.kv_offloading_size is not None

    @property
    def fp8_kv_cache(self) -> bool:
        return getattr(self.args, "kv_cache_dtype", "auto") in ("fp8", "fp8_e4m3")

    @property
    def num_layers(self) -> int:
        return int(getattr(self.hf_config, "num_hidden_layers", 0) or 0)

    @property
    def linear_attention(self) -> bool:
        """Linear-attention layers (Gated DeltaNet, KDA) beside attention ones."""
        from shoal.models.registry import has_linear_attention

        return has_linear_attention(self.hf_config)

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (MLA), read as vLLM reads it: a kv_lora_rank."""
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    @functools.cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each decoder layer's sliding window (None: full attention), as the model reads its
        config (shoal/models/llama.py: Qwen2 sets a window it may not use)."""
        from shoal.models.llama import layer_sliding_window

        return tuple(layer_sliding_window(self.hf_config, i) for i in range(self.num_layers))

    @property
    def sliding_window(self) -> int | None:
        """The longest window a layer applies (None: no layer has one)."""
        return max((w for w in self.layer_windows if w), default=None)

    @property
    def all_layers_sliding(self) -> bool:
        return bool(self.layer_windows) and all(self.layer_windows)

    @property
    def drafter_with_kv(self) -> bool:
        """A drafter with layers and a KV cache of its own (not ngram's prompt lookup)."""
        return self.spec_method in ("draft_model", "mtp", "eagle", "eagle3")

    @property
    def spec_method(self) -> str | None:
        if self.args.speculative_config is None:
            return None
        from shoal.config.speculative import SpeculativeConfig

        return SpeculativeConfig.from_user(self.args.speculative_config).method

    @functools.cached_property
    def transformers_backend(self) -> bool:
        """The model runs through the Transformers backend (model_impl)."""
        from shoal.models.registry import uses_transformers_backend

        return uses_transformers_backend(self.hf_config, self.runner, self.args.model_impl)

    @property
    def backend_encoder(self) -> bool:
        """An encoder-only model through the Transformers backend, which applies each
        module's sliding window itself (transformers_backend/encoder_attention.py)."""
        from shoal.models.transformers_backend.support import is_encoder_only

        return self.transformers_backend and is_encoder_only(self.hf_config)

    @functools.cached_property
    def model_class(self) -> str:
        from shoal.models.registry import TRANSFORMERS_BACKEND, resolve_model_class

        if self.transformers_backend:  # (its own checks ran before the table)
            return TRANSFORMERS_BACKEND[1]
        return resolve_model_class(self.hf_config, self.runner).__name__

    @property
    def lora(self) -> bool:
        return bool(getattr(self.args, "enable_lora", False))

    @property
    def lora_capable(self) -> bool:
        from shoal.config.lora import LORA_ARCHITECTURES

        return self.model_class in LORA_ARCHITECTURES

    @property
    def lora_architectures(self) -> str:
        from shoal.config.lora import LORA_ARCHITECTURES

        return ", ".join(sorted(LORA_ARCHITECTURES))

    @property
    def pipeline_architectures(self) -> str:
        from shoal.models.llama import PIPELINE_PARALLEL_ARCHITECTURES

        return ", ".join(sorted(PIPELINE_PARALLEL_ARCHITECTURES))

    @property
    def pipeline_capable(self) -> bool:
        """Built per pipeline stage: a native class listed for it, or any model the
        Transformers backend runs (its own row asks for the config's pipeline plan)."""
        from shoal.models.llama import PIPELINE_PARALLEL_ARCHITECTURES

        return (self.transformers_backend
                or self.model_class in PIPELINE_PARALLEL_ARCHITECTURES)

    @property
    def backend_pp_refusal(self) -> str | None:
        """Why the Transformers backend cannot split this model into pp stages."""
        from shoal.models.transformers_backend.pipeline import pp_plan_refusal

        return pp_plan_refusal(self.hf_config, self.pp)

    @property
    def backend_tp_refusal(self) -> str | None:
        """Why the Transformers backend cannot split this model over tp ranks."""
        from shoal.models.transformers_backend.tensor_parallel import tp_plan_refusal

        return tp_plan_refusal(self.hf_config, self.tp)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None)
        return str(archs[0] if archs else getattr(self.hf_config, "model_type", None))

    @property
    def encoder_only(self) -> bool:  # bidirectional attention: no decoder layers to split
        from shoal.models.registry import resolve_model_class
        from shoal.models.transformers_backend.support import is_encoder_only

        return (is_encoder_only(self.hf_config) if self.transformers_backend else
                not getattr(resolve_model_class(self.hf_config, self.runner), "is_causal", True))

    @property
    def pooling_only(self) -> bool:
        from shoal.models.registry import is_pooling_only

        return is_pooling_only(self.hf_config)


@dataclass(frozen=True)
class Incompatibility:
    """One row: `setting` does not work with `other` (a setting, or a condition on the model
    or the device); `applies` says whether a configuration falls on the row; `message` is a
    str.format template over `s`, the ResolvedArgs."""

    setting: str
    other: str
    applies: Callable[[ResolvedArgs], bool]
    message: str

    def describe(self, s: ResolvedArgs) -> str:
        return self.message.format(s=s)


_DP_EP = "enable_expert_parallel with data_parallel_size > 1 (DP+EP)"
_V4 = "DeepSeek-V4 (DeepseekV4ForCausalLM)"


def _deepseek_v4(s: ResolvedArgs) -> bool:
    """DeepSeek-V4 (shoal/models/deepseek_v4.py)."""
    archs = getattr(s.hf_config, "architectures", None) or ()
    return ("DeepseekV4ForCausalLM" in archs
            or getattr(s.hf_config, "model_type", None) == "deepseek_v4")


ROWS: tuple[Incompatibility, ...] = (
    # ---- the runner -----------------------------------------------------------------------
    Incompatibility(
        "runner='generate'", "a pooling-only architecture",
        lambda s: s.args.runner == "generate" and s.pooling_only,
        "runner='generate' cannot run this model: it is a pooling model (embeddings, "
        "classification, scores)"),
    Incompatibility(
        "runner='generate'", "convert='embed'",
        lambda s: s.args.runner == "generate" and s.args.convert == "embed",
        "runner='generate' cannot run convert='embed'"),
    # (tensor_parallel_size > 1 runs, every rank a pooling runner over its shard, and so do a
    # decoder's pipeline stages: stage 0's rank 0 pools; the backend's own rows apply below)
    Incompatibility(
        "runner='pooling'", "pipeline_parallel_size > 1 with an encoder-only model",
        lambda s: s.pooling and s.pp > 1 and s.encoder_only,
        "pipeline_parallel_size > 1 splits a decoder's layers into stages; {s.architecture} "
        "is an encoder-only model, which runs in one stage: use tensor_parallel_size instead"),
    Incompatibility(
        "runner='pooling'", _DP_EP,
        lambda s: s.pooling and s.dp_ep,
        "the pooling runner does not support " + _DP_EP),
    Incompatibility(
        "runner='pooling'", "speculative_config",
        lambda s: s.pooling and s.speculative,
        "speculative_config applies to generation, not the pooling runner"),
    Incompatibility(
        "runner='pooling'", "latent attention (MLA)",
        lambda s: s.pooling and s.latent_attention,
        "runner='pooling' is not supported for {s.model_class} (latent attention, MLA)"),
    Incompatibility(
        "runner='pooling'", "a sliding window shorter than max_model_len",
        lambda s: s.pooling and s.sliding_window is not None
        and s.max_model_len > s.sliding_window and not s.backend_encoder,
        "max_model_len ({s.max_model_len}) is longer than the model's sliding window "
        "({s.sliding_window}), which pooling does not apply yet: set max_model_len to "
        "{s.sliding_window} or less"),
    Incompatibility(
        "runner='pooling'", "linear attention (Qwen3-Next, Qwen3.5, Kimi Linear)",
        lambda s: s.pooling and s.linear_attention,
        "runner='pooling' is not supported for {s.model_class} (linear-attention layers)"),
    # ---- LoRA ------------------------------------------------------------------------------
    Incompatibility(
        "enable_lora", "runner='pooling'",
        lambda s: s.lora and s.pooling,
        "enable_lora serves generation; the pooling runner takes no adapters yet"),
    Incompatibility(
        "enable_lora", "an architecture without LoRA layers",
        lambda s: s.lora and not s.pooling and not s.lora_capable,
        "enable_lora is not supported for {s.model_class} yet (supported: "
        "{s.lora_architectures})"),
    # ---- speculative decoding -------------------------------------------------------------
    Incompatibility(
        "speculative_config (eagle)", "linear attention (Qwen3-Next, Qwen3.5, Kimi Linear)",
        lambda s: s.spec_method in ("eagle", "eagle3") and s.linear_attention,
        "speculative_config: method 'eagle' has no head for {s.model_class}; use 'mtp', "
        "'draft_model' or 'ngram'"),
    Incompatibility(
        "speculative_config (draft_model, mtp, eagle)", "a model whose layers all slide",
        lambda s: s.drafter_with_kv and s.all_layers_sliding,
        "speculative_config: a drafter with a KV cache of its own follows the target's block "
        "tables, which a model whose every layer has a sliding window ({s.sliding_window}) "
        "empties behind the window; use method 'ngram'"),
    # ---- KV offloading --------------------------------------------------------------------
    Incompatibility(
        "kv_offloading_size", "tensor_parallel_size > 1",
        lambda s: s.offloading and s.tp > 1,
        "kv_offloading_size does not support tensor_parallel_size > 1 yet"),
    Incompatibility(
        "kv_offloading_size", "pipeline_parallel_size > 1",
        lambda s: s.offloading and s.pp > 1,
        "kv_offloading_size does not support pipeline_parallel_size > 1 yet"),
    Incompatibility(
        "kv_offloading_size", "data_parallel_size > 1",
        lambda s: s.offloading and s.dp > 1,
        "kv_offloading_size does not support data_parallel_size > 1 yet"),
    Incompatibility(
        "kv_offloading_size", "enable_prefix_caching=False",
        lambda s: s.offloading and not s.args.enable_prefix_caching,
        "kv_offloading_size needs enable_prefix_caching (blocks are found by their prefix "
        "hash)"),
    Incompatibility(
        "kv_offloading_disk_path / kv_offloading_disk_size", "no kv_offloading_size",
        lambda s: not s.offloading and (s.args.kv_offloading_disk_path is not None
                                        or s.args.kv_offloading_disk_size is not None),
        "the disk KV tier sits below the CPU tier: set kv_offloading_size (GiB) too"),
    Incompatibility(
        "kv_offloading_disk_size", "no kv_offloading_disk_path",
        lambda s: s.args.kv_offloading_disk_size is not None
        and s.args.kv_offloading_disk_path is None,
        "kv_offloading_disk_size needs kv_offloading_disk_path"),
    # ---- async scheduling -----------------------------------------------------------------
    Incompatibility(
        "async_scheduling", "tensor_parallel_size > 1",
        lambda s: bool(s.args.async_scheduling) and s.tp > 1,
        "async_scheduling does not support tensor_parallel_size > 1 (or pipeline "
        "parallelism) yet; leave it unset"),
    Incompatibility(
        "async_scheduling", "pipeline_parallel_size > 1",
        lambda s: bool(s.args.async_scheduling) and s.pp > 1,
        "async_scheduling does not support pipeline_parallel_size > 1 (its steps overlap as "
        "micro-batches instead, up to pipeline_parallel_size in flight); leave it unset"),
    Incompatibility(
        "async_scheduling", _DP_EP,
        lambda s: bool(s.args.async_scheduling) and s.dp_ep,
        "async_scheduling does not support " + _DP_EP + "; leave it unset"),
    # ---- tensor and pipeline parallelism ----------------------------------------------------
    Incompatibility(
        "tensor_parallel_size > 1", "distributed_executor_backend='uni'",
        lambda s: s.tp > 1 and s.args.distributed_executor_backend == "uni",
        "distributed_executor_backend 'uni' runs one rank; tensor_parallel_size {s.tp} needs "
        "'mp' or 'ray'"),
    Incompatibility(
        "pipeline_parallel_size > 1", "distributed_executor_backend='uni'",
        lambda s: s.pp > 1 and s.args.distributed_executor_backend == "uni",
        "pipeline_parallel_size {s.pp} needs distributed_executor_backend 'mp' or 'ray' "
        "(got 'uni')"),
    Incompatibility(
        "pipeline_parallel_size > 1", "CUDA graphs (enforce_eager=False on CUDA)",
        lambda s: s.pp > 1 and s.device_type == "cuda" and not s.args.enforce_eager,
        "pipeline_parallel_size > 1 does not support CUDA graphs yet: pass enforce_eager=True "
        "(--enforce-eager)"),
    Incompatibility(
        "pipeline_parallel_size > 1", "an architecture not built per stage",
        lambda s: s.pp > 1 and not s.pipeline_capable,
        "pipeline_parallel_size > 1 supports {s.pipeline_architectures}; not {s.model_class} "
        "yet"),
    Incompatibility(
        "pipeline_parallel_size", "fewer decoder layers than stages",
        lambda s: s.pp > 1 and s.num_layers < s.pp,
        "pipeline_parallel_size {s.pp} needs at least as many decoder layers (the model has "
        "{s.num_layers})"),
    # ---- data parallelism -----------------------------------------------------------------
    Incompatibility(
        "data_parallel_size > 1", "the offline LLM (without enable_expert_parallel)",
        lambda s: not s.serving and s.dp > 1 and s.args.enable_expert_parallel is not True,
        "data_parallel_size > 1 runs replicas behind `shoal serve`; offline, run one LLM per "
        "replica (got data_parallel_size={s.dp})"),
    # ---- DP+EP: one rank per replica, in the engine process, in lockstep --------------------
    Incompatibility(
        _DP_EP, "tensor_parallel_size or pipeline_parallel_size > 1",
        lambda s: s.dp_ep and (s.tp != 1 or s.pp != 1),
        "enable_expert_parallel with data_parallel_size {s.dp} (DP+EP) needs "
        "tensor_parallel_size 1 and pipeline_parallel_size 1 (got {s.tp} and {s.pp}): the "
        "experts are split over the replicas, one rank each"),
    Incompatibility(
        _DP_EP, "distributed_executor_backend 'mp' or 'ray'",
        lambda s: s.dp_ep and s.args.distributed_executor_backend not in (None, "uni"),
        _DP_EP + " runs the model in each replica's engine process: "
        "distributed_executor_backend must be unset or 'uni' (got "
        "{s.args.distributed_executor_backend!r})"),
    Incompatibility(
        _DP_EP, "no data_parallel_rank or data_parallel_master_port",
        lambda s: s.dp_ep and not (s.args.data_parallel_master_port is not None
                                   and isinstance(s.args.data_parallel_rank, int)
                                   and 0 <= s.args.data_parallel_rank < s.dp),
        "enable_expert_parallel with data_parallel_size {s.dp} (DP+EP): each replica needs "
        "data_parallel_rank in [0, {s.dp}) and the shared data_parallel_master_port (shoal "
        "serve sets both; offline, run one LLM per rank with both set; got "
        "{s.args.data_parallel_rank!r} and {s.args.data_parallel_master_port!r})"),
    # ---- the KV cache dtype -----------------------------------------------------------------
    # (Linear-attention hybrids take it: their attention pages are FP8, their recurrent states
    # stay float32 words inside those pages, and the block size grows until a page holds one.
    # DeepSeek-V3.2 keeps its indexer keys and DeepSeek-V4 its window rows and compressed
    # entries as FP8 with a scale per block of values: attention/fp8_rows.py; both backends
    # read them.)
    # ---- the Transformers backend (transformers' modeling code, shoal's paged attention) ----
    Incompatibility(
        "model_impl='transformers' (the Transformers backend)", _DP_EP,
        lambda s: s.transformers_backend and s.dp_ep,
        "the Transformers backend runs transformers' own MoE layers, which do not split "
        "experts over replicas: " + _DP_EP + " is not supported"),
    Incompatibility(
        "model_impl='transformers' (the Transformers backend)",
        "tensor_parallel_size > 1 without a base_model_tp_plan that divides the heads",
        lambda s: s.transformers_backend and s.tp > 1 and s.backend_tp_refusal is not None,
        "{s.backend_tp_refusal}"),
    Incompatibility(
        "model_impl='transformers' (the Transformers backend)",
        "pipeline_parallel_size > 1 without a base_model_pp_plan",
        lambda s: s.transformers_backend and s.pp > 1 and s.backend_pp_refusal is not None,
        "{s.backend_pp_refusal}"),
    Incompatibility(
        "model_impl='transformers' (the Transformers backend)", "speculative_config (mtp, eagle)",
        lambda s: s.transformers_backend and s.spec_method in ("mtp", "eagle", "eagle3"),
        "speculative_config: method {s.spec_method!r} drafts from a shoal model class's layers "
        "and hidden states; with the Transformers backend use 'ngram' or 'draft_model'"),
    # ---- DeepSeek-V4 (decode graphs only on CUDA: engine/graph_support.py) ------------------
    # (expert parallelism runs, inside TP and over DP+EP replicas, MTP included:
    # tests/models/test_deepseek_v4_data_parallel.py)
    Incompatibility(
        _V4, "speculative_config (eagle)",
        lambda s: _deepseek_v4(s) and s.spec_method in ("eagle", "eagle3"),
        "speculative_config: method {s.spec_method!r} has no head for DeepseekV4ForCausalLM; "
        "use 'mtp' (its multi-token-prediction layer) or 'ngram'"),
    Incompatibility(
        _V4, "kv_cache_dtype='fp8' with a block_size not a multiple of 4 on CUDA",
        lambda s: (_deepseek_v4(s) and s.fp8_kv_cache and s.device_type == "cuda"
                   and s.args.block_size % 4 != 0),
        "DeepseekV4ForCausalLM's decode kernels read an FP8 cache's float32 scales 4-byte "
        "aligned, which needs block_size a multiple of 4 (got {s.args.block_size})"),
    # ---- devices --------------------------------------------------------------------------
    Incompatibility(
        "speculative_config", "a vision-language model",
        lambda s: s.speculative and getattr(s.hf_config, "multimodal_config", None) is not None,
        "speculative decoding with {s.model_class} (images in) is not supported yet"),
    Incompatibility(
        "cpu_int4_matmul", "a device other than the CPU",
        lambda s: bool(s.args.cpu_int4_matmul) and s.device_type != "cpu",
        "cpu_int4_matmul runs on the CPU only (device is {s.device_type})"),
)


def violations(s: ResolvedArgs,
               rows: tuple[Incompatibility, ...] = ROWS) -> list[Incompatibility]:
    """The rows the configuration falls on, in table order."""
    return [row for row in rows if row.applies(s)]


def check_compatibility(s: ResolvedArgs, rows: tuple[Incompatibility, ...] = ROWS) -> None:
    """Raises one ValueError naming every row the configuration falls on."""
    found = [row.describe(s) for row in violations(s, rows)]
    if found:
        raise ValueError(found[0] if len(found) == 1 else "these engine settings do not work "
                         "together:\n  - " + "\n  - ".join(found))
