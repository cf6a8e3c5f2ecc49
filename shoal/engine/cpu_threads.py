"""How many threads the model gets on the CPU, chosen rather than inherited.

A CPU engine runs the model's matmuls (oneDNN's bfloat16 ones, MKL's float32 ones, the int4
kernel, shoal's C++ kernels) on the OpenMP threads of one runtime, torch's libgomp, which
take their count from torch.set_num_threads on the thread that runs the model. Those threads
spin while they wait for each other. When another process takes one of their cores, every
parallel region waits for the thread that lost its core: on a 2-core AMD EPYC, bfloat16
batch-1 decode made 70-82 tok/s quiet and 19-30 beside one busy-looping process with two
threads, 63 with one (OMP_WAIT_POLICY=PASSIVE: 48 quiet, 54 busy: sleeping threads cost
every region a wake-up). So the count is chosen:
- from what the process can really use: its affinity mask and cgroup quota (cpu_quota.py),
  and never more than torch's own count (physical cores, OMP_NUM_THREADS, or what the
  program set with torch.set_num_threads);
- for the server, one core less, left to its frontend process; its engine process is also
  spawned with sleeping OpenMP threads (OMP_WAIT_POLICY=PASSIVE, read when the runtime
  starts) because the frontend's load comes in bursts;
- then, unless `cpu_threads` pins it, adapted while the engine runs to the CPU that other
  processes leave it (cpu_governor.py)."""

from __future__ import annotations

import os

from shoal.engine.cpu_quota import usable_cores

# Set for the engine process at spawn, unless the user chose otherwise.
SERVING_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}

# (count this module last gave torch, torch's count before that): a second engine in the
# same process starts from torch's count, not from what an earlier one adapted it to.
_ours: tuple[int, int] | None = None


def choose_cpu_threads(requested: int | None, serving: bool, cores: int,
                       torch_threads: int) -> int:
    """`requested` if given; else the usable cores (less one for the frontend when the engine
    serves HTTP from another process), at most torch's own count."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1 (got {requested})")
        return requested
    free = max(1, cores - 1) if serving else cores
    return max(1, min(free, torch_threads))


def torch_threads() -> int:
    """torch's intra-op thread count as the program (or torch's default) left it."""
    import torch

    n = torch.get_num_threads()
    if _ours is not None and n == _ours[0]:
        return _ours[1]
    return n


def set_model_threads(n: int) -> None:
    """torch.set_num_threads(n), remembered as this module's own setting. Called on the
    thread that runs the model: OpenMP keeps the count per calling thread."""
    global _ours
    import torch

    before = torch_threads()
    torch.set_num_threads(n)
    _ours = (n, before)


def configure_cpu_threads(device_type: str, requested: int | None, serving: bool) -> int | None:
    """Sets torch's intra-op threads for a CPU engine; returns the count (None on a GPU,
    where the host threads only launch kernels and torch's default stands)."""
    if device_type != "cpu":
        return None
    n = choose_cpu_threads(requested, serving, usable_cores(), torch_threads())
    set_model_threads(n)
    return n


def spawn_env() -> dict[str, str]:
    """The variables to add to the engine process's environment (those the user has not
    set already)."""
    return {k: v for k, v in SERVING_ENV.items() if k not in os.environ}
