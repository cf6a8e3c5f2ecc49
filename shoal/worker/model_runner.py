"""Runs the scheduler's steps on one device (or one rank): the Executor interface
(shoal/core/executor.py) over the model, its KV cache and the per-request sampling state.
Makes no scheduling decisions.

A step: execute() queues its KV copies, lays out its inputs (worker/step_inputs.py) and queues
its forward pass (worker/step_forward.py: a CUDA graph of its shape, or eager); sample()
queues sampling or the verification of drafts (worker/step_sampling.py) and the copy of the
results to the host; finish() reads them (and runs the step's finish hooks: KV copies
reported done, drafts proposed). A drafter (worker/drafter.py) sees each step when it is
queued (on_launch: a draft model mirrors it there) and proposes at finish (where the
hidden-state drafters mirror it)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from shoal.attention.selector import get_attention_backend
from shoal.config import EngineConfig, resolve_kv_cache_dtype
from shoal.core.executor import Executor
from shoal.core.kv_cache_spec import KVCacheLayout, group_layers
from shoal.core.kv_transfer_plan import KVTransferPlan
from shoal.core.scheduler_output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from shoal.distributed.parallel_state import (
    get_pp_world_size,
    get_tp_world_size,
    tp_broadcast_from_first,
    world_min_int,
)
from shoal.kv_offload.transfer import KVTransfer
from shoal.kv_transfer.draft_rows import DraftRows
from shoal.kv_transfer.rows import LayerTables
from shoal.layers.linear_attention import LinearAttention
from shoal.loader import LoadedModel, build_model
from shoal.lora.slots import LoRASlots
from shoal.sample.sampler import Sampler
from shoal.worker import warmup as startup
from shoal.worker.draft_lockstep import RunnerDraftLockstep
from shoal.worker.drafter import Drafter, DrafterFactory, TargetStep
from shoal.worker.graph_capture import RunnerGraphCapture
from shoal.worker.kv_cache_sizing import decide_num_blocks
from shoal.worker.kv_cache_tensors import bind_pool, bytes_per_block, layer_specs, zero_pool
from shoal.worker.kv_connector_step import run_loads, save_hook
from shoal.worker.kv_pool_split import partitioned_pool
from shoal.worker.lifecycle import RunnerLifecycle
from shoal.worker.mm_step import MultiModalRunner
from shoal.worker.model_graphs import ModelGraphs
from shoal.worker.pending_tokens import PendingTokens
from shoal.worker.request_state import RequestState
from shoal.worker.runner_lora import RunnerLoRA
from shoal.worker.stage_link import StageLink
from shoal.worker.step_forward import ForwardOutput, StepForwarder
from shoal.worker.step_handle import StepHandle
from shoal.worker.step_inputs import prepare_inputs
from shoal.worker.step_sampling import sample_step

logger = logging.getLogger(__name__)


class ModelRunner(RunnerLifecycle, RunnerLoRA, RunnerDraftLockstep, RunnerGraphCapture,
                  Executor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 drafter_factory: DrafterFactory | None = None):
        """drafter_factory: builds the speculative config's drafter over the target model
        (shoal/spec_decode/factory.py; the executor passes it in)."""
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
        self.kv_pages: Any = None  # a partitioned pool's tensors by group (PoolPages)
        # The pool's storage: the model dtype, or FP8 (kv_cache_dtype; a drafter's own cache
        # stays in the model dtype).
        self.kv_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, self.dtype)
        # What each paged layer keeps, and the layers sharing block tables (KV cache groups).
        self.kv_specs = layer_specs(self.model.attention_layers(), self.kv_dtype)
        # (pipeline stages each group their own layers: a large sliding kind stays one group
        # there, so every stage has the groups stage 0's scheduler plans)
        self.kv_groups = group_layers(
            self.kv_specs, split_windows=config.parallel_config.pipeline_parallel_size == 1)
        self.block_size = config.cache_config.block_size
        # The fused rotary + cache write is one of the Triton ops: off with them.
        self.backend = get_attention_backend(
            self.device, config.attention_backend,
            fuse_rope_kv_write=config.use_triton_ops and config.fuse_rope_kv_write)
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        if self.kv_dtype != self.dtype and not self.backend.supports_fp8_kv_cache:
            raise ValueError(f"the {self.backend.name} attention backend has no FP8 KV cache; "
                             "use kv_cache_dtype='auto'")
        self.kv_transfer: KVTransfer | None = None  # KV offloading: see use_kv_transfer
        self.pending = PendingTokens()
        # Pipeline parallelism: this stage's layers and the activations between stages.
        stage_link = (StageLink(hf.hidden_size, self.dtype, self.device)
                      if get_pp_world_size() > 1 else None)
        windows = tuple(g.sliding_window for g in self.kv_groups)
        self.forwarder = StepForwarder(self.model, self.backend, self.device, self.block_size,
                                       windows, self.pending, stage_link,
                                       state_groups=tuple(g.holds_state for g in self.kv_groups),
                                       save_states=config.cache_config.enable_prefix_caching)
        self.drafter: Drafter | None = None
        if config.speculative_config is not None and drafter_factory is not None:
            # (None on pipeline stages after the first: stage 0 samples and drafts)
            self.drafter = drafter_factory(config, self.model, loaded)
        if self.drafter is not None:
            self.forwarder.keep_hidden = self.drafter.keeps_hidden
            self.forwarder.enable_state_replays(  # (linear layers: verified tokens kept)
                config.scheduler_config.max_num_seqs,
                config.speculative_config.num_speculative_tokens + 1, self.dtype)
            # (engine/compatibility.py refuses these for models whose layers all slide)
            assert not (self.drafter.kv_layers() and windows[0] is not None)
        self.lora: LoRASlots | None = None
        if config.lora_config is not None:
            self.lora = LoRASlots(self.model, config.lora_config, self._max_step_tokens(),
                                  self.dtype, self.device)
            self.lora_limits = self.lora.limits
            self.forwarder.lora_step = self.lora.step
        # images: the encoder cache and each step's encoder outputs (worker/mm_step.py)
        self.mm = (MultiModalRunner(self.model, self.device)
                   if getattr(self.model, "supports_multimodal", False) else None)
        self.startup_times: dict[str, float] = {"load_model": time.perf_counter() - t0}
        self._num_forwards = 0
        self._latest: StepHandle | None = None  # the last step executed

    def _max_step_tokens(self) -> int:
        """The most tokens one forward pass runs (a chunk, or a batch of verifies)."""
        sc, spec = self.config.scheduler_config, self.config.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        return max(sc.max_num_batched_tokens, sc.max_num_seqs * (k + 1))

    def collective_rpc(self, method: str, args: list[Any]) -> list[Any]:
        return [self.rpc(method, args)]

    @property
    def pipelined(self) -> bool:
        """A stage of pipeline parallelism (its steps finish once the last stage is back)."""
        return self.forwarder.stage_link is not None

    @property
    def null_block(self) -> int:
        """The zeroed block past the pool that padding reads (0 until the cache is bound)."""
        return self.forwarder.null_block

    @property
    def graphs(self) -> ModelGraphs | None:
        return self.forwarder.graphs

    @graphs.setter
    def graphs(self, graphs: ModelGraphs | None) -> None:
        self.forwarder.graphs = graphs

    @property
    def num_forwards(self) -> int:
        return self._num_forwards

    # ---- KV cache ---------------------------------------------------------------------------
    def initialize_kv_cache(self) -> KVCacheLayout:
        """Sizes the pool (after a profile run on a GPU), allocates and binds it, then warms up
        kernels and captures CUDA graphs."""
        per_block = bytes_per_block(self.kv_specs, self.kv_groups, self.block_size)
        drafter_layers = self.drafter.kv_layers() if self.drafter is not None else []
        if drafter_layers:  # its cache shares the block tables and the budget
            drafter_specs = layer_specs(drafter_layers, self.dtype)
            per_block += sum(s.page_bytes(self.block_size) for s in drafter_specs)
        cuda = self.device.type == "cuda"
        activations = 0
        if cuda:
            t0 = time.perf_counter()
            activations = startup.profile_activation_bytes(self)
            self.startup_times["profile_run"] = time.perf_counter() - t0
        replays = self.replay_reserve_bytes()
        if replays:
            logger.info("speculative decoding on linear-attention layers: %.1f MiB kept for "
                        "replaying verified tokens (%d requests x %d tokens), outside the KV "
                        "cache", replays / 2**20, self.config.scheduler_config.max_num_seqs,
                        self.config.speculative_config.num_speculative_tokens + 1)
        # Groups with tensors of their own: a pool partition each (num_blocks the first's)
        split = partitioned_pool(self.config, self.kv_specs, self.kv_groups, self.device,
                                 per_block, activations + replays)
        if split is None:
            num_blocks = decide_num_blocks(self.config.cache_config, per_block, self.device,
                                           non_kv_peak_bytes=activations + replays)
            # Tensor/pipeline parallel: every rank holds the same blocks (of its own layers),
            # as many as the tightest rank can.
            num_blocks = world_min_int(num_blocks, self.device)
        else:
            self.kv_groups, per_block = split
            num_blocks = self.kv_groups[0].num_blocks
        self.bind_kv_cache(num_blocks)
        if self.drafter is not None:  # (partitioned: the first group's pages from 1)
            self.drafter.bind(num_blocks + (split is not None), self.backend)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", num_blocks,
                    self.block_size, num_blocks * per_block / 2**20,
                    str(self.kv_dtype).removeprefix("torch."))
        states = [g for g in self.kv_groups if g.holds_state]
        if states:
            logger.info("linear-attention states: %d layers, %.2f MiB a request (float32); a "
                        "block holds one state of each of up to %d layers, so the pool holds "
                        "the states of at most %d requests", sum(len(g.layers) for g in states),
                        sum(g.spec.state_bytes * len(g.layers) for g in states) / 2**20,
                        max(len(g.layers) for g in states), num_blocks // len(states))
        if cuda:
            self.startup_times["warmup"] = startup.warmup(self)
            if not self.config.enforce_eager and self.backend.supports_cuda_graphs:
                self._capture_graphs()
        return KVCacheLayout(num_blocks, self.kv_groups)

    def replay_reserve_bytes(self) -> int:
        """Speculative decoding on a hybrid: what the linear layers keep of a verify step for
        the replay of its accepted tokens (ReplaySSM: each verified token's projections), at
        the most requests a step holds with every draft token."""
        if not self.forwarder.state_replays:
            return 0
        width = sum(layer.replay_width for layer in self.model.attention_layers()
                    if isinstance(layer, LinearAttention))
        tokens = self.config.speculative_config.num_speculative_tokens + 1
        return self.config.scheduler_config.max_num_seqs * tokens * width * self.dtype.itemsize

    def bind_kv_cache(self, num_blocks: int) -> None:
        # One extra block at the end is the null block: never allocated, never written, so it
        # stays zero and padding positions can safely read it. Linear-attention layers get
        # one more, which the padding rows of their decode graphs write.
        self.forwarder.null_block, self.kv_caches, self.kv_pages = bind_pool(
            self.model.attention_layers(), self.kv_specs, self.kv_groups, num_blocks,
            self.has_linear_states, self.kv_dtype, self.device, self.block_size)
        self._connector_tables: tuple[list[torch.Tensor], LayerTables,
                                      DraftRows | None] | None = None

    def unbind_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches, self.kv_pages = [], None
        self._connector_tables = None

    def _connector_layout(self) -> tuple[list[torch.Tensor], LayerTables, DraftRows | None]:
        """Disaggregated prefill: each layer's cache tensor and its group (block table),
        linear layers' states and replicated heads, and the drafter's caches (on the first
        group's table); built once per bound pool."""
        if self._connector_tables is None:
            self._connector_tables = (
                [layer.kv_cache for layer in self.model.attention_layers()],
                LayerTables.of(self.kv_groups, self.kv_specs, self.hf_config),
                DraftRows.of(self.drafter, self.kv_groups[0].sliding_window, self.hf_config))
        return self._connector_tables

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        return self.kv_caches

    def use_kv_transfer(self, transfer: KVTransfer) -> None:
        """KV offloading: the device <-> CPU-tier copier (shoal/kv_offload/transfer.py, built
        by the engine core over `kv_caches`) that runs each step's kv_transfers plan."""
        self.kv_transfer = transfer

    # ---- per-request state ------------------------------------------------------------------
    def remove_requests(self, serials: set[int]) -> None:
        for serial in serials:
            self.requests.pop(serial, None)
        self.forwarder.forget_replays(serials)  # (linear layers' kept verify inputs)
        if self.mm is not None:
            self.mm.remove(serials)

    def reset_after_fault(self) -> None:
        """A step raised: nothing may take input tokens from it or trust cached tables, and
        its queued device work (KV copies into CPU slots about to be released) must be over.
        A device that cannot synchronize raises here: the engine then stops."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.pending.clear()
        if self.mm is not None:  # an encoder run may have failed: the scheduler re-plans
            self.mm.reset()
        if self.graphs is not None:
            self.graphs.invalidate_tables()
        if self.forwarder.stage_link is not None:
            self.forwarder.stage_link.reset()

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepHandle:
        """Queues the step's KV copies and forward pass and returns without waiting for the
        device (nothing here reads device memory back)."""
        self.load_step_loras(sched)
        if sched.kv_zero:  # before anything of this step writes into those blocks
            self._zero_slots(sched.kv_zero)
        for new in sched.new_requests:
            self.requests[new.serial] = RequestState.of(new, self.device)
        if sched.new_requests:
            # back after preemption: it recomputes its states, folds nothing in
            self.forwarder.forget_replays({new.serial for new in sched.new_requests})
        if self.mm is not None:
            self.mm.begin_step(sched, self.requests)
        handle = StepHandle(ModelRunnerOutput())
        if sched.kv_transfers is not None:  # KV offloading: queued ahead of the forward pass
            self._run_kv_transfer(sched.kv_transfers, handle)
        plan = sched.kv_connector  # disaggregated prefill: KV from and for other engines
        if plan is not None:
            caches, tables, draft = self._connector_layout()
            run_loads(plan, caches, self.block_size, tables, draft)
        if sched.is_empty:
            if plan is not None and plan.saves:  # (rows an earlier step computed)
                handle.hooks.append(save_hook(plan, caches, self.block_size, tables, draft))
            return handle
        self._num_forwards += 1
        inp = prepare_inputs(sched, self.requests, self.pending.rows)
        handle.inputs = inp
        if self.mm is not None:
            self.mm.prepare(inp)
        if self.lora is not None:
            self.set_lora_step(inp, handle.out)  # (runner_lora.py)
        handle.forward = self.forwarder.run(inp, handle.out)
        save = None
        if plan is not None and plan.saves:  # queued now: no later step has reused a block
            save = save_hook(plan, caches, self.block_size, tables, draft)
        if self.drafter is not None:
            self._launch_drafter(self.drafter, handle)
        if save is not None:  # after the drafter's hook: its rows of the step are mirrored
            handle.hooks.append(save)
        self._latest = handle
        return handle

    def _run_kv_transfer(self, plan: KVTransferPlan, handle: StepHandle) -> None:
        transfer = self.kv_transfer
        assert transfer is not None, "a KV transfer plan, but no use_kv_transfer()"
        transfer.run(plan)
        plan_id = plan.plan_id

        def report(out: ModelRunnerOutput, latest: bool) -> None:
            # The forward pass waited for the copies on the device, so a step whose tokens
            # have arrived has them done already; one that sampled nothing waits here.
            transfer.wait(plan_id)
            out.kv_transfers_done.append(plan_id)
        handle.hooks.append(report)

    def _launch_drafter(self, drafter: Drafter, handle: StepHandle) -> None:
        assert handle.inputs is not None and handle.forward is not None
        inp, forward = handle.inputs, handle.forward
        staged = not isinstance(forward, ForwardOutput)
        step = TargetStep(inp, None if staged else forward.hidden,
                          lambda: self.forwarder.device_input_ids(inp),
                          hidden_static=not staged and forward.hidden_static,
                          rows=None if staged else forward.rows)
        # Pipeline parallelism (stage 0): the final hidden states arrive when the step is
        # sampled, so a drafter that reads them sees the step then; and no later micro-batch
        # holds this one's requests, so its drafts are wanted as the latest step's are.
        late = staged and drafter.keeps_hidden
        state = None if late else drafter.on_launch(step)

        def propose(out: ModelRunnerOutput, latest: bool) -> None:
            nonlocal state
            if late:
                step.hidden, step.aux = handle.forward.hidden, handle.forward.aux  # (sampled)
                state = drafter.on_launch(step)
            drafter.propose(step, state, out, latest or staged)
        handle.hooks.append(propose)

    @torch.inference_mode()
    def sample(self, handle: StepHandle, grammar: GrammarBitmask | None) -> None:
        """Queues the step's sampling behind its forward pass (pipeline parallel: waits for
        the last stage's hidden states first) and the copy of its tokens to the host."""
        if handle.inputs is None or handle.forward is None:
            return
        # (pipeline parallel: received now, and kept for a drafter's finish hook)
        handle.forward = handle.forward.wait()
        logits = handle.forward.logits
        if logits is None:  # no row samples this step
            self.pending.clear()
            return
        accept = self.drafter.accept_mask if self.drafter is not None else None
        # Drafters read each rank's tokens: under tensor parallelism every rank takes rank 0's
        agree = (tp_broadcast_from_first if self.drafter is not None and get_tp_world_size() > 1
                 else None)
        handle.sampled, sampled_ids = sample_step(handle.inputs, logits, grammar, self.sampler,
                                                  self.vocab_size, accept, agree)
        # The next step reads its pending input tokens from here, on the device.
        self.pending.set(sampled_ids, handle.inputs.sample_rows)

    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Waits for the step's tokens and turns them into plain data; then its finish hooks
        (KV copies reported as done, drafts proposed)."""
        if handle.sampled is not None:
            handle.sampled.read(handle.out)
        latest = handle is self._latest
        for hook in handle.hooks:
            hook(handle.out, latest)
        return handle.out

    @torch.inference_mode()
    def run_dummy_batch(self) -> torch.Tensor:
        """DP+EP (shoal/engine/dp_lockstep.py): a forward pass of one made-up token, so that
        a replica with nothing to run still joins the MoE layers' all-to-alls of a step the
        other replicas run. Its key and value go to the null block, zeroed again right after
        (padding reads it); nothing is sampled. Returns its final hidden state."""
        md = self.forwarder.metadata([1], [0], [[[self.null_block]]] * len(self.kv_groups), 0)
        if self.lora is not None:  # its one token runs without an adapter
            self.lora.set_step([None], [1])
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        hidden = self.model(zero, zero, md)
        self._zero_slots([(self.null_block, 0)])
        return hidden

    @torch.inference_mode()
    def check_health(self) -> None:
        """The dummy batch's token through the LM head and a greedy sample, read back."""
        hidden = self.run_dummy_batch()
        if isinstance(hidden, tuple):  # a pipeline stage before the last
            return
        logits = self.model.compute_logits(hidden)
        token = int(logits.argmax(dim=-1)[0])
        if not 0 <= token < logits.shape[-1]:
            raise RuntimeError(f"the health check sampled token {token}")

    def _zero_slots(self, entries: list[tuple[int, int]]) -> None:
        """(block id, first slot): a request that produced non-finite values must not leave
        them where padding reads of later requests may touch them (0 * NaN is NaN). The
        scheduler names whole blocks, or the tail of a block a new owner has started."""
        zero_pool(self.kv_caches, self.kv_pages, entries, self.block_size)
