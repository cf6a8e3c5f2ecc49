"""Counts the host work of a drafter's proposals: top-level torch calls (what the host pays a
Python dispatch for, ~10-20 us each on a GPU machine's slow CPU) and host reads of tensor
values (each a wait for the device on a GPU). A TorchFunctionMode sees each call made from
Python once; the calls a torch function makes inside itself are not counted again. What is
one launch on a GPU (a Triton kernel, a CUDA graph's replay) counts as one op, however many
torch calls its CPU stand-in (the Triton interpreter, an emulated replay) makes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch.overrides import TorchFunctionMode

# Reads of a tensor's values by the host: on a GPU each waits for the queued work.
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
              "nonzero", "masked_select", "unique", "cpu"}
# Attribute reads, not work.
_FREE = {"__get__", "shape", "dtype", "device", "size", "dim", "is_cuda", "numel",
         "data_ptr", "stride", "is_contiguous", "__len__", "ndim"}


class HostOps(TorchFunctionMode):
    """ops: torch calls from Python (attribute reads left out) and launches; reads: host
    reads among them."""

    active: HostOps | None = None  # the counter launches report to

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0
        self.muted = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        name = getattr(func, "__name__", "")
        if not self.muted and name not in _FREE:
            self.ops += 1
            self.reads += name in HOST_READS
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostOps:
        HostOps.active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        HostOps.active = None
        super().__exit__(*exc)


def one_launch(fn: Any) -> Any:
    """fn counted as one op (a launch) by the active counter, its own torch calls not."""
    @functools.wraps(fn)
    def launch(*args: Any, **kwargs: Any) -> Any:
        mode = HostOps.active
        if mode is None or mode.muted:
            return fn(*args, **kwargs)
        mode.ops += 1
        mode.muted += 1
        try:
            return fn(*args, **kwargs)
        finally:
            mode.muted -= 1
    return launch


@contextlib.contextmanager
def triton_launches_count_once() -> Iterator[None]:
    """Each Triton kernel launch (interpreted on the CPU) one op while inside."""
    from triton.runtime.interpreter import InterpretedFunction

    inner = InterpretedFunction.run
    InterpretedFunction.run = one_launch(inner)
    try:
        yield
    finally:
        InterpretedFunction.run = inner


class ProposalOps:
    """Per proposing call of a hidden-state drafter's mirror_and_propose (propose=True, some
    drafts out): its ops and host reads, and how many requests it drafted for. The drafter's
    draft graphs' and mirror graphs' replays (emulated) count one op each."""

    def __init__(self, drafter: Any) -> None:
        self.calls: list[tuple[int, int, int]] = []  # (requests, ops, reads)
        inner = drafter.mirror_and_propose
        for graphs in (drafter.graphs, getattr(drafter, "mirror_graphs", None)):
            if graphs is not None:
                graphs.table.replay = one_launch(graphs.table.replay)

        def counted(reqs, hidden, failed, propose=True):
            with HostOps() as mode:
                drafts = inner(reqs, hidden, failed, propose=propose)
            if propose and drafts:
                self.calls.append((len(drafts), mode.ops, mode.reads))
            return drafts
        drafter.mirror_and_propose = counted

    def at_batch(self, n: int) -> list[tuple[int, int]]:
        """(ops, reads) of the proposing calls that drafted for n requests."""
        return [(o, r) for b, o, r in self.calls if b == n]
