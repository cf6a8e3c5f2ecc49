"""Turns a SchedulerOutput into tensors, runs the model and samples.

Owns the model, the KV cache tensors and the per-request sampling state (generators, the
tokens produced so far for penalties). Makes no scheduling decisions."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.attention.metadata import token_slots
from shoal.attention.selector import get_attention_backend
from shoal.config import EngineConfig
from shoal.core.scheduler_output import (
    PENDING_TOKEN,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from shoal.core.types import Logprobs
from shoal.distributed.parallel_state import get_pp_world_size, world_min_int
from shoal.host_to_device import to_device
from shoal.kv_offload.transfer import KVTransfer
from shoal.loader import LoadedModel, build_model
from shoal.sample.row_reductions import rows_finite
from shoal.sample.sampler import LogprobsTensors, Sampler, compute_logprobs_tensors
from shoal.sample.sampling_metadata import SamplingMetadata, make_generator
from shoal.sample.verify import VerifyRows, verify
from shoal.sampling_params import SamplingParams
from shoal.spec_decode.draft_model import DraftModelProposer
from shoal.spec_decode.mtp import MtpProposer, MtpRequest
from shoal.spec_decode.proposer import ForcedAcceptance, build_proposer
from shoal.structured_output.bitmask import apply_token_bitmask
from shoal.worker import warmup as startup
from shoal.worker.cuda_graphs import DecodeGraphs
from shoal.worker.kv_cache_sizing import (
    allocate_kv_caches,
    decide_num_blocks,
    layers_bytes_per_block,
)
from shoal.worker.prefill_graphs import PrefillGraphs
from shoal.worker.stage_link import PendingHidden, StageLink
from shoal.worker.verify_graphs import VerifyGraphLadder, VerifyGraphs, draft_ladder

logger = logging.getLogger(__name__)
_NO_DRAFTS: list[int] = []  # shared by the rows without drafts; never changed


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepFuture:
    """A launched step: its sampled tokens are copied to host memory behind the step; `event`
    says when they have arrived (None on the CPU, where everything is done already)."""

    out: ModelRunnerOutput
    sample_rows: list[int] = field(default_factory=list)  # request serials
    states: list[RequestState] = field(default_factory=list)
    wanted: list[int | None] = field(default_factory=list)  # logprobs asked per row
    sampled: torch.Tensor | None = None  # [2, rows]: token ids, logits finite
    logprobs: LogprobsTensors | None = None
    event: torch.cuda.Event | None = None
    kv_plan_id: int | None = None  # the KV transfer plan run ahead of the step, if any
    verify: VerifyRows | None = None  # a step with drafts: its rows per request
    # structured rows behind a step in flight: (inputs, logits) until sample_deferred()
    deferred: tuple[StepInputs, torch.Tensor] | None = None
    block_tables: dict[int, list[int]] = field(default_factory=dict)  # draft model: by serial
    # mtp: the step's requests and the target's final hidden states, mirrored in finish()
    mtp_requests: list[MtpRequest] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    # pipeline parallel, stage 0: the step's inputs, final hidden states (sampled in finish)
    # and its requests' states (a request may end, its state dropped, before then)
    pending_stage: tuple[StepInputs, PendingHidden, dict[int, RequestState]] | None = None


@dataclass
class StepInputs:
    """One step's inputs, flattened on the host in the order the model sees them."""

    items: list[ScheduledRequest]
    num_decodes: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # Flat index of the last token of each row that samples, and that row's request serial.
    logits_index: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # Flat index of a token sampled by the step in flight, and its row in that step's ids.
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    # (request serial, flat start, context length, tokens) of chunks that want prompt logprobs.
    prompt_lp_spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Speculative decoding: each sampling row's drafts (their k+1 positions all give logits).
    drafts: list[list[int]] = field(default_factory=list)
    has_drafts: bool = False
    grammar: GrammarBitmask | None = None  # structured rows: the tokens they may sample
    hidden: torch.Tensor | None = None  # mtp: the model's output, every token of the step


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.device = config.device
        self.dtype = config.model_config.dtype
        hf = loaded.hf_config
        self.hf_config = hf
        self.vocab_size = hf.vocab_size
        t0 = time.perf_counter()
        self.model = build_model(config, loaded)
        self.sampler = Sampler()
        # Per-request state by request serial (ScheduledRequest.serial), never by the caller's
        # id: an id may be reused while a step holding its old request is in flight.
        self.requests: dict[int, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        attn = self.model.attention_layers()[0]
        self.sliding_window = attn.sliding_window
        self.block_size = config.cache_config.block_size
        # The fused rotary + cache write is one of the Triton ops: off with them.
        self.backend = get_attention_backend(
            self.device, config.attention_backend,
            fuse_rope_kv_write=config.use_triton_ops and config.fuse_rope_kv_write)
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # VerifyGraphs for one draft count (tests) or a ladder of them
        self.verify_graphs: VerifyGraphLadder | VerifyGraphs | None = None
        self.null_block = 0
        self.kv_transfer: KVTransfer | None = None  # KV offloading: see use_kv_transfer
        # The last launched step's sampled ids (device) and each request's row in them.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[int, int] = {}
        # Speculative decoding: proposes drafts after each sampled token (None: off).
        self.proposer = build_proposer(config, self.model, loaded)
        # A drafter with a KV cache of its own on the target's block tables.
        self.draft = (self.proposer if isinstance(self.proposer, (DraftModelProposer,
                                                                  MtpProposer)) else None)
        self.mtp = self.proposer if isinstance(self.proposer, MtpProposer) else None
        # Pipeline parallelism: this stage's layers and the activations between stages.
        self.stage_link = (StageLink(hf.hidden_size, self.dtype, self.device)
                           if get_pp_world_size() > 1 else None)
        self.startup_times: dict[str, float] = {"load_model": time.perf_counter() - t0}
        self.num_forwards = 0  # steps launched with a forward pass (DP+EP lockstep counts them)

    # ---- KV cache ---------------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Sizes the pool (after a profile run on a GPU), allocates and binds it, then warms up
        kernels and captures decode CUDA graphs."""
        per_block = layers_bytes_per_block(self.model.attention_layers(), self.block_size,
                                           self.dtype)
        if self.draft is not None:  # its cache shares the block tables and the budget
            per_block += self.draft.bytes_per_block()
        cuda = self.device.type == "cuda"
        activations = 0
        if cuda:
            t0 = time.perf_counter()
            activations = startup.profile_activation_bytes(self)
            self.startup_times["profile_run"] = time.perf_counter() - t0
        num_blocks = decide_num_blocks(self.config.cache_config, per_block, self.device,
                                       non_kv_peak_bytes=activations)
        # Tensor/pipeline parallel: every rank holds the same blocks (of its own layers), as
        # many as the tightest rank can.
        num_blocks = world_min_int(num_blocks, self.device)
        self.bind_kv_cache(num_blocks)
        if self.draft is not None:
            self.draft.bind(num_blocks, self.backend)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)
        if cuda:
            self.startup_times["warmup"] = startup.warmup(self)
            if not self.config.enforce_eager and self.backend.supports_cuda_graphs:
                max_blocks = -(-self.config.scheduler_config.max_model_len // self.block_size)
                self.graphs = DecodeGraphs(self.model, self.backend,
                                           self.config.scheduler_config.max_num_seqs, max_blocks,
                                           self.device, block_size=self.block_size,
                                           sliding_window=self.sliding_window,
                                           keep_hidden=self.mtp is not None)
                self.startup_times["cuda_graphs"] = self.graphs.capture()
                if self.backend.supports_prefill_graphs:
                    self.prefill_graphs = PrefillGraphs(
                        self.model, self.backend,
                        self.config.scheduler_config.max_num_batched_tokens, max_blocks,
                        self.device, block_size=self.block_size,
                        sliding_window=self.sliding_window, keep_hidden=self.mtp is not None)
                    self.startup_times["prefill_graphs"] = self.prefill_graphs.capture(
                        self.graphs.pool)
                spec = self.config.speculative_config
                if spec is not None and self.backend.supports_verify_graphs:
                    self.verify_graphs = VerifyGraphLadder([VerifyGraphs(
                        self.model, self.backend, d,
                        self.config.scheduler_config.max_num_seqs, max_blocks, self.device,
                        block_size=self.block_size, sliding_window=self.sliding_window,
                        keep_hidden=self.mtp is not None)
                        for d in draft_ladder(spec.num_speculative_tokens)])
                    self.startup_times["verify_graphs"] = self.verify_graphs.capture(
                        self.graphs.pool)
                if self.draft is not None and self.backend.supports_draft_graphs:
                    # Drafting steps as graph replays: eagerly each one pays the launches.
                    self.startup_times["draft_graphs"] = self.draft.capture_graphs(
                        self.graphs.pool, max_blocks)
        return num_blocks

    def bind_kv_cache(self, num_blocks: int) -> None:
        # One extra block at the end is the null block: never allocated, never written, so it
        # stays zero and padding positions can safely read it.
        self.null_block = num_blocks
        slots = (num_blocks + 1) * self.block_size
        self.kv_caches = allocate_kv_caches(self.model.attention_layers(), slots, self.dtype,
                                            self.device)

    def unbind_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []

    def use_kv_transfer(self, transfer: KVTransfer) -> None:
        """KV offloading: the device <-> CPU-tier copier (shoal/kv_offload/transfer.py, built
        by the engine core over `kv_caches`) that runs each step's kv_transfers plan."""
        self.kv_transfer = transfer

    # ---- per-request state ------------------------------------------------------------------
    def _add_request(self, new: NewRequestData) -> None:
        sp = new.sampling_params
        gen = make_generator(sp.seed, self.device) if sp.seed is not None else None
        self.requests[new.serial] = RequestState(new.prompt_token_ids, sp, new.eos_token_ids,
                                                 gen, list(new.output_token_ids))

    def remove_requests(self, serials: set[int]) -> None:
        for serial in serials:
            self.requests.pop(serial, None)

    def reset_after_fault(self) -> None:
        """A step raised: nothing may take input tokens from it or trust cached tables, and
        its queued device work (KV copies into CPU slots about to be released) must be over.
        A device that cannot synchronize raises here: the engine then stops."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prev_sampled = None
        self._prev_rows = {}
        if self.graphs is not None:
            self.graphs.invalidate_tables()
        if self.stage_link is not None:
            self.stage_link.reset()

    # ---- one step ----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and waits for its results."""
        return self.finish(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepFuture:
        """Queues one step's work on the device and returns without waiting for it (nothing
        here reads device memory back), so the caller can prepare the next step meanwhile:
        the step's KV copies, the forward pass, sampling, and the copy of the sampled tokens
        to the host."""
        if sched.kv_zero:  # before anything of this step writes into those blocks
            self._zero_slots(sched.kv_zero)
        for new in sched.new_requests:
            self._add_request(new)
        fut = StepFuture(ModelRunnerOutput())
        plan = sched.kv_transfers
        if plan is not None:  # KV offloading: queued ahead of the forward pass
            assert self.kv_transfer is not None, "a KV transfer plan, but no use_kv_transfer()"
            self.kv_transfer.run(plan)
            fut.kv_plan_id = plan.plan_id
        if sched.is_empty:
            return fut
        self.num_forwards += 1
        inputs = self._prepare_inputs(sched)
        if self.stage_link is not None:  # pipeline parallel: stage 0 samples in finish()
            pending = self.stage_link.run(self.model, *self._eager_inputs(inputs, None))
            if pending is not None:
                fut.pending_stage = (inputs, pending,
                                     {it.serial: self.requests[it.serial] for it in inputs.items})
            return fut
        logits = self._forward(inputs, fut.out)
        if self.mtp is not None:  # mirrored once sampled (finish): it needs the next tokens
            # A graph's hidden states are its static output, which the next step (launched
            # before this one is mirrored, with async scheduling) overwrites.
            fut.hidden = (inputs.hidden.clone() if self.config.async_scheduling
                          and inputs.hidden is not None else inputs.hidden)
            fut.mtp_requests = [
                MtpRequest(it.serial, start, it.context_len, it.num_new_tokens, it.block_ids,
                           self.requests[it.serial], it.sample)
                for it, start in zip(inputs.items, _starts(inputs.items))]
        elif self.draft is not None:  # its KV follows the target's, position for position
            ids = to_device(inputs.input_ids, torch.long, self.device)
            if inputs.pending_dst:  # tokens of the step in flight (async scheduling)
                self._fill_pending(ids, inputs.pending_dst, inputs.pending_src)
            self.draft.mirror(ids, inputs.positions, inputs.items, inputs.num_decodes)
            fut.block_tables = {it.serial: it.block_ids for it in inputs.items}
        if logits is None:  # no row samples this step
            self._prev_rows = {}
            return fut
        if inputs.grammar is not None and inputs.grammar.deferred and not inputs.has_drafts:
            fut.deferred = (inputs, logits)  # sampled by sample_deferred() (see core.py)
            return fut
        self._sample(inputs, logits, fut)
        return fut

    @torch.inference_mode()
    def run_dummy_batch(self) -> None:
        """DP+EP (shoal/engine/dp_lockstep.py): a forward pass of one made-up token, so that
        a replica with nothing to run still joins the MoE layers' all-to-alls of a step the
        other replicas run. Its key and value go to the null block, zeroed again right after
        (padding reads it); nothing is sampled."""
        md = self.backend.build_metadata(
            query_lens=[1], context_lens=[0], block_tables=[[self.null_block]],
            block_size=self.block_size, num_decodes=0, sliding_window=self.sliding_window,
            device=self.device, null_block=self.null_block)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.model(zero, zero, md)
        self._zero_slots([(self.null_block, 0)])

    @torch.inference_mode()
    def sample_deferred(self, fut: StepFuture) -> None:
        """Samples a launched step whose grammar bitmask waited for the results of the step
        before it (async scheduling with structured outputs); queued behind its forward."""
        if fut.deferred is not None:
            inputs, logits = fut.deferred
            fut.deferred = None
            self._sample(inputs, logits, fut)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        inp = StepInputs(sched.scheduled, sched.num_decodes, grammar=sched.grammar_bitmask)
        for it in sched.scheduled:
            start = len(inp.input_ids)
            inp.input_ids.extend(it.input_token_ids)
            inp.positions.extend(range(it.context_len, it.context_len + it.num_new_tokens))
            if it.input_token_ids[-1] == PENDING_TOKEN:
                inp.pending_dst.append(len(inp.input_ids) - 1)
                inp.pending_src.append(self._prev_rows[it.serial])
            if it.sample:
                end = len(inp.input_ids)
                k = it.num_draft_tokens
                inp.sample_rows.append(it.serial)
                if k:  # a verify: every one of its k+1 positions gives logits
                    inp.logits_index.extend(range(end - 1 - k, end))
                    inp.drafts.append(it.input_token_ids[-k:])
                    inp.has_drafts = True
                else:
                    inp.logits_index.append(end - 1)
                    inp.drafts.append(_NO_DRAFTS)
            st = self.requests[it.serial]
            if (st.sampling_params.prompt_logprobs is not None
                    and it.context_len < len(st.prompt_token_ids)):
                inp.prompt_lp_spans.append((it.serial, start, it.context_len,
                                            it.num_new_tokens))
        return inp

    def _forward(self, inp: StepInputs, out: ModelRunnerOutput) -> torch.Tensor | None:
        """The logits of the sampling rows, or None when no row samples: a decode CUDA graph,
        a prefill CUDA graph for a lone chunk, or the model run eagerly."""
        fill = None
        if inp.pending_dst:
            def fill(ids: torch.Tensor) -> None:
                self._fill_pending(ids, inp.pending_dst, inp.pending_src)
        graphs: DecodeGraphs | PrefillGraphs | VerifyGraphs | None = None
        if self.graphs is not None and self.graphs.can_run(inp.num_decodes, len(inp.input_ids)):
            graphs = self.graphs
            tables = [it.block_ids for it in inp.items]
            logits = self.graphs.run(
                inp.input_ids, inp.positions, [it.serial for it in inp.items], tables,
                token_slots([1] * len(inp.items), inp.positions, tables, self.block_size),
                fill_pending=fill)
        elif (vg := self._verify_graph_for(inp)) is not None:
            return self._verify_graph_forward(inp, vg)
        elif self._fits_prefill_graph(inp):
            assert self.prefill_graphs is not None
            graphs = self.prefill_graphs
            it = inp.items[0]
            logits = self.prefill_graphs.run(
                inp.input_ids, inp.positions, it.context_len, it.block_ids,
                token_slots([len(inp.input_ids)], [it.context_len], [it.block_ids],
                            self.block_size),
                fill_pending=fill)
        else:
            return self._forward_eager(inp, out, fill)
        if self.mtp is not None:  # it drafts from every token's hidden state
            inp.hidden = graphs.last_hidden
        return logits

    def _verify_graph_for(self, inp: StepInputs) -> VerifyGraphs | None:
        """For a step with drafts whose requests all sample from at most k + 1 new tokens
        (verifies of up to k drafts, decodes, short last prompt chunks), no prompt logprobs
        and no tokens pending from an earlier step: the verify graphs of the fewest tokens a
        request that hold it, within the graph sizes."""
        vg = self.verify_graphs
        if (vg is None or not inp.has_drafts or inp.prompt_lp_spans or inp.pending_dst
                or not all(it.sample for it in inp.items)):
            return None
        return vg.pick(len(inp.items), [it.num_new_tokens for it in inp.items])

    def _verify_graph_forward(self, inp: StepInputs, vg: VerifyGraphs) -> torch.Tensor:
        """The step through a verify graph: each request's tokens padded to the graph's q
        (padding writes no KV and repeats the last position); returns the logits of the
        step's sampling rows (inp.logits_index, in the unpadded layout) and, for MTP / EAGLE,
        the hidden states of its real tokens."""
        q, bs = vg.q, self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        padded_row: list[int] = []  # unpadded token index -> row of the graph's output
        flat = 0
        for r, it in enumerate(inp.items):
            n, pad = it.num_new_tokens, q - it.num_new_tokens
            padded_row.extend(range(r * q, r * q + n))
            ids += inp.input_ids[flat:flat + n] + [0] * pad
            pos += inp.positions[flat:flat + n] + [inp.positions[flat + n - 1]] * pad
            slots += token_slots([n], [it.context_len], [it.block_ids], bs) + [-1] * pad
            flat += n
        out = vg.run(ids, pos, [it.context_len for it in inp.items],
                     [it.block_ids for it in inp.items], slots)
        rows = to_device([padded_row[i] for i in inp.logits_index], torch.long, self.device)
        if self.mtp is not None:
            real = to_device(padded_row, torch.long, self.device)
            inp.hidden = vg.last_hidden.index_select(0, real)
        return out.index_select(0, rows)

    def _fits_prefill_graph(self, inp: StepInputs) -> bool:
        """One lone chunk that samples and wants no prompt logprobs, within the graph sizes."""
        return (self.prefill_graphs is not None and inp.num_decodes == 0 and len(inp.items) == 1
                and inp.items[0].sample and not inp.prompt_lp_spans and not inp.has_drafts
                and self.prefill_graphs.can_run(len(inp.input_ids)))

    def _forward_eager(self, inp: StepInputs, out: ModelRunnerOutput,
                       fill: Callable[[torch.Tensor], None] | None) -> torch.Tensor | None:
        return self._logits_from_hidden(inp, out, self.model(*self._eager_inputs(inp, fill)))

    def _eager_inputs(self, inp: StepInputs, fill: Callable[[torch.Tensor], None] | None
                      ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Token ids, positions and attention metadata of an eager forward pass."""
        if self.graphs is not None:
            self.graphs.invalidate_tables()  # a preempted request may come back re-blocked
        ids_t = to_device(inp.input_ids, torch.long, self.device)
        pos_t = to_device(inp.positions, torch.long, self.device)
        if fill is not None:
            fill(ids_t)
        md = self.backend.build_metadata(
            query_lens=[it.num_new_tokens for it in inp.items],
            context_lens=[it.context_len for it in inp.items],
            block_tables=[it.block_ids for it in inp.items],
            block_size=self.block_size,
            num_decodes=inp.num_decodes,
            sliding_window=self.sliding_window,
            device=self.device,
            null_block=self.null_block,
        )
        return ids_t, pos_t, md

    def _logits_from_hidden(self, inp: StepInputs, out: ModelRunnerOutput,
                            hidden: torch.Tensor) -> torch.Tensor | None:
        """The sampling rows' logits from the model's final hidden states (and the prompt
        logprobs of the step's chunks that want them)."""
        if self.mtp is not None:
            inp.hidden = hidden
        if inp.prompt_lp_spans:  # reads back at once: such steps do not overlap
            out.prompt_logprobs = self._prompt_logprobs(hidden, inp.prompt_lp_spans)
        if not inp.sample_rows:
            return None
        if len(inp.logits_index) == hidden.shape[0]:  # every row samples: no gather
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(
            hidden[to_device(inp.logits_index, torch.long, self.device)])

    @torch.inference_mode()
    def _sample_stage(self, fut: StepFuture) -> None:
        """Pipeline parallel, stage 0: waits for the last stage's hidden states of a launched
        step, then samples it as launch() does without stages."""
        assert fut.pending_stage is not None
        inputs, pending, states = fut.pending_stage
        fut.pending_stage = None
        # Requests that ended (aborted) since launch: sampled with their state of then (the
        # scheduler drops their results); serials are never reused.
        gone = {serial: st for serial, st in states.items() if serial not in self.requests}
        self.requests.update(gone)
        try:
            logits = self._logits_from_hidden(inputs, fut.out, pending.wait())
            if logits is not None:
                self._sample(inputs, logits, fut)
        finally:
            for serial in gone:
                del self.requests[serial]

    def _sample(self, inp: StepInputs, logits: torch.Tensor, fut: StepFuture) -> None:
        states = [self.requests[r] for r in inp.sample_rows]
        if inp.has_drafts:
            self._verify(inp, logits, states, fut)
            return
        smd = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            [s.eos_token_ids for s in states],
            self.vocab_size,
            self.device,
        )
        finite = rows_finite(logits)
        if inp.grammar is not None:  # after the finiteness check: masked logits are -inf
            serials = inp.grammar.serials
            # Every row structured (the usual batch): no per-row index list.
            rows = None if serials == inp.sample_rows else _rows_of(inp.sample_rows, serials)
            # Filled now, on the host, while the device runs the forward pass queued above.
            apply_token_bitmask(logits, inp.grammar.fill(), rows)
        result = self.sampler(logits, smd)
        # The next step reads its pending input tokens from here, on the device.
        self._prev_sampled = result.sampled_token_ids
        self._prev_rows = {rid: i for i, rid in enumerate(inp.sample_rows)}
        fut.sample_rows = inp.sample_rows
        fut.states = states
        fut.wanted = [s.sampling_params.num_logprobs for s in states]
        # One device-to-host transfer for both, queued behind the step.
        self._queue_to_host(fut, torch.stack([result.sampled_token_ids, finite.long()]),
                            result.logprobs)

    def _verify(self, inp: StepInputs, logits: torch.Tensor, states: list[RequestState],
                fut: StepFuture) -> None:
        """A step with drafts: every request's rows through the rejection sampler. Such
        steps are not pipelined (nothing reads pending tokens from them)."""
        forced = (self.proposer.accept_mask([len(d) for d in inp.drafts])
                  if isinstance(self.proposer, ForcedAcceptance) else None)
        mask = None
        if inp.grammar is not None:
            grammar = inp.grammar
            # A structured request's k+1 rows each have a bitmask row (after 0..k drafts).
            rows_of: dict[int, range] = {}
            row = 0
            for serial, d in zip(inp.sample_rows, inp.drafts):
                rows_of[serial] = range(row, row + len(d) + 1)
                row += len(d) + 1

            def mask(lg: torch.Tensor) -> None:
                apply_token_bitmask(lg, grammar.fill(),
                                    [r for s in grammar.serials for r in rows_of[s]])
        rows, result, finite = verify(logits, states, inp.drafts, self.vocab_size, self.device,
                                      forced, mask)
        self._prev_sampled = None
        self._prev_rows = {}
        fut.sample_rows = inp.sample_rows
        fut.states = states
        fut.wanted = [s.sampling_params.num_logprobs for s, d in zip(states, inp.drafts)
                      for _ in range(len(d) + 1)]  # per row
        fut.verify = rows
        self._queue_to_host(fut, torch.stack([result.token_ids, result.accepted.long(),
                                              finite.long()]), result.logprobs)

    def _queue_to_host(self, fut: StepFuture, packed: torch.Tensor,
                       logprobs: LogprobsTensors | None) -> None:
        """Copies the sampled results to the host behind the step; `fut.event` marks their
        arrival on CUDA (elsewhere they are on the host already)."""
        if self.device.type != "cuda":
            fut.sampled, fut.logprobs = packed, logprobs
            return
        fut.sampled = packed.to("cpu", non_blocking=True)
        if logprobs is not None:
            fut.logprobs = LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in
                                             (logprobs.token_ids, logprobs.logprobs,
                                              logprobs.ranks)))
        fut.event = torch.cuda.Event()
        fut.event.record()

    def finish(self, fut: StepFuture, propose: bool = True) -> ModelRunnerOutput:
        """Waits for a launched step and turns its sampled tokens into plain data; reports its
        KV copies as done. propose=False: the next step is launched already and verifies no
        drafts, so a hidden-state drafter only mirrors this step (queued behind the next one,
        without waiting for it) and drafts nothing; host proposers draft anyway (cheap, and
        the scheduler reads whether they found any)."""
        out = fut.out
        if fut.pending_stage is not None:  # pipeline parallel: sampled once stages are done
            self._sample_stage(fut)
        if fut.sampled is not None:
            self._read_sampled(fut, propose)
        if self.mtp is not None and fut.mtp_requests:
            self._propose_with_mtp(fut, propose)
        if fut.kv_plan_id is not None:
            # The forward pass waited for the copies on the device, so a step whose tokens
            # have arrived has them done already; one that sampled nothing waits here.
            assert self.kv_transfer is not None
            self.kv_transfer.wait(fut.kv_plan_id)
            out.kv_transfers_done.append(fut.kv_plan_id)
        return out

    def _read_sampled(self, fut: StepFuture, propose: bool = True) -> None:
        out = fut.out
        assert fut.sampled is not None
        if fut.event is not None:
            fut.event.synchronize()
        lp_rows = _logprobs_rows(fut.logprobs, fut.wanted)
        if fut.verify is not None:
            fut.verify.read(fut.sampled.tolist(), lp_rows, fut.sample_rows, fut.states, out)
        else:
            sampled, finite_l = fut.sampled.tolist()
            for i, (serial, st) in enumerate(zip(fut.sample_rows, fut.states)):
                if not finite_l[i]:
                    # The scheduler withdraws and zeroes its blocks: it knows who owns them.
                    out.failed_serials.add(serial)
                    continue
                st.output_token_ids.append(sampled[i])
                out.sampled_token_ids[serial] = sampled[i]
                if lp_rows[i] is not None:
                    out.logprobs[serial] = lp_rows[i]
        if self.mtp is not None:
            pass  # finish() mirrors the step and drafts
        elif self.draft is not None:
            if propose:  # (its KV mirrors every step at launch, drafted or not)
                self._propose_with_draft(fut)
        elif self.proposer is not None:
            for serial, st in zip(fut.sample_rows, fut.states):
                if serial in out.sampled_token_ids:
                    drafts = self.proposer.propose(st.prompt_token_ids, st.output_token_ids)
                    if drafts:
                        out.draft_token_ids[serial] = drafts

    def _propose_with_draft(self, fut: StepFuture) -> None:
        assert self.draft is not None
        out = fut.out
        rows = [(serial, st) for serial, st in zip(fut.sample_rows, fut.states)
                if serial in out.sampled_token_ids]
        if not rows:
            return
        drafts = self.draft.propose_batch(
            [st.prompt_token_ids + st.output_token_ids for _, st in rows],
            [fut.block_tables[serial] for serial, _ in rows])
        for (serial, _), d in zip(rows, drafts):
            if d:
                out.draft_token_ids[serial] = d

    def _propose_with_mtp(self, fut: StepFuture, propose: bool) -> None:
        assert self.mtp is not None and fut.hidden is not None
        out = fut.out
        drafts = self.mtp.mirror_and_propose(fut.mtp_requests, fut.hidden, out.failed_serials,
                                             propose=propose)
        for serial, d in drafts.items():
            if d and serial in out.sampled_token_ids:
                out.draft_token_ids[serial] = d
        fut.hidden = None

    def _fill_pending(self, ids: torch.Tensor, dst: list[int], src: list[int]) -> None:
        """Writes the tokens the previous step sampled into this step's input ids."""
        prev = self._prev_sampled
        assert prev is not None
        k = len(dst)
        if dst == src and dst[-1] == k - 1:  # same rows, same order: the steady decode batch
            ids[:k].copy_(prev[:k])
        else:
            ids[to_device(dst, torch.long, self.device)] = prev[to_device(src, torch.long,
                                                                          self.device)]

    def _zero_slots(self, entries: list[tuple[int, int]]) -> None:
        """(block id, first slot): a request that produced non-finite values must not leave
        them where padding reads of later requests may touch them (0 * NaN is NaN). The
        scheduler names whole blocks, or the tail of a block a new owner has started."""
        whole = [b for b, first in entries if first == 0]
        idx = to_device(whole, torch.long, self.device) if whole else None
        for kv in self.kv_caches:
            blocks = kv.view(kv.shape[0], -1, self.block_size, *kv.shape[2:])  # planes
            if idx is not None:
                blocks[:, idx] = 0
            for b, first in entries:
                if first:
                    blocks[:, b, first:] = 0

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[tuple[int, int, int, int]]
                         ) -> dict[int, list[tuple[int, Logprobs]]]:
        """Logprob of prompt token p+1 given tokens up to p, for the prompt positions in this
        step's chunk of each request that asked for prompt_logprobs."""
        result: dict[int, list[tuple[int, Logprobs]]] = {}
        for serial, start, ctx, n in spans:
            st = self.requests[serial]
            prompt = st.prompt_token_ids
            last = min(ctx + n, len(prompt) - 1)  # positions [ctx, last) predict a prompt token
            entries: list[tuple[int, Logprobs]] = []
            if last > ctx:
                h = hidden[start:start + (last - ctx)]
                targets = to_device(prompt[ctx + 1:last + 1], torch.long, self.device)
                lt = compute_logprobs_tensors(self.model.compute_logits(h), targets,
                                              st.sampling_params.prompt_logprobs)
                rows = _logprobs_rows(lt, [st.sampling_params.prompt_logprobs] * (last - ctx))
                entries = [(ctx + 1 + j, row) for j, row in enumerate(rows) if row is not None]
            result[serial] = entries
        return result


def _rows_of(sample_rows: list[int], serials: list[int]) -> list[int]:
    """The logits row of each of `serials` (request serials among the step's sample rows)."""
    row_of = {serial: i for i, serial in enumerate(sample_rows)}
    return [row_of[s] for s in serials]


def _starts(items: list[ScheduledRequest]) -> list[int]:
    """Each request's first row in the step's flattened tokens."""
    starts, n = [], 0
    for it in items:
        starts.append(n)
        n += it.num_new_tokens
    return starts


def _logprobs_rows(lt: LogprobsTensors | None, wanted: list[int | None]) -> list[Logprobs | None]:
    if lt is None:
        return [None] * len(wanted)
    ids, lps, ranks = lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist()
    rows: list[Logprobs | None] = []
    for i, k in enumerate(wanted):
        if k is None:
            rows.append(None)
        else:
            rows.append(Logprobs(token_ids=ids[i][: k + 1], logprobs=lps[i][: k + 1], rank=ranks[i]))
    return rows
