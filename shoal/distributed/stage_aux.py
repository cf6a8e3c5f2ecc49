"""EAGLE-3's auxiliary hidden states under pipeline parallelism: which stage records which.

The head reads the residual stream entering a few target layers (aux layers, in the head's
order; the id num_layers is the last layer's output). Each stage records the aux layers it
owns: those of its own layers (the state entering layer i, start <= i < end, is what the
stage holding layer i sees first; a stage's output is the next stage's input and recorded
there), and the last stage the id num_layers. Stage 0 drafts, so its own states stay home;
those of stages 1..P-1 travel behind the activations (worker/stage_link.py): stage s > 0
receives the states of stages 1..s-1 beside (hidden, residual), appends its own and sends
them on, and the last stage sends them all to stage 0 with the final hidden states. Stage 0
then has its own states and the travelling ones, and puts them back in the head's order.

Pure arithmetic over the stages' layer ranges, so any split can be checked without ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AuxRoute:
    """One stage's part in moving the aux states to stage 0."""

    layers: tuple[int, ...]  # the head's aux layers, in its order
    own: tuple[int, ...]  # recorded by this stage (in the head's order)
    # states arriving with the activations: from the previous stage (stage 0: from the last)
    received: int
    # stage 0: for each of `layers`, its row in own + received (None: that order already)
    order: tuple[int, ...] | None = None


def owner(layer: int, ranges: list[tuple[int, int]]) -> int:
    """The stage that records the state entering `layer` (ranges: [start, end) per stage)."""
    if layer == ranges[-1][1]:  # the last layer's output
        return len(ranges) - 1
    for stage, (start, end) in enumerate(ranges):
        if start <= layer < end:
            return stage
    raise ValueError(f"aux hidden state layer {layer} is outside the model's layers "
                     f"[0, {ranges[-1][1]}]")


def aux_route(layers: tuple[int, ...], ranges: list[tuple[int, int]], stage: int) -> AuxRoute:
    """The route of `stage` (of len(ranges) stages) for aux `layers`."""
    owners = [owner(i, ranges) for i in layers]
    own = tuple(i for i, s in zip(layers, owners) if s == stage)
    if stage > 0:
        return AuxRoute(layers, own, sum(1 for s in owners if 0 < s < stage))
    # stage 0's rows: its own, then stage 1's, 2's, ... (each in the head's order)
    rows = sorted(range(len(layers)), key=lambda j: owners[j])  # (a stable sort)
    order = tuple(rows.index(j) for j in range(len(layers)))
    identity = order == tuple(range(len(layers)))
    return AuxRoute(layers, own, len(layers) - len(own), None if identity else order)
