"""One step's inputs, flattened on the host in the order the model sees them: the scheduler's
requests (decodes first), their tokens and positions, which rows sample, and each request's
runner state as it was when the step was launched (a request may end, and its state be
dropped, before the step is sampled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.core.scheduler_output import PENDING_TOKEN, ScheduledRequest, SchedulerOutput
from shoal.worker.request_state import RequestState

_NO_DRAFTS: list[int] = []  # shared by the rows without drafts; never changed


@dataclass
class StepInputs:
    items: list[ScheduledRequest]
    num_decodes: int
    states: list[RequestState]  # one per item
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # Flat index of the last token of each row that samples (all k + 1 of a verify), the
    # request serial of each sampling request, and its state.
    logits_index: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_states: list[RequestState] = field(default_factory=list)
    # Flat index of a token sampled by the step in flight, and its row in that step's ids.
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    # (request serial, flat start, context length, tokens) of chunks that want prompt logprobs.
    prompt_lp_spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Their prompt positions whose prompt token the model does not read there (EVS's pruned
    # video spans: mm_step.py), by request serial: those prompt logprobs stay None.
    prompt_lp_unread: dict[int, frozenset[int]] = field(default_factory=dict)
    # Speculative decoding: each sampling request's drafts (their k+1 positions give logits).
    drafts: list[list[int]] = field(default_factory=list)
    has_drafts: bool = False
    # Images (shoal/worker/mm_step.py MultiModalStepInputs): the encoder outputs this step
    # places and its M-RoPE positions; set, the step runs eagerly over input embeddings
    mm: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def starts(self) -> list[int]:
        """Each request's first row in the flattened tokens."""
        starts, n = [], 0
        for it in self.items:
            starts.append(n)
            n += it.num_new_tokens
        return starts

    def block_tables(self, group: int = 0) -> list[list[int]]:
        """Each request's block table of a KV cache group (the first: block_ids)."""
        if group == 0:
            return [it.block_ids for it in self.items]
        return [it.group_block_ids[group - 1] for it in self.items]

    def context_lens(self) -> list[int]:
        return [it.context_len for it in self.items]

    def query_lens(self) -> list[int]:
        return [it.num_new_tokens for it in self.items]


def prepare_inputs(sched: SchedulerOutput, states: dict[int, RequestState],
                   pending_rows: dict[int, int]) -> StepInputs:
    """pending_rows: request serial -> its row in the sampled ids of the step before (async
    scheduling fills a PENDING_TOKEN input from there, on the device)."""
    inp = StepInputs(sched.scheduled, sched.num_decodes,
                     [states[it.serial] for it in sched.scheduled])
    for it, st in zip(sched.scheduled, inp.states):
        start = len(inp.input_ids)
        inp.input_ids.extend(it.input_token_ids)
        inp.positions.extend(range(it.context_len, it.context_len + it.num_new_tokens))
        if it.input_token_ids[-1] == PENDING_TOKEN:
            inp.pending_dst.append(len(inp.input_ids) - 1)
            inp.pending_src.append(pending_rows[it.serial])
        if it.sample:
            if it.num_draft_tokens:
                _add_verify_rows(inp, it, st)
            else:  # the usual row: its last token's logits
                inp.logits_index.append(len(inp.input_ids) - 1)
                inp.sample_rows.append(it.serial)
                inp.sample_states.append(st)
                inp.drafts.append(_NO_DRAFTS)
        if (st.sampling_params.prompt_logprobs is not None
                and it.context_len < len(st.prompt_token_ids)):
            inp.prompt_lp_spans.append((it.serial, start, it.context_len, it.num_new_tokens))
    return inp


def _add_verify_rows(inp: StepInputs, it: ScheduledRequest, st: RequestState) -> None:
    """A request verifying k drafts: every one of its k+1 positions gives logits."""
    end, k = len(inp.input_ids), it.num_draft_tokens
    inp.sample_rows.append(it.serial)
    inp.sample_states.append(st)
    inp.logits_index.extend(range(end - 1 - k, end))
    inp.drafts.append(it.input_token_ids[-k:])
    inp.has_drafts = True
