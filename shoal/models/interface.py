"""What every model class provides: the written contract for adding an architecture.

A model class is an `nn.Module` listed in shoal/models/registry.py under the `architectures`
name of its Hugging Face config. shoal.loader.build.build_model constructs it, fills its
weights and hands it to the model runner, which calls only what `CausalLM` lists (plus
nn.Module's own `named_parameters`, `eval` and `__call__`). Under runner="pooling" the model
is a `PoolingModel` instead: the pooling runner, shoal/pooling and the loader read only its
declarations. tests/models/test_interface.py checks every registered architecture against
them."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from shoal.layers.attention import Attention


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over the paged KV cache.

    Constructor: `cls(hf_config, dtype, *, use_triton_ops=True)`, called inside
    `with torch.device(device)` so parameters are created where they will run. It allocates
    every parameter in `dtype` (values are filled later, by `load_weights` or with dummy
    weights) and takes its shapes from `hf_config` alone. `use_triton_ops` goes to every
    layer that has a Triton kernel (RMSNorm, SiluAndMul, rotary, FusedMoE): off, they run
    their PyTorch path on CUDA too. Layers that are tensor-parallel take their split from
    shoal.distributed at construction.
    """

    # Checkpoint projection name -> (fused parameter it lands in, shard id), e.g.
    # "q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", 0).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]]
    # lm_head shares the embedding's weight: the checkpoint need not hold lm_head.weight.
    tie_word_embeddings: bool

    def __init__(self, hf_config: Any, dtype: torch.dtype, *,
                 use_triton_ops: bool = True) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """input_ids, positions: [T] for the step's flattened tokens; attn_metadata: what the
        bound attention backend's build_metadata (or graph_metadata) returned. Returns the
        final hidden states [T, hidden_size]. Writes the step's keys and values into the
        caches of attention_layers()."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] logits (float32 or the model dtype)."""
        ...

    def attention_layers(self) -> list[Attention]:
        """The paged layers in order (a decoder layer may have several: DeepSeek-V3.2's latent
        attention and its indexer's keys): the runner sizes the KV pool from them and
        binds each one's cache (and its KV cache group) and backend. Each says what it keeps
        with kv_cache_spec(dtype_bytes) (shoal/core/kv_cache_spec.py: full attention, a
        sliding window, MLA's one latent row per token)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fills parameters from Hugging Face-named tensors (fused ones through
        packed_modules_mapping and each parameter's `weight_loader`); returns the names of
        the parameters it filled, which the loader checks against named_parameters().
        Raises ValueError for a tensor that has no parameter."""
        ...


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A CausalLM that reads images (a vision-language model); supports_multimodal = True.

    The runner encodes each scheduled image once (embed_multimodal, its output kept in the
    encoder cache under the feature's identifier), builds the step's input embeddings
    (embed_input_ids, then each image's outputs over its placeholder positions) and calls
    forward with inputs_embeds. Steps without image positions run as any CausalLM's (their
    CUDA graphs included)."""

    supports_multimodal: ClassVar[bool]
    # M-RoPE (Qwen-VL): positions are [3, T] (time, height, width) over images; text tokens
    # have three equal streams, so a step of text alone passes [T] positions shifted by the
    # request's delta (get_mrope_positions)
    uses_mrope: ClassVar[bool]

    def embed_multimodal(self, features: list[Any]) -> list[torch.Tensor]:
        """One [num_embeds, D] tensor per MultiModalFeature (its `arrays()` are the
        processor's tensors), in the model dtype on the model's device. D is hidden_size, or
        a multiple of it when the model feeds image features to several layers (Qwen3-VL's
        deepstack: the main features, then each deepstack layer's, along the last dim)."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids -> [T, hidden_size] input embeddings: the token embeddings, with the rows
        where is_multimodal ([T] bool) replaced by mm_embeds ([n, D], in order; rows of
        embed_multimodal's outputs). A model that reads D > hidden_size keeps the rest for
        the forward pass that follows."""
        ...

    def get_mrope_positions(self, prompt_token_ids: list[int], features: list[Any]
                            ) -> tuple[torch.Tensor, int]:
        """M-RoPE only: the prompt's [3, L] positions and the delta that later tokens add to
        their index (position of token i >= L is i + delta)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor: ...


# What a pooling model may answer (shoal.pooling_params.POOLING_TASKS): a pooled embedding,
# every token's embedding, per-token weights, a classification, a relevance score (cosine of
# two embeddings for an embedder, the one logit of a cross-encoder).
EMBED_TASKS = ("embed", "token_embed", "score")


@runtime_checkable
class PoolingModel(Protocol):
    """An encoder, a classifier, or a decoder run for its hidden states (runner="pooling").

    Constructed and loaded as a CausalLM is (same constructor, load_weights,
    packed_modules_mapping, tie_word_embeddings). `forward` runs the step's prompts packed back
    to back (attn_metadata: a PackedSeqs, shoal/attention/packed.py) and returns their final
    hidden states [T, hidden_size]; no KV cache is kept. What it offers is declared, never
    probed: a class inherits PoolingModelBase (the optional parts, off) and says what it has;
    a causal LM becomes one through as_pooling_model.
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]]
    tie_word_embeddings: bool
    # Attention over the packed prompts: causal (decoders) or bidirectional (encoders).
    is_causal: bool
    # CLS, MEAN, LAST or ALL: the embedding's pooling unless the checkpoint's
    # sentence-transformers files or pooler_config say otherwise.
    default_pooling_type: str
    # The tasks of POOLING_TASKS it answers (a request for another is refused up front).
    pooling_tasks: tuple[str, ...]
    hidden_size: int
    # Outputs of the classifier (0: none; 1: a cross-encoder's relevance logit).
    num_labels: int
    # What classify() reads: the CLS or LAST token, or the MEAN of the tokens (None without a
    # classifier).
    classifier_pooling_type: str | None
    # token_output() gives the per-token tasks' results (BGE-M3's heads); otherwise they are
    # the hidden states themselves, truncated and normalized as embeddings are.
    has_token_heads: bool

    def __init__(self, hf_config: Any, dtype: torch.dtype, *,
                 use_triton_ops: bool = True) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor: ...

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] states at classifier_pooling_type -> [N, num_labels] logits."""
        ...

    def token_output(self, task: str, hidden: torch.Tensor) -> torch.Tensor:
        """One sequence's [L, hidden] states -> its per-token result for `task` (float32)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def load_extra_files(self, folder: Path) -> set[str]:
        """Weights stored beside the checkpoint's own (BGE-M3's heads); returns the names of
        the parameters it filled."""
        ...


class PoolingModelBase:
    """The optional parts of a PoolingModel, off: an embedder over its hidden states with no
    classifier, per-token head or extra weight files. A pooling model class inherits it
    beside nn.Module, declares is_causal and default_pooling_type, and overrides what it has."""

    pooling_tasks: tuple[str, ...] = EMBED_TASKS
    num_labels: int = 0
    classifier_pooling_type: str | None = None
    has_token_heads: bool = False

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no classifier")

    def token_output(self, task: str, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no per-token head")

    def load_extra_files(self, folder: Path) -> set[str]:
        return set()


class SequenceClassifierBase(PoolingModelBase):
    """A classification head over one pooled token: the class defines classify() and
    classifier_pooling_type, its constructor sets num_labels. It classifies, and with one
    label it is a cross-encoder that scores pairs too."""

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        return ("classify", "score") if self.num_labels == 1 else ("classify",)


@functools.cache
def as_pooling_model(cls: type) -> type:
    """`cls` itself when it declares a PoolingModel; a causal LM gets the embedder's
    declarations (vLLM's as_embedding_model): causal attention, the last token's state,
    EMBED_TASKS. The class keeps its name (logs and messages name the architecture)."""
    if issubclass(cls, PoolingModelBase):
        return cls
    namespace = {"is_causal": True, "default_pooling_type": "LAST",
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__doc__": f"{cls.__name__} run as an embedder (runner='pooling')."}
    return type(cls.__name__, (cls, PoolingModelBase), namespace)
