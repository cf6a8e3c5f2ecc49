"""Pipeline parallelism for the Transformers backend, from the plan transformers ships with a
config (`base_model_pp_plan`: the base model's top-level modules in forward order, e.g.
embed_tokens, layers, norm). The entry that is a ModuleList holds the decoder layers, split
over the stages as shoal's native models split theirs (pp_layer_range); the entries before
it (embeddings, their dropout) run on the first stage, those after it (the final norm) on
the last. Stage 0 also keeps the LM head: it samples, as with native models.

A module this stage does not run is replaced, before any weight is materialized, by
OtherStage (no parameters; it passes its hidden-states argument through, as transformers'
own pipeline split expects), so the base model's forward runs unchanged on every stage.
Two hooks make a stage's input and output exact whatever that forward does around the
layers: a later stage calls the base model with the received hidden states as inputs_embeds
and a pre-hook hands its first decoder layer those states again (what runs between the
embedding and the layers, such as Granite's embedding_multiplier, belongs to stage 0 and
must not run twice); a stage before the last takes its output from a hook on its last
decoder layer (nothing after it belongs to that stage).

Between stages the activations travel as native stages' do (worker/stage_link.py): a
(hidden, residual) pair. transformers' layers add their residual themselves, so the residual
plane is zeros (twice the bytes of what is needed, in exchange for one stage link)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shoal.distributed.parallel_state import pp_is_first, pp_is_last, pp_layer_range

PP_PLAN_FIELD = "base_model_pp_plan"


class OtherStage(nn.Module):
    """A module another pipeline stage runs (or, for a pooling model, the unused LM head): no
    parameters; returns the hidden states it is handed. Plain attributes of the module it
    replaces are kept (a base model's loop may read `layer.attention_type`)."""

    def __init__(self, replaced: nn.Module | None = None):
        super().__init__()
        for name, value in (vars(replaced) if replaced is not None else {}).items():
            if (not name.startswith("_") and name != "training"
                    and isinstance(value, (bool, int, float, str))):
                setattr(self, name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return args[0]
        if "hidden_states" in kwargs:
            return kwargs["hidden_states"]
        return next(iter(kwargs.values()))


def pp_plan_refusal(hf_config: Any, pp: int) -> str | None:
    """Why the backend cannot split the model over `pp` stages, from the config alone."""
    plan = getattr(hf_config, PP_PLAN_FIELD, None)
    if pp > 1 and not plan:
        return (f"the Transformers backend cannot run {_name(hf_config)} with "
                f"pipeline_parallel_size {pp}: its config has no {PP_PLAN_FIELD} (the modules "
                "to split into stages)")
    return None


@dataclass
class StageSlice:
    """This rank's part of a base model: the modules it runs and where its tensors enter
    and leave (hooks set by `attach`)."""

    layers_name: str  # the plan's ModuleList, relative to the base model
    start: int  # this stage's decoder layers: [start, end)
    end: int
    is_first: bool
    is_last: bool
    hidden_size: int
    dropped: tuple[str, ...] = ()  # module names relative to the causal LM, dot-terminated
    _entering: torch.Tensor | None = field(default=None, repr=False)
    _leaving: torch.Tensor | None = field(default=None, repr=False)

    def attach(self, base: nn.Module) -> None:
        layers = base.get_submodule(self.layers_name)
        if not self.is_first:
            layers[self.start].register_forward_pre_hook(self._enter, with_kwargs=True)
        if not self.is_last:
            layers[self.end - 1].register_forward_hook(self._leave)

    def run(self, base: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            intermediate: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype,
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states [T, hidden] on the last stage, else (hidden, zeros) for
        the next stage. A later stage starts from `intermediate`'s hidden states (zeros
        without one: warm-up and profile runs)."""
        kw: dict[str, Any] = dict(position_ids=positions.unsqueeze(0), use_cache=False)
        if self.is_first:
            kw["input_ids"] = input_ids.unsqueeze(0)
        else:
            hidden = (intermediate[0] if intermediate is not None else
                      torch.zeros(input_ids.shape[0], self.hidden_size, dtype=dtype,
                                  device=input_ids.device))
            self._entering = kw["inputs_embeds"] = hidden.unsqueeze(0)
        try:
            out = base(**kw)
            if self.is_last:
                return out[0][0]
            leaving = self._leaving
            assert leaving is not None, "the stage's last decoder layer did not run"
            return leaving, torch.zeros_like(leaving)
        finally:
            self._entering = self._leaving = None

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (self._entering, *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise RuntimeError(f"{type(module).__name__} was called without hidden states")
        return args, {**kwargs, "hidden_states": self._entering}

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        self._leaving = hidden[0]  # [1, T, hidden] -> [T, hidden]


def split_stages(model: nn.Module, hf_config: Any) -> StageSlice:
    """Replaces in `model` (a transformers causal LM, still on the meta device) what this
    pipeline stage does not run; ValueError naming base_model_pp_plan when the plan does not
    describe the base model."""
    prefix = model.base_model_prefix
    base = getattr(model, prefix)
    plan = list(getattr(hf_config, PP_PLAN_FIELD, None) or {})

    def refuse(reason: str) -> ValueError:
        return ValueError(f"the Transformers backend cannot split {_name(hf_config)} into "
                          f"pipeline stages: its {PP_PLAN_FIELD} {reason}")

    missing = [name for name in plan if _find(base, name) is None]
    if missing:
        raise refuse(f"names {', '.join(map(repr, missing))}, which "
                     f"{type(base).__name__} does not have")
    lists = [i for i, name in enumerate(plan) if isinstance(_find(base, name), nn.ModuleList)]
    if len(lists) != 1:
        raise refuse(f"has {len(lists)} module lists (one, the decoder layers, is split)")
    at = lists[0]
    layers = base.get_submodule(plan[at])
    start, end = pp_layer_range(len(layers))
    is_first, is_last = pp_is_first(), pp_is_last()
    dropped = []
    for name in plan[:at] if not is_first else []:
        dropped.append(_replace(base, name, prefix))
    for i in range(len(layers)):
        if not start <= i < end:
            dropped.append(_replace(base, f"{plan[at]}.{i}", prefix))
    for name in plan[at + 1:] if not is_last else []:
        dropped.append(_replace(base, name, prefix))
    if not is_first:  # stage 0 samples
        dropped.append(drop_lm_head(model))
    return StageSlice(plan[at], start, end, is_first, is_last, int(hf_config.hidden_size),
                      tuple(dropped))


def drop_lm_head(model: nn.Module) -> str:
    """Replaces the causal LM's output embeddings by OtherStage; returns its name + '.'."""
    head = model.get_output_embeddings()
    for name, child in model.named_children():
        if child is head:
            setattr(model, name, OtherStage())
            return name + "."
    raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")


def _find(base: nn.Module, name: str) -> nn.Module | None:
    try:
        return base.get_submodule(name)
    except AttributeError:
        return None


def _replace(base: nn.Module, name: str, prefix: str) -> str:
    parent_name, _, child = name.rpartition(".")
    parent = base.get_submodule(parent_name)
    setattr(parent, child, OtherStage(getattr(parent, child)))
    return f"{prefix}.{name}."


def _name(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else repr(getattr(hf_config, "model_type", None))
