"""The model runner's state of one request: what its sampling reads (prompt, outputs so far,
params, seeded generator). Kept by request serial (ScheduledRequest.serial), never by the
caller's id: an id may be reused while a step holding its old request is in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.core.scheduler_output import NewRequestData
from shoal.lora_request import LoRARequest
from shoal.multimodal.inputs import MultiModalFeature
from shoal.sample.sampling_metadata import make_generator
from shoal.sampling_params import SamplingParams


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    lora: LoRARequest | None = None
    mm_features: list[MultiModalFeature] | None = None  # its images (the encoder reads them)
    # A hidden-state drafter's rows it has not mirrored yet (spec_decode/mirror_backlog.py)
    drafter_backlog: Any = None

    @classmethod
    def of(cls, new: NewRequestData, device: torch.device) -> RequestState:
        sp = new.sampling_params
        gen = make_generator(sp.seed, device) if sp.seed is not None else None
        return cls(new.prompt_token_ids, sp, new.eos_token_ids, gen,
                   list(new.output_token_ids), new.lora, new.mm_features)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids()[start:end], without copying the whole context."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
