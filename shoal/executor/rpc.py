"""collective_rpc over the ranks: every rank runs the named lifecycle method (shoal/worker/
lifecycle.py) and the results, or each rank's error, are gathered over the ranks' process
group, so a rank that fails never leaves the others waiting in a collective and never dies
of a bad argument (all ranks see the same arguments and fail alike)."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from shoal.worker.lifecycle import RPC_METHODS

logger = logging.getLogger(__name__)


def check_rpc_method(method: str) -> None:
    if method not in RPC_METHODS:
        raise ValueError(f"collective_rpc: unknown method {method!r} (one of "
                         f"{', '.join(sorted(RPC_METHODS))})")


def gather_rpc(runner: Any, method: str, args: list[Any], raise_errors: bool = False
               ) -> list[Any]:
    """Runs the method here and gathers every rank's (result, error); the driver
    (raise_errors) raises the first error as a ValueError naming its rank."""
    try:
        mine: tuple[Any, str | None] = (runner.rpc(method, args), None)
    except Exception as e:  # reported through the gather, never raised on a worker rank
        logger.warning("collective_rpc %s failed on this rank: %s", method, e)
        mine = (None, f"{type(e).__name__}: {e}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if raise_errors:
        for rank, (_, error) in enumerate(gathered):
            if error is not None:
                raise ValueError(f"{method} failed on rank {rank}: {error}")
    return [result for result, _ in gathered]
