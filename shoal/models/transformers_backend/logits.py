"""Logits from final hidden states through the causal LM's own forward pass.

Architectures do different things after lm_head (Cohere multiplies by logit_scale, Granite
divides by logits_scaling, Gemma 2/3 soft-cap, ...). Rather than list them, the causal LM's
forward runs with its base model replaced, for the call, by a stand-in that returns the
given hidden states: everything the class does after its decoder stack is applied as
transformers wrote it."""

from __future__ import annotations

import torch
from torch import nn


class _GivenHiddenStates(nn.Module):
    """Returns the hidden states it was handed, whatever the causal LM passes it."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: object, **kwargs: object) -> _BaseOutputs:
        return _BaseOutputs(self.hidden)

    def __getattr__(self, name: str) -> object:
        # A causal LM that calls a part of its base model (OPT: model.decoder) gets this
        # stand-in for that part too.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return self


class _BaseOutputs:
    """A base model's outputs with the final hidden states only: what else a causal LM reads
    (MoE router logits for its auxiliary loss, the cache) is None."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # only for attributes not set above
        return None

    def __getitem__(self, index: int | str) -> torch.Tensor | None:
        if index in (0, "last_hidden_state"):
            return self.last_hidden_state
        raise KeyError(index)


class CausalLMHead:
    """compute_logits for a transformers causal LM (the wrapped model's lm_head, tied or
    not, and whatever its class applies after it)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.base_name = model.base_model_prefix
        if self.base_name not in model._modules:
            raise ValueError(f"{type(model).__name__} has no base model under "
                             f"{self.base_name!r}")
        if model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
        self.stand_in = _GivenHiddenStates()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size]."""
        modules = self.model._modules
        base = modules[self.base_name]
        self.stand_in.hidden = hidden.unsqueeze(0)
        modules[self.base_name] = self.stand_in
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = self.model(input_ids=ids, use_cache=False)
        finally:
            modules[self.base_name] = base
            self.stand_in.hidden = None
        return out.logits[0]
