"""A sampled step's results on their way to the host, and reading them into plain data.

The sampled token ids (with a finiteness flag per row, and for a verify step whether each
row's draft was accepted) are packed into one tensor and copied to the host behind the step,
with the logprobs if any row asked for them; on CUDA an event marks their arrival, so nothing
waits until the engine reads the step's results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.core.types import Logprobs
from shoal.sample.sampler import LogprobsTensors
from shoal.sample.verify import VerifyRows


@dataclass
class HostCopy:
    """packed: [fields, rows] int64; logprobs of the rows that asked; event: arrival (CUDA)."""

    packed: torch.Tensor
    logprobs: LogprobsTensors | None
    event: torch.cuda.Event | None

    @classmethod
    def queue(cls, packed: torch.Tensor, logprobs: LogprobsTensors | None) -> HostCopy:
        """Copies to the host behind the step (already there on the CPU)."""
        if packed.device.type != "cuda":
            return cls(packed, logprobs, None)
        host = packed.to("cpu", non_blocking=True)
        if logprobs is not None:
            logprobs = LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in
                                         (logprobs.token_ids, logprobs.logprobs,
                                          logprobs.ranks)))
        event = torch.cuda.Event()
        event.record()
        return cls(host, logprobs, event)

    def wait(self, wanted: list[int | None]) -> tuple[list[list[int]], list[Logprobs | None]]:
        """The packed rows as lists and each row's logprobs (wanted[i]: how many row i asked
        for, None: none)."""
        if self.event is not None:
            self.event.synchronize()
        return self.packed.tolist(), logprobs_rows(self.logprobs, wanted)


@dataclass
class SampledRows:
    """One token per sampling request: packed is [token ids, finite]."""

    copy: HostCopy
    serials: list[int]
    states: Sequence[Any]  # the runner's RequestState of each (outputs appended on read)
    wanted: list[int | None]

    def read(self, out: ModelRunnerOutput) -> None:
        (sampled, finite), lp_rows = self.copy.wait(self.wanted)
        for i, (serial, st) in enumerate(zip(self.serials, self.states)):
            if not finite[i]:
                # The scheduler withdraws and zeroes its blocks: it knows who owns them.
                out.failed_serials.add(serial)
                continue
            st.output_token_ids.append(sampled[i])
            out.sampled_token_ids[serial] = sampled[i]
            if lp_rows[i] is not None:
                out.logprobs[serial] = lp_rows[i]


@dataclass
class VerifiedRows:
    """k + 1 rows per request with k drafts: packed is [tokens, accepted, finite]."""

    copy: HostCopy
    serials: list[int]
    states: Sequence[Any]
    wanted: list[int | None]  # per row
    rows: VerifyRows

    def read(self, out: ModelRunnerOutput) -> None:
        packed, lp_rows = self.copy.wait(self.wanted)
        self.rows.read(packed, lp_rows, self.serials, self.states, out)


def logprobs_rows(lt: LogprobsTensors | None, wanted: list[int | None]
                  ) -> list[Logprobs | None]:
    if lt is None:
        return [None] * len(wanted)
    ids, lps, ranks = lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist()
    rows: list[Logprobs | None] = []
    for i, k in enumerate(wanted):
        if k is None:
            rows.append(None)
        else:
            rows.append(Logprobs(token_ids=ids[i][: k + 1], logprobs=lps[i][: k + 1],
                                 rank=ranks[i]))
    return rows
