"""Set-up shared by the Transformers-backend encoder tests (tests/models/
test_transformers_backend_encoders*.py): tiny random transformers encoders, the backend's
model loaded from their tensors, and its forward over packed prompts."""

from __future__ import annotations

import torch
from oracle import randomize_weights
from transformers import AutoConfig, AutoModel

from shoal.attention.packed import PackedSeqs
from shoal.models.registry import resolve_model_class

# lengths 12, 2, 2, 5: a run of two equal lengths, prompts longer than a local window
PROMPTS = [[5 + i for i in range(12)], [3, 4], [20, 21], [30, 31, 32, 33, 34]]


def random_encoder(model_type: str, fields: dict, auto: type = AutoModel) -> torch.nn.Module:
    """A transformers model of model_type with config `fields`, random float32 weights."""
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = auto.from_config(cfg, dtype=torch.float32).eval()
    randomize_weights(model)
    model.config.architectures = [type(model).__name__]
    return model


def backend_encoder(hf: torch.nn.Module, extra: dict | None = None) -> torch.nn.Module:
    """The backend's model for hf's config (model_impl="transformers"), loaded from hf's
    tensors and `extra` ones; every parameter loaded."""
    cls = resolve_model_class(hf.config, "pooling", "transformers")
    assert cls.__module__ == "shoal.models.transformers_backend.encoder"
    model = cls(hf.config, torch.float32)
    loaded = model.load_weights({**hf.state_dict(), **(extra or {})}.items())
    assert {n for n, _ in model.named_parameters()} <= loaded
    return model


def packed_states(model: torch.nn.Module, prompts: list[list[int]],
                  types: list[list[int]] | None = None) -> torch.Tensor:
    """The model's hidden states of the prompts packed into one sequence (segment ids
    `types`, if given)."""
    lens = [len(p) for p in prompts]
    seqs = PackedSeqs.build(lens, model.is_causal, torch.device("cpu"),
                            sum(types, []) if types else None)
    ids = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        return model(ids, positions, seqs)
