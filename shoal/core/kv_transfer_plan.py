"""The per-step copies the scheduler asks of the model runner (plain data, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVTransferPlan:
    """Run before the step's forward pass, stores first: a device block being reused must be
    copied out before anything overwrites it, and a load may read a CPU slot that a store of
    this same step fills."""

    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (CPU slot, device block)
    # Set when the connector hands the plan out; the runner reports it back once the copies
    # have completed (ModelRunnerOutput.kv_transfers_done).
    plan_id: int = -1

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)
