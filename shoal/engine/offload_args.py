"""The weight offloading engine argument (vLLM's `cpu_offload_gb`), kept beside EngineArgs,
which inherits it; the mechanism is shoal/loader/weight_offload.py. Torch-free: the server's
frontend reads EngineArgs too."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


@dataclass
class WeightOffloadArgs:
    cpu_offload_gb: float = field(default=0.0, metadata={"help": (
        "GiB of the model's weights per GPU kept in pinned host memory and copied to the "
        "device, layer by layer, as each forward pass needs them: whole decoder layers from "
        "the first while they fit (never more than this), so a model larger than the GPU "
        "runs, slower; the device memory freed goes to the KV cache. 0: none; on a CPU engine "
        "it does nothing")})

    # Tests exercise the mechanism on the CPU (where the host copy and the "device" buffer
    # are both host memory); a CPU engine otherwise treats the argument as a no-op.
    offload_on_cpu: ClassVar[bool] = False

    def weight_offload_bytes(self, device: Any) -> int:
        """This rank's budget in bytes for an engine on `device` (a torch.device); a
        ValueError naming the field when the value is bad."""
        gb = self.cpu_offload_gb
        if (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb)
                or gb < 0):
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0 (got {gb!r})")
        if gb == 0:
            return 0
        if device.type == "cpu" and not self.offload_on_cpu:
            # vLLM's CPU backend ignores it silently: the weights are in host memory already.
            logger.warning("cpu_offload_gb=%s does nothing on a CPU engine: its weights are "
                           "in host memory already", gb)
            return 0
        return int(gb * 2**30)
