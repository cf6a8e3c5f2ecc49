"""One step's forward pass: through a CUDA graph when the step's shape has one (worker/
model_graphs.py), else eagerly with the attention backend's metadata, or, with pipeline
parallelism, this stage's layers with the final hidden states still on their way from the
last stage. Gives the logits of the step's sampling rows, the prompt logprobs of chunks that
asked for them, and every token's final hidden states when a drafter reads them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.linear_state import StateSpecInputs, build_state_metadata
from shoal.attention.metadata import GroupedMetadata
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.core.types import Logprobs
from shoal.host_to_device import to_device
from shoal.layers.linear_attention import LinearAttention
from shoal.layers.linear_replays import ReplaySlots
from shoal.sample.host_rows import logprobs_rows
from shoal.sample.sampler import compute_logprobs_tensors
from shoal.worker.model_graphs import ModelGraphs
from shoal.worker.pending_tokens import PendingTokens
from shoal.worker.stage_link import PendingHidden, StageLink
from shoal.worker.step_inputs import StepInputs


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # the sampling rows' (inp.logits_index order); None: none samples
    hidden: torch.Tensor | None  # every token's final hidden state, when kept for a drafter
    # hidden is (a view of) a CUDA graph's static output, which the next replay overwrites
    hidden_static: bool = False
    # pipeline stage 0: every stage's EAGLE-3 aux states of the step, in the head's order
    # (None: read the model's aux_buffer, or no EAGLE-3)
    aux: torch.Tensor | None = None
    # a verify graph's padded row of each real token (None: in order, first): where the
    # graph wrote them in the model's per-token buffers (EAGLE-3's aux_buffer)
    rows: torch.Tensor | None = None

    def wait(self) -> ForwardOutput:
        return self


@dataclass
class StageOutput:
    """Pipeline parallelism, stage 0: the last stage's final hidden states are on their way;
    wait() receives them and computes the logits (other stages: nothing to wait for)."""

    pending: PendingHidden
    complete: Callable[[torch.Tensor], ForwardOutput]

    def wait(self) -> ForwardOutput:
        out = self.complete(self.pending.wait())
        out.aux = self.pending.aux_states()
        return out


class StepForwarder:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 block_size: int, windows: tuple[int | None, ...], pending: PendingTokens,
                 stage_link: StageLink | None = None, *,
                 state_groups: tuple[bool, ...] = (), save_states: bool = False):
        """windows: each KV cache group's sliding window (None: full attention);
        state_groups: which groups hold linear-attention states (their metadata says where
        each request's state is), whose states at block ends are kept when save_states
        (prefix caching)."""
        self.model, self.backend, self.device = model, backend, device
        self.block_size, self.windows = block_size, windows
        self.state_groups = state_groups or (False,) * len(windows)
        self.save_states = save_states
        # Linear-attention layers under speculative decoding: verify steps and replays, the
        # slots of their kept inputs (enable_state_replays)
        self.state_replays = False
        self.replay_slots: ReplaySlots | None = None
        self.pending = pending
        self.stage_link = stage_link
        self.graphs: ModelGraphs | None = None  # once captured
        self.keep_hidden = False  # a drafter reads every token's hidden states
        self.null_block = 0  # the zeroed block padding reads (set when the cache is bound)
        # LoRA (shoal/lora/layers.py LoRAStep): its token -> slot table is in the step's flat
        # order, which a verify graph's padded rows do not follow
        self.lora_step: Any = None


    def run(self, inp: StepInputs, out: ModelRunnerOutput) -> ForwardOutput | StageOutput:
        if self.stage_link is not None:  # pipeline parallel: stage 0 samples once it is back
            staged = self.stage_link.run(self.model, *self.eager_inputs(inp))
            if staged is None:
                return ForwardOutput(None, None)
            return StageOutput(staged, lambda hidden: self._from_hidden(inp, out, hidden))
        shape = self.graphs.pick(inp) if self.graphs is not None and inp.mm is None else None
        if shape is not None and shape.q > 1 and shape.rows > 1 and self.lora_step is not None \
                and self.lora_step.active:
            # A verify step of several requests with adapters runs eagerly: the LoRA slot
            # table is in the step's flat order, which the graph's padded rows do not follow
            # (one row, a lone prefill or verify, pads after its tokens: the same order).
            shape = None
        if shape is None:
            return self._from_hidden(inp, out, self._eager(inp))
        spec = self._state_spec(inp)
        logits, hidden, rows = self.graphs.run(
            shape, inp, self.pending.filler(inp.pending_dst, inp.pending_src),
            **({"state_spec": spec} if spec is not None else {}))
        return ForwardOutput(logits, hidden, hidden_static=True, rows=rows)

    def enable_state_replays(self, max_requests: int, tokens: int, dtype: torch.dtype) -> None:
        """Speculative decoding on linear-attention layers: each keeps the inputs of up to
        `tokens` verified tokens of max_requests requests (shoal/layers/linear_replays.py).
        Nothing for a model without them."""
        if not any(self.state_groups):
            return
        # (engine/cache_args.py turns prefix caching off: verify graphs save no block ends)
        assert not self.save_states, "prefix caching with replays of linear-attention states"
        layers = [a for a in self.model.attention_layers() if isinstance(a, LinearAttention)]
        for layer in layers:
            layer.keep_replays(max_requests, tokens, dtype)
        self.replay_slots = ReplaySlots(max_requests, layers)
        self.state_replays = True

    def forget_replays(self, serials: set[int]) -> None:
        """Requests that ended or came back after preemption: their kept inputs go."""
        if self.replay_slots is not None:
            self.replay_slots.forget(serials)

    def _eager(self, inp: StepInputs) -> torch.Tensor:
        ids, pos, md = self.eager_inputs(inp)
        mm = inp.mm
        if mm is None:
            return self.model(ids, pos, md)
        embeds = (self.model.embed_input_ids(ids, mm.rows, mm.mask)
                  if mm.rows is not None else None)
        return self.model(ids, mm.positions if mm.positions is not None else pos, md,
                          inputs_embeds=embeds)

    def eager_inputs(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Token ids, positions and attention metadata of an eager forward pass."""
        if self.graphs is not None:
            self.graphs.invalidate_tables()  # a preempted request may come back re-blocked
        ids = self.device_input_ids(inp)
        pos = to_device(inp.positions, torch.long, self.device)
        md = self.metadata(inp.query_lens(), inp.context_lens(),
                           [inp.block_tables(g) for g in range(len(self.windows))],
                           inp.num_decodes, self._state_spec(inp))
        return ids, pos, md

    def _state_spec(self, inp: StepInputs) -> StateSpecInputs | None:
        """The replays and verify rows of a step, for linear-attention layers (call once a
        step: it takes and gives back replay slots)."""
        if not self.state_replays or not (inp.has_drafts or any(it.replay for it in inp.items)):
            return None
        assert self.replay_slots is not None
        replay = [it.replay for it in inp.items]
        verify = [it.num_draft_tokens > 0 for it in inp.items]
        return StateSpecInputs(replay, verify, self.replay_slots.assign(
            [it.serial for it in inp.items], replay, verify))

    def metadata(self, query_lens: list[int], context_lens: list[int],
                 tables: list[list[list[int]]], num_decodes: int,
                 spec: StateSpecInputs | None = None) -> Any:
        """The attention metadata of eager steps: one per KV cache group (tables[g]: its
        block tables), grouped when there are several."""
        mds = [build_state_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=t,
            block_size=self.block_size, num_decodes=num_decodes, device=self.device,
            null_block=self.null_block, save_block_ends=self.save_states, spec=spec) if state else
            self.backend.build_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=t,
            block_size=self.block_size, num_decodes=num_decodes, sliding_window=w,
            device=self.device, null_block=self.null_block)
            for t, w, state in zip(tables, self.windows, self.state_groups)]
        return GroupedMetadata.of_groups(mds)

    def device_input_ids(self, inp: StepInputs) -> torch.Tensor:
        """The step's input ids on the device, pending tokens filled in (a draft model mirrors
        the target's step over them)."""
        ids = to_device(inp.input_ids, torch.long, self.device)
        fill = self.pending.filler(inp.pending_dst, inp.pending_src)
        if fill is not None:
            fill(ids)
        return ids

    def _from_hidden(self, inp: StepInputs, out: ModelRunnerOutput,
                     hidden: torch.Tensor) -> ForwardOutput:
        """The sampling rows' logits from the final hidden states (and the prompt logprobs
        of the step's chunks that want them: read back at once, such steps do not overlap)."""
        if inp.prompt_lp_spans:
            out.prompt_logprobs = self._prompt_logprobs(inp, hidden)
        kept = hidden if self.keep_hidden else None
        if not inp.sample_rows:
            return ForwardOutput(None, kept)
        if len(inp.logits_index) == hidden.shape[0]:  # every row samples: no gather
            return ForwardOutput(self.model.compute_logits(hidden), kept)
        rows = to_device(inp.logits_index, torch.long, self.device)
        return ForwardOutput(self.model.compute_logits(hidden[rows]), kept)

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor
                         ) -> dict[int, list[tuple[int, Logprobs]]]:
        """Logprob of prompt token p+1 given tokens up to p, for the prompt positions in this
        step's chunk of each request that asked for prompt_logprobs; none for a position
        whose prompt token the model does not read (inp.prompt_lp_unread: it stays None)."""
        states = {it.serial: st for it, st in zip(inp.items, inp.states)}
        result: dict[int, list[tuple[int, Logprobs]]] = {}
        for serial, start, ctx, n in inp.prompt_lp_spans:
            st = states[serial]
            prompt = st.prompt_token_ids
            k = st.sampling_params.prompt_logprobs
            last = min(ctx + n, len(prompt) - 1)  # positions [ctx, last) predict a prompt token
            entries: list[tuple[int, Logprobs]] = []
            if last > ctx:
                h = hidden[start:start + (last - ctx)]
                targets = to_device(prompt[ctx + 1:last + 1], torch.long, self.device)
                lt = compute_logprobs_tensors(self.model.compute_logits(h), targets, k)
                rows = logprobs_rows(lt, [k] * (last - ctx))
                unread = inp.prompt_lp_unread.get(serial, frozenset())
                entries = [(ctx + 1 + j, row) for j, row in enumerate(rows)
                           if row is not None and ctx + 1 + j not in unread]
            result[serial] = entries
        return result
