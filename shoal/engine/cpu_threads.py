"""How many threads the model gets on the CPU, chosen rather than inherited.

A CPU engine runs the model's matmuls on OpenMP threads that, by default, spin while they
wait for each other. When another process takes one of their cores (the server's frontend,
a load generator, anything else on a laptop), every parallel region waits a scheduler slice
for the thread that lost its core: a 2-core machine measured 3.4 tokens/s at batch 1 with
two spinning threads under load against 17.7 with sleeping ones. So the engine process
of the server is started with sleeping OpenMP threads (OMP_WAIT_POLICY=PASSIVE, read when
the OpenMP runtime starts, so it is set in the environment the process is spawned with)
and leaves one core to the frontend; the offline engine uses every core it is allowed."""

from __future__ import annotations

import os

# Set for the engine process at spawn, unless the user chose otherwise.
SERVING_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_cpu_threads(requested: int | None, serving: bool) -> int:
    """`requested` if given; else every available core, less one for the frontend when the
    engine serves HTTP from another process."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1 (got {requested})")
        return requested
    cores = available_cores()
    return max(1, cores - 1) if serving else cores


def configure_cpu_threads(device_type: str, requested: int | None, serving: bool) -> int | None:
    """Sets torch's intra-op threads for a CPU engine; returns the count (None on a GPU,
    where the host threads only launch kernels and torch's default stands)."""
    if device_type != "cpu":
        return None
    import torch

    n = choose_cpu_threads(requested, serving)
    torch.set_num_threads(n)
    return n


def spawn_env() -> dict[str, str]:
    """The variables to add to the engine process's environment (those the user has not
    set already)."""
    return {k: v for k, v in SERVING_ENV.items() if k not in os.environ}
