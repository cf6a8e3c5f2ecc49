"""CUDA graphs of a vision tower, one per image grid (the common image sizes of a workload
repeat: a camera's, a UI's, a benchmark's). Videos and images over max_patches run eagerly:
their grids seldom repeat, and each graph keeps its activations' peak memory.
The tower's host work for a grid (its plan: window order, rotary positions, attention
segments, position-table corners) is made once, outside the graph; a replay copies the
image's patches into the graph's input and runs every block as one launch, which an eager
forward pays per kernel. A tower's output is a tensor (Qwen2.5-VL) or tuples and lists of
them (Qwen3-VL: the merged tokens and the deepstack features); a replay hands back a copy
of the whole of it.

Graphs are captured lazily, the first time a grid is seen, up to `max_graphs`; other grids
run eagerly. They share one memory pool. CUDA only (the CPU has no graphs)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from shoal.worker.graph_table import capture_stream

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    input: torch.Tensor  # [patches, patch_dim]: the replay reads the image's patches here
    output: Any  # the tower's output (tensors, tuples, lists): a replay overwrites its tensors
    plan: Any  # the tower's plan for the grid (its tensors must outlive the graph)


class EncoderGraphs:
    def __init__(self, tower: Any, device: torch.device, max_graphs: int = 8,
                 max_patches: int = 16384):
        """tower: has dtype, plan(grid_thw) and forward_planned(pixel_values, plan).
        max_patches: the largest image graphed (16,384 patches: about 1,800 x 1,800 pixels
        at Qwen's 14-pixel patches)."""
        self.tower, self.device, self.max_graphs = tower, device, max_graphs
        self.max_patches = max_patches
        self.graphs: dict[tuple[int, ...], _Graph] = {}
        self.pool: Any = None
        self.num_replays = 0

    def run(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> Any:
        """The tower's output for one image or video (a copy, the graph's own is overwritten
        by the next replay), shaped as forward_planned's; None when the grid has no graph
        and no more may be captured."""
        if pixel_values.shape[0] != math.prod(grid):  # not the grid's patches: the eager
            return None                                # path says what is wrong with them
        g = self.graphs.get(grid)
        if g is None:
            if (len(self.graphs) >= self.max_graphs or grid[0] != 1
                    or pixel_values.shape[0] > self.max_patches):
                # (a video's grids seldom repeat, and a graph holds its activations' peak
                # for good: images of up to max_patches patches only)
                return None
            g = self.graphs[grid] = self._capture(grid, pixel_values.shape)
        if pixel_values.shape != g.input.shape:
            return None
        g.input.copy_(pixel_values, non_blocking=True)
        g.graph.replay()
        self.num_replays += 1
        return _clone(g.output)

    def _capture(self, grid: tuple[int, ...], shape: torch.Size) -> _Graph:
        plan = self.tower.plan(torch.tensor([list(grid)]))
        inp = torch.zeros(shape, dtype=self.tower.dtype, device=self.device)
        graph, out = self._record(inp, plan)
        logger.info("vision encoder: CUDA graph captured for grid %s (%d patches)", grid,
                    shape[0])
        return _Graph(graph, inp, out, plan)

    def _record(self, inp: torch.Tensor, plan: Any) -> tuple[Any, Any]:
        """The graph of forward_planned over `inp` and its output (the CUDA part)."""
        side = capture_stream(self.device)  # warm-up off the capturing stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.tower.forward_planned(inp, plan)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.tower.forward_planned(inp, plan)
        self.pool = graph.pool()
        return graph, out


def _clone(out: Any) -> Any:
    """A copy of a tower's output: a tensor, or tuples and lists of them."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(x) for x in out)
    raise TypeError(f"a vision tower's output holds a {type(out).__name__}; encoder graphs "
                    "hold tensors, tuples and lists of them")
