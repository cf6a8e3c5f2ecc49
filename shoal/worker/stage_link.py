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
meet step N+1's receive.

EAGLE-3 (the target records aux hidden states: shoal/distributed/stage_aux.py): the states
a later stage records travel as further [tokens, hidden] planes behind (hidden, residual)
and, from the last stage, behind the final hidden states; stage 0 keeps a copy of its own
(the next micro-batch overwrites its buffer) and puts them all in the head's order once the
step is back (PendingHidden.aux_states)."""

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
from shoal.distributed.stage_aux import AuxRoute


@dataclass
class PendingHidden:
    """Stage 0's view of a launched step: the last stage's final hidden states, on their way."""

    hidden: torch.Tensor
    work: Any  # the irecv's dist.Work
    # EAGLE-3: stage 0's own aux states [tokens, own * hidden], the received ones [r, tokens,
    # hidden] (planes of the buffer `hidden` is plane 0 of) and their route
    own_aux: torch.Tensor | None = None
    received_aux: torch.Tensor | None = None
    route: AuxRoute | None = None

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.hidden

    def aux_states(self) -> torch.Tensor | None:
        """After wait(): every aux state, [tokens, len(layers) * hidden] in the head's
        order, as one stage's aux_buffer holds them (None without EAGLE-3)."""
        route = self.route
        if route is None:
            return None
        n, h = self.hidden.shape
        parts = []
        if self.own_aux is not None:
            parts.append(self.own_aux.view(n, -1, h))
        if self.received_aux is not None:
            parts.append(self.received_aux.transpose(0, 1))
        planes = torch.cat(parts, dim=1)  # [tokens, layers, hidden]: own, then received
        if route.order is not None:
            planes = planes[:, list(route.order)]
        return planes.reshape(n, -1)


class StageLink:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        # Sends not known to be done, with their tensors: the transfer reads them later.
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def run(self, model: Any, ids: torch.Tensor, pos: torch.Tensor,
            md: object) -> PendingHidden | None:
        """This stage's layers on the step's tokens; on stage 0 the final hidden states to
        come (None on the other stages, which sample nothing)."""
        n, h = ids.shape[0], self.hidden_size
        route: AuxRoute | None = getattr(getattr(model, "model", None), "aux_route", None)
        received = route.received if route is not None else 0
        inter, aux_in = None, []
        if not pp_is_first():
            buf = torch.empty(2 + received, n, h, dtype=self.dtype, device=self.device)
            dist.recv(buf, src=pp_prev_rank())  # this stage's input: nothing else to do before
            inter = (buf[0], buf[1])
            aux_in = [buf[2:]] if received else []
        out = model.forward_stage(ids, pos, md, inter)
        own = route is not None and bool(route.own)
        own_aux = model.model.aux_buffer[:n] if own else None
        if not pp_is_first() and own_aux is not None:  # on its way with the activations
            aux_in.append(own_aux.view(n, -1, h).transpose(0, 1))
        head = out.contiguous()[None] if pp_is_last() else torch.stack(out)
        message = torch.cat([head, *aux_in]) if aux_in else head
        self._send(message, pp_stage_rank(0) if pp_is_last() else pp_next_rank())
        if not pp_is_first():
            return None
        final = torch.empty(1 + received, n, h, dtype=self.dtype, device=self.device)
        work = dist.irecv(final, src=pp_stage_rank(get_pp_world_size() - 1))
        return PendingHidden(final[0], work,
                             own_aux.clone() if own_aux is not None else None,
                             final[1:] if received else None, route)

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(tensor, dst=dst), tensor))

    def reset(self) -> None:
        """After a failed step: what it had sent is of no interest any more."""
        self._sends = []
