"""What every model class provides: the written contract for adding an architecture.

A model class is an `nn.Module` listed in shoal/models/registry.py under the `architectures`
name of its Hugging Face config. shoal.loader.build.build_model constructs it, fills its
weights and hands it to the model runner, which calls only what `CausalLM` lists (plus
nn.Module's own `named_parameters`, `eval` and `__call__`). tests/models/test_interface.py
checks every registered architecture against it."""

from __future__ import annotations

from collections.abc import Iterable
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
        """The paged attention layers in order: the runner sizes the KV pool from them and
        binds each one's cache and backend. Each says the shape of its cache: kv_planes (2: K
        and V; 1: LatentAttention's one latent row per token), num_kv_heads and head_dim."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fills parameters from Hugging Face-named tensors (fused ones through
        packed_modules_mapping and each parameter's `weight_loader`); returns the names of
        the parameters it filled, which the loader checks against named_parameters().
        Raises ValueError for a tensor that has no parameter."""
        ...
