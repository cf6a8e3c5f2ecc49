"""Turns a SchedulerOutput into tensors, runs the model and samples.

Owns the model, the KV cache tensors and the per-request sampling state (generators, the
tokens produced so far for penalties). Makes no scheduling decisions."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from shoal.attention.backend import get_attention_backend
from shoal.attention.metadata import token_slots
from shoal.config import EngineConfig
from shoal.engine.core_types import Logprobs
from shoal.engine.scheduler_output import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from shoal.host_to_device import to_device
from shoal.loader import LoadedModel
from shoal.loader.dummy import initialize_dummy_weights
from shoal.models.registry import resolve_model_class
from shoal.sampling_params import SamplingParams
from shoal.worker import warmup as startup
from shoal.worker.cuda_graphs import DecodeGraphs
from shoal.worker.kv_cache_sizing import bytes_per_block, decide_num_blocks
from shoal.worker.kv_transfer import KVTransfer
from shoal.worker.prefill_graphs import PrefillGraphs
from shoal.worker.sampler import LogprobsTensors, Sampler, compute_logprobs_tensors
from shoal.worker.sampling_metadata import SamplingMetadata, make_generator

logger = logging.getLogger(__name__)


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
    sample_rows: list[str] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    wanted: list[int | None] = field(default_factory=list)  # logprobs asked per row
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    sampled: torch.Tensor | None = None  # [2, rows]: token ids, logits finite
    logprobs: LogprobsTensors | None = None
    event: torch.cuda.Event | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.device = config.device
        self.dtype = config.model_config.dtype
        hf = loaded.hf_config
        self.hf_config = hf
        self.vocab_size = hf.vocab_size
        t0 = time.perf_counter()
        cls = resolve_model_class(hf)
        with torch.device(self.device):
            self.model = cls(hf, self.dtype)
        if config.model_config.load_format == "dummy":
            initialize_dummy_weights(self.model, seed=config.model_config.seed)
        else:
            loaded_names = self.model.load_weights(loaded.weights())
            missing = {n for n, _ in self.model.named_parameters()} - loaded_names
            if self.model.tie_word_embeddings:
                missing.discard("lm_head.weight")
            if missing:
                raise ValueError(f"{loaded.source}: checkpoint lacks {sorted(missing)[:5]}...")
        self.model.eval()
        logger.info("model %s loaded in %.2f s", type(self.model).__name__, time.perf_counter() - t0)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        attn = self.model.attention_layers()[0]
        self.sliding_window = attn.sliding_window
        self.block_size = config.cache_config.block_size
        self.backend = get_attention_backend(self.device, os.environ.get("SHOAL_ATTENTION_BACKEND"))
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.null_block = 0
        self.kv_transfer: KVTransfer | None = None  # set by shoal/kv_offload/setup.py
        # The last launched step's sampled ids (device) and each request's row in them.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.startup_times: dict[str, float] = {"load_model": time.perf_counter() - t0}

    # ---- KV cache ---------------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Sizes the pool (after a profile run on a GPU), allocates and binds it, then warms up
        kernels and captures decode CUDA graphs."""
        layers = self.model.attention_layers()
        a = layers[0]
        per_block = bytes_per_block(len(layers), a.num_kv_heads, a.head_dim, self.block_size,
                                    self.dtype)
        cuda = self.device.type == "cuda"
        activations = 0
        if cuda:
            t0 = time.perf_counter()
            activations = startup.profile_activation_bytes(self)
            self.startup_times["profile_run"] = time.perf_counter() - t0
        num_blocks = decide_num_blocks(self.config.cache_config, per_block, self.device,
                                       non_kv_peak_bytes=activations)
        self.bind_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)
        if cuda:
            self.startup_times["warmup"] = startup.warmup(self)
            if not self.config.enforce_eager and hasattr(self.backend, "alloc_graph_buffers"):
                max_blocks = -(-self.config.scheduler_config.max_model_len // self.block_size)
                self.graphs = DecodeGraphs(self.model, self.backend,
                                           self.config.scheduler_config.max_num_seqs, max_blocks,
                                           self.device, block_size=self.block_size,
                                           sliding_window=self.sliding_window)
                self.startup_times["cuda_graphs"] = self.graphs.capture()
                if hasattr(self.backend, "alloc_prefill_graph_buffers"):
                    self.prefill_graphs = PrefillGraphs(
                        self.model, self.backend,
                        self.config.scheduler_config.max_num_batched_tokens, max_blocks,
                        self.device, block_size=self.block_size,
                        sliding_window=self.sliding_window)
                    self.startup_times["prefill_graphs"] = self.prefill_graphs.capture(
                        self.graphs.pool)
        return num_blocks

    def bind_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        a = layers[0]
        # One extra block at the end is the null block: never allocated, never written, so it
        # stays zero and padding positions can safely read it.
        self.null_block = num_blocks
        slots = (num_blocks + 1) * self.block_size
        cache = torch.zeros(len(layers), 2, slots, a.num_kv_heads, a.head_dim,
                            dtype=self.dtype, device=self.device)
        self.kv_caches = list(cache.unbind(0))
        for layer, kv in zip(layers, self.kv_caches):
            layer.kv_cache = kv

    def unbind_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        self.kv_caches = []

    # ---- per-request state ------------------------------------------------------------------
    def _add_request(self, new: NewRequestData) -> None:
        sp = new.sampling_params
        gen = make_generator(sp.seed, self.device) if sp.seed is not None else None
        self.requests[new.request_id] = RequestState(new.prompt_token_ids, sp, new.eos_token_ids, gen)

    def remove_requests(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    # ---- one step ----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and waits for its results."""
        return self.finish(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepFuture:
        """Queues one step's work on the device and returns without waiting for it (nothing
        here reads device memory back), so the caller can prepare the next step meanwhile."""
        for new in sched.new_requests:
            self._add_request(new)
        if sched.kv_transfers and self.kv_transfer is not None:  # KV offloading, before the forward
            self.kv_transfer.run(sched.kv_transfers)
        fut = StepFuture(ModelRunnerOutput())
        if sched.is_empty:
            return fut
        items = sched.scheduled
        input_ids: list[int] = []
        positions: list[int] = []
        logits_index: list[int] = []  # flat token index of the last token of sampling rows
        sample_rows: list[str] = []
        pending_dst: list[int] = []  # flat index of a token sampled by the step in flight
        pending_src: list[int] = []  # ... and its row in that step's sampled ids
        prompt_lp_spans: list[tuple[str, int, int, int]] = []  # rid, flat start, ctx, n
        for it in items:
            start = len(input_ids)
            input_ids.extend(it.input_token_ids)
            positions.extend(range(it.context_len, it.context_len + it.num_new_tokens))
            if it.input_token_ids[-1] == PENDING_TOKEN:
                pending_dst.append(len(input_ids) - 1)
                pending_src.append(self._prev_rows[it.request_id])
            if it.sample:
                logits_index.append(len(input_ids) - 1)
                sample_rows.append(it.request_id)
            st = self.requests[it.request_id]
            if st.sampling_params.prompt_logprobs is not None and it.context_len < len(st.prompt_token_ids):
                prompt_lp_spans.append((it.request_id, start, it.context_len, it.num_new_tokens))

        def fill_pending(ids: torch.Tensor) -> None:
            self._fill_pending(ids, pending_dst, pending_src)

        out = fut.out
        if self.graphs is not None and self.graphs.can_run(sched.num_decodes, len(input_ids)):
            bs = self.block_size
            logits = self.graphs.run(
                input_ids, positions, [it.request_id for it in items],
                [it.block_ids for it in items],
                token_slots([1] * len(items), positions, [it.block_ids for it in items], bs),
                fill_pending=fill_pending if pending_dst else None)
        elif (self.prefill_graphs is not None and sched.num_decodes == 0 and len(items) == 1
              and items[0].sample and not prompt_lp_spans
              and self.prefill_graphs.can_run(len(input_ids))):
            it = items[0]
            logits = self.prefill_graphs.run(
                input_ids, positions, it.context_len, it.block_ids,
                token_slots([len(input_ids)], [it.context_len], [it.block_ids],
                            self.block_size),
                fill_pending=fill_pending if pending_dst else None)
        else:
            if self.graphs is not None:
                self.graphs.invalidate_tables()  # a preempted request may come back re-blocked
            ids_t = to_device(input_ids, torch.long, self.device)
            pos_t = to_device(positions, torch.long, self.device)
            if pending_dst:
                fill_pending(ids_t)
            md = self.backend.build_metadata(
                query_lens=[it.num_new_tokens for it in items],
                context_lens=[it.context_len for it in items],
                block_tables=[it.block_ids for it in items],
                block_size=self.block_size,
                num_decodes=sched.num_decodes,
                sliding_window=self.sliding_window,
                device=self.device,
                null_block=self.null_block,
            )
            hidden = self.model(ids_t, pos_t, md)

            if prompt_lp_spans:  # reads back at once: such steps do not overlap
                out.prompt_logprobs = self._prompt_logprobs(hidden, prompt_lp_spans)
            if not sample_rows:
                self._prev_rows = {}
                return fut
            if len(logits_index) == hidden.shape[0]:  # every row samples: no gather
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(
                    hidden[to_device(logits_index, torch.long, self.device)])

        states = [self.requests[r] for r in sample_rows]
        smd = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.output_token_ids for s in states],
            [s.prompt_token_ids for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            [s.eos_token_ids for s in states],
            self.vocab_size,
            self.device,
        )
        finite = torch.isfinite(logits).all(dim=-1)
        result = self.sampler(logits, smd)
        # The next step reads its pending input tokens from here, on the device.
        self._prev_sampled = result.sampled_token_ids
        self._prev_rows = {rid: i for i, rid in enumerate(sample_rows)}
        # One device-to-host transfer for both, queued behind the step.
        packed = torch.stack([result.sampled_token_ids, finite.long()])
        fut.sample_rows = sample_rows
        fut.states = states
        fut.wanted = [s.sampling_params.logprobs for s in states]
        fut.block_ids = {it.request_id: it.block_ids for it in items if it.sample}
        if self.device.type == "cuda":
            fut.sampled = packed.to("cpu", non_blocking=True)
            if result.logprobs is not None:
                lt = result.logprobs
                fut.logprobs = LogprobsTensors(*(t.to("cpu", non_blocking=True)
                                                 for t in (lt.token_ids, lt.logprobs, lt.ranks)))
            fut.event = torch.cuda.Event()
            fut.event.record()
        else:
            fut.sampled, fut.logprobs = packed, result.logprobs
        return fut

    def finish(self, fut: StepFuture) -> ModelRunnerOutput:
        """Waits for a launched step and turns its sampled tokens into plain data."""
        out = fut.out
        if fut.sampled is None:
            return out
        if fut.event is not None:
            fut.event.synchronize()
        sampled, finite_l = fut.sampled.tolist()
        lp_rows = _logprobs_rows(fut.logprobs, fut.wanted)
        for i, (rid, st) in enumerate(zip(fut.sample_rows, fut.states)):
            if not finite_l[i]:
                out.failed_request_ids.add(rid)
                # Queued behind any step launched since, which may write these blocks too.
                self._zero_blocks(fut.block_ids[rid])
                continue
            st.output_token_ids.append(sampled[i])
            out.sampled_token_ids[rid] = sampled[i]
            if lp_rows[i] is not None:
                out.logprobs[rid] = lp_rows[i]
        return out

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

    def _zero_blocks(self, block_ids: list[int]) -> None:
        """A request that produced non-finite values must not leave them in blocks that padding
        reads of later requests may touch (0 * NaN is NaN)."""
        idx = to_device(block_ids, torch.long, self.device)
        for kv in self.kv_caches:
            kv.view(2, -1, self.block_size, *kv.shape[2:])[:, idx] = 0

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         spans: list[tuple[str, int, int, int]]) -> dict[str, list[tuple[int, Logprobs]]]:
        """Logprob of prompt token p+1 given tokens up to p, for the prompt positions in this
        step's chunk of each request that asked for prompt_logprobs."""
        result: dict[str, list[tuple[int, Logprobs]]] = {}
        for rid, start, ctx, n in spans:
            st = self.requests[rid]
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
            result[rid] = entries
        return result


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
