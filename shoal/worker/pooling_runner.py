"""The model runner of a pooling engine: one forward over whole prompts, then pooling.

No KV cache, no sampling, no CUDA graphs: each scheduled request is a whole prompt (the
pooling scheduler never splits one), the step's prompts are packed back to back with no
padding, the model returns their final hidden states, and shoal/pooling/pooler.py turns them
into one result per request. The same Executor interface as ModelRunner, so EngineCore
drives both the same way.

Tensor parallelism: every rank holds one, built over its shard of the model (the executors
of shoal/executor/ build ranks through rank_runner.py), and runs each step's forward pass,
whose collectives keep the ranks in lockstep; the final hidden states are whole on every
rank, and only rank 0 pools them (the heads are replicated and pool with no collective) and
returns results.

Pipeline parallelism (decoders: their layers split into stages; encoders are refused by
shoal/engine/compatibility.py): every stage runs its layers on the step's packed prompts and
passes them on through the StageLink generation uses (shoal/worker/stage_link.py), and the
last stage sends its final hidden states back to stage 0, whose TP rank 0 pools them as it
does on one stage (every stage holds the small heads; the results' shapes stay one rank's
business). A step then finishes in finish(), so the engine keeps up to
pipeline_parallel_size steps in flight as it does for generation."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shoal.attention.packed import PackedSeqs
from shoal.config import EngineConfig
from shoal.core.executor import Executor
from shoal.core.kv_cache_spec import KVCacheLayout
from shoal.core.scheduler_output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from shoal.distributed.parallel_state import get_pp_world_size, get_tp_rank, pp_is_first
from shoal.loader import LoadedModel, build_model
from shoal.pooling.model_info import build_pooling_info
from shoal.pooling.pooler import PoolingRow, pooled_results
from shoal.pooling_params import PoolingParams
from shoal.worker.stage_link import PendingHidden, StageLink

logger = logging.getLogger(__name__)


@dataclass
class _PoolingState:
    params: PoolingParams
    token_type_ids: list[int] | None


@dataclass
class PoolingStep:
    """A pooling step: its results are complete when execute() returns, or under pipeline
    parallelism once finish() has the last stage's final hidden states (`pending`)."""

    out: ModelRunnerOutput
    rows: list[PoolingRow] = field(default_factory=list)
    pending: PendingHidden | None = None  # stage 0 of several: the final states on their way


class PoolingModelRunner(Executor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.device = config.device
        self.dtype = config.model_config.dtype
        self.hf_config = loaded.hf_config
        self.vocab_size = loaded.hf_config.vocab_size
        t0 = time.perf_counter()
        self.model = build_model(config, loaded)
        folder = Path(loaded.source) if Path(loaded.source).is_dir() else None
        self.pooling_info = build_pooling_info(self.model, loaded.hf_config, folder,
                                               config.model_config.pooler_config)
        self.requests: dict[int, _PoolingState] = {}
        # Stage 0's TP rank 0 pools; other ranks only run their layers and collectives.
        self.pools = get_tp_rank() == 0 and pp_is_first()
        self.stage_link = (StageLink(loaded.hf_config.hidden_size, self.dtype, self.device)
                           if get_pp_world_size() > 1 else None)
        self._num_forwards = 0
        self.startup_times: dict[str, float] = {"load_model": time.perf_counter() - t0}
        info = self.pooling_info
        logger.info("pooling model: tasks %s, %s pooling, normalize=%s",
                    ", ".join(info.tasks), info.pooling_type, info.normalize)

    @property
    def pipelined(self) -> bool:
        """A pipeline stage: steps finish once the last stage is back (DriverExecutor and
        the worker ranks read this)."""
        return self.stage_link is not None

    @property
    def num_forwards(self) -> int:
        return self._num_forwards

    def initialize_kv_cache(self) -> KVCacheLayout:
        """A pooling model keeps no KV cache: zero blocks."""
        return KVCacheLayout(0, ())

    def execute(self, sched: SchedulerOutput) -> PoolingStep:
        for new in sched.new_requests:
            if new.pooling_params is None:
                raise ValueError("a pooling model only takes pooling requests")
            self.requests[new.serial] = _PoolingState(new.pooling_params, new.token_type_ids)
        rows, ids, positions, types = [], [], [], []
        any_types = False
        # Shortest first: sequences of one length sit side by side, and attention runs once
        # per length (shoal/attention/packed.py).
        for item in sorted(sched.scheduled, key=lambda it: it.num_new_tokens):
            state = self.requests[item.serial]
            n = item.num_new_tokens
            rows.append(PoolingRow(item.serial, len(ids), n, state.params))
            ids.extend(item.input_token_ids)
            positions.extend(range(n))
            any_types |= state.token_type_ids is not None
            types.extend(state.token_type_ids or [0] * n)
        seqs = PackedSeqs.build([r.length for r in rows], self.model.is_causal, self.device,
                                types if any_types else None)
        with torch.inference_mode():
            input_ids = torch.tensor(ids, dtype=torch.long).to(self.device)
            pos = torch.tensor(positions, dtype=torch.long).to(self.device)
            if self.stage_link is not None:  # stage 0 pools in finish(), once it is back
                pending = self.stage_link.run(self.model, input_ids, pos, seqs)
                self._num_forwards += 1
                return PoolingStep(ModelRunnerOutput(), rows, pending)
            hidden = self.model(input_ids, pos, seqs)
            self._num_forwards += 1
            return PoolingStep(self._pooled(hidden, rows))

    def _pooled(self, hidden: torch.Tensor, rows: list[PoolingRow]) -> ModelRunnerOutput:
        """The step's results from its final hidden states (empty on ranks that do not pool)."""
        out = ModelRunnerOutput()
        if not self.pools:
            return out
        results = pooled_results(self.model, hidden, rows, self.pooling_info)
        for serial, arr in results.items():
            if np.isfinite(arr).all():
                out.pooled[serial] = arr
            else:
                out.failed_serials.add(serial)
        return out

    def load_step_loras(self, sched: SchedulerOutput) -> None:
        """No adapters: the compatibility table refuses enable_lora with pooling."""
        return None

    def sample(self, handle: PoolingStep, grammar: GrammarBitmask | None) -> None:
        return None  # pooling samples nothing

    def finish(self, handle: PoolingStep) -> ModelRunnerOutput:
        if handle.pending is not None:  # stage 0 of a pipeline: every stage 0 rank waits
            with torch.inference_mode():
                handle.out = self._pooled(handle.pending.wait(), handle.rows)
            handle.pending = None
        return handle.out

    @torch.inference_mode()
    def check_health(self) -> None:
        """A forward pass over one made-up token, its result read back; a pipeline stage
        runs its own layers alone (a later one from zeros), sending nothing."""
        seqs = PackedSeqs.build([1], self.model.is_causal, self.device, None)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        out = (self.model.forward_stage(zero, zero, seqs, None) if self.stage_link is not None
               else self.model(zero, zero, seqs))
        if not all(bool(torch.isfinite(t).all()) for t in (out if isinstance(out, tuple)
                                                          else (out,))):
            raise RuntimeError("the health check's forward pass gave non-finite values")

    def remove_requests(self, serials: set[int]) -> None:
        for s in serials:
            self.requests.pop(s, None)

    def reset_after_fault(self) -> None:
        """The scheduler sends the requests it retries as new again."""
        self.requests.clear()
        if self.stage_link is not None:
            self.stage_link.reset()
