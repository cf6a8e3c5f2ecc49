"""Pipeline parallelism: one rank's layers of a step, and the activations between stages.

A rank of stage s > 0 receives (hidden, residual) of every token from stage s - 1 (the rank
of its own TP rank), runs its layers and sends the result on: (hidden, residual) to stage
s + 1, or from the last stage the final hidden states back to stage 0, which holds lm_head and
samples. Sends are non-blocking, so a stage goes on with the next micro-batch whether or not
the next stage has taken the last one. Stage 0 posts its receive of the final hidden states
when it launches a step and waits for them only when the step is sampled (ModelRunner.sample,
which the driver's finish calls), after it has launched the next micro-batch
(engine/step_queue.py).

Every rank runs the steps in the same order, and point-to-point messages between two ranks
are matched in the order they were posted (gloo and NCCL alike): step N's activations never
meet step N+1's receive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shoal.distributed.parallel_state import (
    get_pp_world_size,
    pp_is_first,
    pp_is_last,
    pp_next_rank,
    pp_prev_rank,
    pp_stage_rank,
)


@dataclass
class PendingHidden:
    """Stage 0's view of a launched step: the last stage's final hidden states, on their way."""

    hidden: torch.Tensor
    work: Any  # the irecv's dist.Work

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.hidden


class StageLink:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        # Sends not known to be done, with their tensors: the transfer reads them later.
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def run(self, model: Any, ids: torch.Tensor, pos: torch.Tensor,
            md: object) -> PendingHidden | None:
        """This stage's layers on the step's tokens; on stage 0 the final hidden states to
        come (None on the other stages, which sample nothing)."""
        n = ids.shape[0]
        inter = None
        if not pp_is_first():
            buf = torch.empty(2, n, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(buf, src=pp_prev_rank())  # this stage's input: nothing else to do before
            inter = (buf[0], buf[1])
        out = model.forward_stage(ids, pos, md, inter)
        if pp_is_last():
            self._send(out.contiguous(), pp_stage_rank(0))
        else:
            self._send(torch.stack(out), pp_next_rank())
        if not pp_is_first():
            return None
        final = torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
        return PendingHidden(final, dist.irecv(final, src=pp_stage_rank(get_pp_world_size() - 1)))

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(tensor, dst=dst), tensor))

    def reset(self) -> None:
        """After a failed step: what it had sent is of no interest any more."""
        self._sends = []
