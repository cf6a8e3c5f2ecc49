"""Filling a transformers model from shoal's weight stream. Checkpoints keep their original
layout while the modeling code may have moved on (transformers 5 fuses MoE experts into one
tensor, renames legacy prefixes): the model's own conversion mapping (the one
`from_pretrained` applies) renames each tensor, and gathers the ones a converter merges
(each expert's projections) until they are all in. A tensor-parallel layer's parameter
(tensor_parallel.py) takes the whole tensor through its weight loader, which keeps this
rank's slice."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class _Gathered:
    """The checkpoint tensors one converter merges into a parameter, as they arrive."""

    converter: Any  # a transformers WeightConverter of its own
    parts: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)  # name, pattern
    numel: int = 0


@torch.no_grad()
def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    owns: Callable[[str], bool] | None = None) -> set[str]:
    """Copies the checkpoint tensors into `model` (a transformers PreTrainedModel); returns
    the names of the parameters and buffers filled. `owns(name)` False: a module this model
    left out (another pipeline stage's, a pooling model's LM head), whose tensors are
    skipped. Raises ValueError for a tensor that has no place in the model or the wrong
    shape."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    targets = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    loaded: set[str] = set()
    gathered: dict[str, _Gathered] = {}  # by the (first) parameter they convert to
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):  # old checkpoints stored the buffer
            continue
        key, pattern = rename_source_key(name, renamings, converters, prefix, targets)
        if owns is not None and key not in targets and not (
                owns(key) and owns(f"{prefix}.{key}")):
            continue  # (a base model's checkpoint names it without the prefix)
        if key not in targets:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                             f"{type(model).__name__}")
        if pattern is None:
            _copy(targets[key], tensor, name)
            loaded.add(key)
            continue
        g = gathered.setdefault(key, _Gathered(copy.deepcopy(by_pattern[pattern])))
        g.parts.append((name, pattern, tensor))
        g.numel += tensor.numel()
        # A merge keeps every element: once the parameter's worth is in, convert now rather
        # than hold a whole MoE checkpoint's experts to the end (a split parameter holds a
        # rank's share of the elements: its parts wait for the end).
        if (g.numel == targets[key].numel()
                and getattr(targets[key], "weight_loader", None) is None):
            loaded |= _convert(model, targets, key, gathered.pop(key))
    for key, g in gathered.items():  # conversions that change sizes: at the end
        loaded |= _convert(model, targets, key, g)
    return loaded


def _convert(model: nn.Module, targets: dict[str, torch.Tensor], key: str,
             g: _Gathered) -> set[str]:
    from transformers.core_model_loading import dot_natural_key

    # natural order (experts.2 before experts.10): converters stack in list order
    for name, pattern, tensor in sorted(g.parts, key=lambda p: dot_natural_key(p[0])):
        g.converter.add_tensor(key, name, pattern, tensor)
    done = set()
    for target, value in g.converter.convert(key, model=model, config=model.config).items():
        value = value[0] if isinstance(value, list) else value
        if target not in targets:
            raise ValueError(f"checkpoint tensors {sorted(p[0] for p in g.parts)[:3]} "
                             f"convert to {target!r}, which {type(model).__name__} lacks")
        _copy(targets[target], value, target)
        done.add(target)
    return done


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    loader = getattr(dst, "weight_loader", None)
    if loader is not None:  # a tensor-parallel layer's: it keeps this rank's slice
        try:
            loader(dst, src.to(dst.dtype))
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        return
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model "
                         f"expects {tuple(dst.shape)}")
    dst.copy_(src)
