"""CUDA graphs emulated on the CPU: a GraphTable whose replay reruns the captured body eagerly
over the same persistent buffers and copies its outputs into the static ones, as a replay
would leave them. With the Triton backend under TRITON_INTERPRET=1 this runs the GPU graph
path's bookkeeping (padded shapes, staged inputs, buffer fills) on the CPU."""

from __future__ import annotations

from typing import Any

import torch

from shoal.worker.graph_table import GraphTable


class _EagerGraph:
    def __init__(self, fn: Any, out: Any):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        if isinstance(self.out, tuple):
            for dst, src in zip(self.out, new):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)


class EagerGraphTable(GraphTable):
    def capture(self, body, pool=None, what="step", before_each=None) -> float:
        for shape in self.shapes:
            md = self.empty_metadata(shape)
            tokens = self.tokens.view(shape.tokens)
            if before_each is not None:
                before_each()

            def fn(shape=shape, tokens=tokens, md=md):
                return body(shape, tokens, md)

            out = fn()
            self.graphs[shape] = _EagerGraph(fn, out)
            self.outputs[shape] = out
        return 0.0
