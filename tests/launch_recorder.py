"""Records Triton kernel launches in a test: kernel[grid](*args) through a stand-in that
appends (name, grid, argument shapes) and then launches, so a test can check which kernels a
path runs and that their grids and buffers follow the shapes only (CUDA-graph safety)."""

from __future__ import annotations

from typing import Any

import torch


class _Recorder:
    def __init__(self, name: str, kernel: Any, launches: list) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kw: Any) -> Any:
            self.launches.append((self.name, grid, [
                tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]))
            return self.kernel[grid](*args, **kw)
        return launch


def record_launches(monkeypatch: Any, launches: list, targets: list[tuple[Any, str]]) -> None:
    """Every launch of each (module, kernel attribute name) in targets appended to launches
    as (name, grid, [argument shape or value])."""
    for module, name in targets:
        monkeypatch.setattr(module, name, _Recorder(name, getattr(module, name), launches))
