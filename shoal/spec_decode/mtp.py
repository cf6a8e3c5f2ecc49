"""Drafting from the target's hidden states: methods "mtp" and "eagle".

Both draft with a small "head" that reads the target's final (normed) hidden states: "mtp"
with DeepSeek-V3's multi-token-prediction layer (shoal/models/deepseek_mtp.py; DeepSeek-V4's,
whose hidden states are hyper-connection streams: deepseek_v4_mtp.py), "eagle" with
an EAGLE-1 head for a Llama-family target (shoal/models/llama_eagle.py). HiddenStateDrafter
runs either; a head is a module with

    head(next_ids, positions, prev_hidden, attn_metadata) -> output state (one row each)
    head.compute_logits(output state) -> logits over the target's vocabulary
    head.attention_layers() -> its attention layers (their KV cache is the drafter's)

built and loaded by build_mtp_head (mtp_heads.py) / build_eagle_head. The output state is also what a
further draft step feeds back as prev_hidden. (Logits are a separate call: the mirror needs
them for no row, drafting only for each request's last.)

Alignment (as vLLM's): the head's row of position p takes the target's final (normed) hidden
state at p and the token at p + 1, runs at position p and writes its KV at p's slot, and its
logits predict the token at p + 2. Its KV cache is a tensor of its own sharing the target's
block tables, like the draft model's (shoal/spec_decode/draft_model.py).

Each step is mirrored once its tokens are sampled (the last position's next token is the
sampled one): every position the target computed whose next token is now known gets its
head row (for a verify step: up to the last accepted position; rejected positions are
recomputed by later steps, and their slots overwritten). The mirror's last row of a sampling
request (position L-2 for a sequence of L tokens, next token the one just sampled) gives
draft 1; drafts 2..k feed the head's own output state back with the previous draft, at
positions L-1, L, ... (replayed as CUDA graphs once captured: draft_graphs.py); those
positions past the request's blocks go to per-row scratch blocks, and everything written
past the computed tokens is overwritten by the next mirror before anyone reads it.

A head with several MTP layers (num_depths > 1: DeepseekMTPDepths, Qwen3NextMTP with
mtp_num_hidden_layers > 1) drafts 1..n with its n layers in a chain, each with its own KV
cache, and goes on with the last one past them: shoal/spec_decode/mtp_chain.py.

With confidence-scheduled verification on (speculative_config confidence_threshold), each
draft also carries the head's probability of it, the softmax of its logits at the greedy
token (exp(max - logsumexp), out of the logits the argmax reads anyway): draft 1's beside the
mirror, those of drafts 2..k written by each greedy step into a static buffer (the graphs
replay that write), read with the drafts. They go out in ModelRunnerOutput.draft_probs."""

from __future__ import annotations

import functools
import logging
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from shoal.config import EngineConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.spec_decode import mirror_backlog as backlog
from shoal.spec_decode.draft_graphs import DraftGraphs
from shoal.spec_decode.drafter_cache import DrafterCache
from shoal.spec_decode.drafting_rows import (
    DraftingRows,
    MtpRequest,
    drafting_rows,
    request_of,
    sampled_rows,
)
from shoal.spec_decode.kept_rows import KeptRows, KeptStep
from shoal.spec_decode.mirror_backlog import MirrorBacklog, RawRows
from shoal.spec_decode.mirror_graphs import MirrorGraphs
from shoal.spec_decode.mtp_chain import MirrorPass, MirrorRequest, MtpChain
from shoal.worker.draft_lockstep import dispatches_tokens
from shoal.worker.drafter import TargetStep
from shoal.worker.graph_table import StepShape

logger = logging.getLogger(__name__)


class HiddenStateDrafter(DrafterCache):
    """Methods "mtp" and "eagle": `head` (a DraftHead) drafts k tokens greedily from the
    target's hidden states, with a KV cache of its own on the target's block tables."""

    keeps_hidden = True
    # The mirror pass and draft 1 replay CUDA graphs once captured (mirror_graphs.py): EAGLE-3
    # heads so far (their tests cover it); MTP layers and EAGLE-1 heads mirror eagerly.
    graph_mirror = False

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, head: nn.Module):
        self.model = head
        self._init_cache(config, spec.num_speculative_tokens)
        # Several MTP layers: drafts 1..depths in a chain (mtp_chain.py), then the last one
        self.depths = int(getattr(head, "num_depths", 1))
        self.chain = None if self.depths == 1 else MtpChain(
            self._run_depth, self._metadata, self.depths, self._state_size(), self.dtype,
            self.device, capacity=2 * self.max_rows)
        # With async scheduling the next target step is launched before this one is mirrored
        self.async_scheduling = config.async_scheduling
        self.confidence = spec.confidence_threshold is not None
        self.last_draft_probs: dict[int, list[float]] = {}  # of the last proposal
        if self.confidence:  # the greedy steps' probabilities, column j - 2 for draft j
            self._probs = torch.zeros(self.max_rows, self.k, device=self.device)
            self._prob_col = torch.zeros(1, dtype=torch.long, device=self.device)
        self.mirror_graphs: MirrorGraphs | None = None  # captured by capture_graphs
        # The rows of paused requests (mirror_backlog.py; a chain's carry wants every mirror)
        self.kept_rows: KeptRows | None = None
        if self.chain is None:
            self.kept_rows = KeptRows(self.max_rows * (backlog.MAX_ROWS + 3), self._raw_width(),
                                      self.dtype, self.device, step_rows=self.max_rows)
            ring = self.kept_rows.buf
            logger.info("drafter: %.1f MiB for the rows of paused requests (%d rows)",
                        ring.numel() * ring.element_size() / 2**20, ring.shape[0])

    def on_launch(self, step: TargetStep) -> torch.Tensor | KeptStep | None:
        """Mirrored once sampled (propose): it needs the next tokens. A graph's hidden states
        are its static output, which the next step (launched before this one is mirrored,
        with async scheduling) may overwrite: a copy then (an eager step's are its own), into
        the ring of kept rows when every request of the step is paused."""
        hidden = step.hidden
        if hidden is None:
            return None
        kept = self._keep_step(step, hidden)
        if kept is not None:
            return kept
        if step.hidden_static and self.async_scheduling:
            return hidden.clone()
        return hidden

    def _keep_step(self, step: TargetStep, rows: torch.Tensor) -> KeptStep | None:
        """A step whose requests are all paused (mirror_backlog.py) goes whole into the ring
        of kept rows now, in one copy: its mirror then keeps them without a torch call."""
        ring, items = self.kept_rows, step.inputs.items
        if (ring is None or not items or not 0 < rows.shape[0] <= ring.step_rows
                or not all(it.drafts_paused for it in items)):
            return None
        return KeptStep(ring.keep(rows), rows.shape[0])

    def propose(self, step: TargetStep, state: torch.Tensor | None, out: ModelRunnerOutput,
                latest: bool) -> None:
        inp = step.inputs
        assert state is not None, "a hidden-state drafter without the target's hidden states"
        if isinstance(state, KeptStep) and backlog.defer_kept_step(
                inp.items, inp.states, self.kept_rows, state, out.failed_serials):
            return  # (every request paused, its row kept: nothing to mirror or draft)
        reqs = [request_of(it, st, start) for it, st, start in zip(inp.items, inp.states,
                                                                      inp.starts())]
        drafts = self.mirror_and_propose(reqs, state, out.failed_serials, propose=latest)
        for serial, d in drafts.items():
            if d and serial in out.sampled_token_ids:
                out.draft_token_ids[serial] = d
                if serial in self.last_draft_probs:
                    out.draft_probs[serial] = self.last_draft_probs[serial]

    @torch.inference_mode()
    def mirror_and_propose(self, reqs: list[MtpRequest],
                           hidden: torch.Tensor | RawRows | KeptStep, failed: set[int],
                           propose: bool = True) -> dict[int, list[int]]:
        """Mirrors a sampled target step (hidden: its final hidden states, one row per
        token; EAGLE-3: RawRows, its aux states; KeptStep: either, kept in the ring at
        launch) into the head's cache and drafts for its sampling requests (serial -> drafts;
        none with propose=False: the mirror is then only queued, nothing waits for the
        device). `failed`: requests whose step produced non-finite values (neither mirrored
        nor drafted). A paused request's rows are kept instead (mirror_backlog.py); the first
        later step that mirrors it runs them first."""
        ring = self.kept_rows
        kept_step = hidden if isinstance(hidden, KeptStep) else None
        if kept_step is not None:
            backlog.check_kept_step(ring, kept_step)
        ids, pos, kept, deferred, backlogs = self._sort_requests(reqs, failed, kept_step)
        if self.chain is not None:
            for serial in failed:
                self.chain.forget(serial)
        states = None if kept_step is not None else (
            hidden.rows if isinstance(hidden, RawRows) else hidden)
        if not kept:
            if deferred:
                assert states is not None
                self._keep_deferred(deferred, states, self._to_index([r.start for r in deferred]))
            return {}
        caught = [0 if b is None else r.context_len - b.start for (r, _), b in zip(kept, backlogs)]
        lens = [n + c for (_, n), c in zip(kept, caught)]
        starts = [r.context_len - c for (r, _), c in zip(kept, caught)]  # first mirrored rows
        spans = [(r.start, n) for r, n in kept]
        graphs = self.mirror_graphs
        shape = None if graphs is None else graphs.shape_for(lens, starts)
        if shape is not None:  # a replay; with backlogs every row from the ring of kept rows
            source, src_rows = self._graph_source(hidden), None
            if kept_step is not None or any(caught):
                if ring is not None and (source is not None or kept_step is not None):
                    src_rows = backlog.ring_rows(spans, backlogs, ring, kept_step, source,
                                                 self._to_index)
                source = None if src_rows is None else ring.buf
            if source is not None:
                return self._mirror_through_graph(shape, source, src_rows, kept, lens, starts,
                                                  ids, deferred, states, propose)
        num_decodes = 0
        while num_decodes < len(lens) and lens[num_decodes] == 1:
            num_decodes += 1
        # Every index list of the pass goes to the device with the metadata, in one copy
        # (each copy of its own costs the host a few Python-issued torch calls).
        src = backlog.mirror_sources(spans, backlogs, ring, kept_step,
                                     0 if states is None else states.shape[0])
        sel = [s + i for s, c, n in zip(accumulate(lens, initial=0), caught, lens)
               for i in range(c, n)] if any(caught) else []
        plan = drafting_rows(kept, self.max_model_len) if propose else None
        carry = [ids, pos, src.step, src.ring, src.order, sel, plan.last if plan else [],
                 [r.start for r in deferred]]
        md, (ids_t, pos_t, step_t, ring_t, order_t, sel_t, last_t, defer_t) = \
            self._metadata_and_inputs(lens, starts, [r.block_ids for r, _ in kept], num_decodes,
                                      carry)
        h = backlog.mirror_states(states, isinstance(hidden, RawRows | KeptStep), src, ring,
                                  (step_t, ring_t, order_t), self._input_states)
        if deferred:  # (after the gather above: its copy may reuse the slots it read)
            assert states is not None
            self._keep_deferred(deferred, states, defer_t)
        out = self._run_depth(0, ids_t, pos_t, h, md)
        if sel:  # the rows of the step itself, as a mirror without backlog's
            out = out[sel_t]
        mirrored = None
        if self.chain is not None:  # depths 1..n-1 over the rows whose tokens are now known
            mirrored = self.chain.mirror([MirrorRequest(r.serial, r.context_len, n, r.block_ids)
                                          for r, n in kept], ids_t, out)
        if plan is None:
            return {}
        plan.last_index = last_t
        return self._propose(kept, out, mirrored, plan)

    def _sort_requests(self, reqs: list[MtpRequest], failed: set[int],
                       kept_step: KeptStep | None
                       ) -> tuple[list[int], list[int], list[tuple[MtpRequest, int]],
                                  list[MtpRequest], list[MirrorBacklog | None]]:
        """mirror_and_propose's requests: (token ids and positions of the rows to mirror,
        backlogs first; (request, rows mirrored) of each mirrored one; the paused ones to
        keep (their rows not in the ring yet); each mirrored one's backlog or None). Failed
        requests and those with nothing new are left out; paused ones whose rows are in the
        ring already are deferred here, with no torch call."""
        ring = self.kept_rows
        ids: list[int] = []
        pos: list[int] = []
        kept: list[tuple[MtpRequest, int]] = []
        deferred: list[MtpRequest] = []
        backlogs: list[MirrorBacklog | None] = []
        for r in reqs:
            if r.serial in failed:
                continue
            n = sampled_rows(r, r.state)
            if n < 1:
                continue
            if r.paused and ring is not None and backlog.can_defer(r.state, r.context_len, n):
                if kept_step is not None:  # in the ring already: no torch call
                    backlog.defer(r.state, r.context_len, kept_step.at + r.start)
                else:
                    deferred.append(r)
                continue
            back = backlog.take(r.state, r.context_len)
            # (its oldest row: under async scheduling a step kept whole at launch may sit
            # before a row kept by the previous step's mirror)
            if back is not None and not (ring is not None and ring.holds(min(back.kept))):
                back = None  # overwritten (the request went unscheduled for long): dropped
            c0 = r.context_len if back is None else back.start
            pos.extend(range(c0, r.context_len + n))
            ids.extend(r.state.token_ids(c0 + 1, r.context_len + n + 1))
            kept.append((r, n))
            backlogs.append(back)
        return ids, pos, kept, deferred, backlogs

    def _mirror_through_graph(self, shape: StepShape, source: torch.Tensor,
                              src_rows: list[int] | None, kept: list[tuple[MtpRequest, int]],
                              lens: list[int], starts: list[int], ids: list[int],
                              deferred: list[MtpRequest], states: torch.Tensor | None,
                              propose: bool) -> dict[int, list[int]]:
        """mirror_and_propose's mirror and draft 1 as one graph replay (mirror_graphs.py;
        source: the step's raw states, or the ring of kept rows with src_rows: each row's
        slot, backlogs first; lens, starts: each request's rows mirrored, backlog included,
        and the first one's position), which feeds the draft graphs, staged first at its
        row count; then drafts 2..k replay and the drafts are read at once."""
        mirror, drafting = self.mirror_graphs, self.graphs
        assert mirror is not None and drafting is not None
        self.last_draft_probs = {}
        plan = drafting_rows(kept, self.max_model_len) if propose else None
        k = min(plan.depth(self.k), self.max_model_len - 1 - max(plan.lens)) if plan and plan.reqs else 0
        draft_shape = None
        if k >= 1:
            assert plan is not None
            start = [n - 1 for n in plan.lens]  # the just-sampled token's position
            tables = [self._row_table(j, r.block_ids, -(-(p + k - 1) // self.block_size))
                      for j, (r, p) in enumerate(zip(plan.reqs, start))]
            draft_shape, _ = drafting.stage(start, tables, rows=shape.rows)
            # (feed_first writes draft 1 into rows laid out at the mirror's padded count)
            assert draft_shape.rows == shape.rows, (draft_shape, shape)
            if self.confidence:
                self._prob_col.zero_()
        if src_rows is None:
            src_rows = [i for r, n in kept for i in range(r.start, r.start + n)]
        p1 = mirror.run(shape, source, src_rows, ids, starts, lens,
                        [r.block_ids for r, _ in kept], plan.picks if k >= 1 and plan else [])
        if deferred:  # (after the run's gather: its copy may reuse ring slots it read)
            assert states is not None
            self._keep_deferred(deferred, states, self._to_index([r.start for r in deferred]))
        if draft_shape is None:
            return {}
        assert plan is not None
        n = len(plan.reqs)
        result = drafting.replay(draft_shape, n, k - 1, first_column=1).tolist()  # the wait
        if p1 is not None:
            probs = torch.cat([p1[:, None], self._probs[:n, :k - 1]], dim=1).tolist()
            self.last_draft_probs = {r.serial: q for r, q in zip(plan.reqs, probs)}
        return plan.by_serial(result)

    def _graph_source(self, hidden: torch.Tensor | RawRows | KeptStep) -> torch.Tensor | None:
        """The step's raw states, which the mirror graphs gather from (None: kept in the
        ring, mirrored eagerly with the backlogs that brought them)."""
        if isinstance(hidden, KeptStep):
            return None
        return hidden.rows if isinstance(hidden, RawRows) else hidden

    def _keep_deferred(self, deferred: list[MtpRequest], states: torch.Tensor,
                       rows: torch.Tensor) -> None:
        """Keeps the paused requests' rows (`rows`: their one row each in `states`, on the
        device) in the ring, in one copy: the step's states are a buffer the next step may
        overwrite."""
        assert self.kept_rows is not None
        at = self.kept_rows.keep(states[rows])
        for j, r in enumerate(deferred):
            backlog.defer(r.state, r.context_len, at + j)

    def _propose(self, kept: list[tuple[MtpRequest, int]], out: torch.Tensor,
                 mirrored: MirrorPass | None = None,
                 plan: DraftingRows | None = None) -> dict[int, list[int]]:
        """Greedy drafts, up to k, fewer near max_model_len (as the draft model's)."""
        plan = plan or drafting_rows(kept, self.max_model_len)
        last, reqs, lens, picks = plan.last, plan.reqs, plan.lens, plan.picks
        self.last_draft_probs = {}
        if not reqs:
            return {}
        k = min(plan.depth(self.k), self.max_model_len - 1 - max(lens))
        if k < 1:
            return {}
        index = plan.last_index
        h = out[self._to_index(last) if index is None else index]
        ids, p = self._pick(h, 0)
        cols, probs = [ids], [p]
        depths = min(self.depths, k)
        if depths > 1:  # drafts 2..depths: MTP layers 2..depths (eagerly)
            assert self.chain is not None and mirrored is not None
            cols, more, h = self.chain.draft(mirrored, picks, ids, depths, self._pick)
            probs += more
            ids = cols[-1]
        drafts = torch.stack(cols, dim=1)
        if p is not None:
            self._prob_col.zero_()
        steps = k - depths
        if steps > 0:  # the last layer's own steps (CUDA graphs when captured)
            start = [n - 1 for n in lens]  # the just-sampled token's position
            need = [-(-(p + steps) // self.block_size) for p in start]
            tables = [self._row_table(j, r.block_ids, nb)
                      for j, (r, nb) in enumerate(zip(reqs, need))]
            drafts = torch.cat([drafts, self._greedy_steps(ids, h, start, tables, steps)],
                               dim=1)
        result = drafts.tolist()  # the one wait for the device
        if p is not None:
            probs_t = torch.stack([q for q in probs if q is not None], dim=1)
            probs_l = torch.cat([probs_t, self._probs[:len(reqs), :steps]], dim=1).tolist()
            self.last_draft_probs = {r.serial: q for r, q in zip(reqs, probs_l)}
        return plan.by_serial(result)

    def _input_states(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's input state of raw rows (RawRows; EAGLE-3: fc over aux states)."""
        return rows

    def _raw_width(self) -> int:
        """The width of a raw row (what on_launch keeps of a token; EAGLE-3: its aux states)."""
        return self._state_size()

    def _run_depth(self, depth: int, ids: torch.Tensor, positions: torch.Tensor,
                   hidden: torch.Tensor, md: Any) -> torch.Tensor:
        """The head's (MTP layer `depth`'s) output states."""
        if self.depths == 1:
            return self.model(ids, positions, hidden, md)
        return self.model(ids, positions, hidden, md, depth=depth)

    def _pick(self, h: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy ids of output states h of layer `depth`, and with confidence-scheduled
        verification their probabilities (else None)."""
        if self.confidence:
            return self._greedy_p(h, depth)
        if self.depths == 1:
            return self._greedy(h), None
        return self._logits(h, depth).argmax(dim=-1), None

    def _draft_step(self, ids: torch.Tensor, positions: torch.Tensor,
                    hidden: torch.Tensor | None, md: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        last = self.depths - 1  # past the chain, the last layer goes on alone
        assert hidden is not None
        h = self._run_depth(last, ids, positions, hidden, md)
        next_ids, p = self._pick(h, last)
        if p is None:
            return next_ids, h
        # Column j of the static buffer (modulo: graph warm-ups run the step more times)
        col = self._prob_col % self._probs.shape[1]
        self._probs[:p.shape[0]].index_copy_(1, col, p[:, None])
        self._prob_col.add_(1)
        return next_ids, h

    def _logits(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        if self.depths == 1:
            return self.model.compute_logits(h)
        return self.model.compute_logits(h, depth=depth)

    def _greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The head's greedy next token ids (the target's vocabulary) of output states h."""
        return self.model.compute_logits(h).argmax(dim=-1)

    def _greedy_p(self, h: torch.Tensor, depth: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """_greedy's ids and the head's probability of each (float32), from one logits."""
        logits = self._logits(h, depth)
        ids = logits.argmax(dim=-1)
        p = torch.exp(logits.amax(dim=-1).float() - torch.logsumexp(logits.float(), dim=-1))
        if hasattr(self.model, "to_target"):  # EAGLE-3: a draft vocabulary of its own
            ids = self.model.to_target(ids)
        return ids, p

    def _state_size(self) -> int:
        """The width of the head's states (DeepSeek-V4's: hyper-connection streams, hc * D)."""
        return int(getattr(self.model, "state_size", self.model.config.hidden_size))

    def _hidden_spec(self) -> tuple[int, torch.dtype]:
        return self._state_size(), self.dtype

    def capture_graphs(self, pool: Any, max_blocks: int,
                       graphs_type: type[DraftGraphs] = DraftGraphs) -> float:
        # Draft 1 comes from the mirror's output, drafts 2..depths from the chain of MTP
        # layers (eager): only the steps past them replay (none with k <= depths).
        if self.depths > 1:
            logger.info("mtp: drafts 2..%d run MTP layers 2..%d eagerly (not captured as "
                        "CUDA graphs yet)", self.depths, self.depths)
        if self.k <= self.depths:
            return 0.0
        took = super().capture_graphs(pool, max_blocks, graphs_type)
        if self.graph_mirror and self.depths == 1 and not dispatches_tokens(self.model):
            assert self.graphs is not None
            # (the draft graphs' table kind: a test's emulation is both's)
            self.mirror_graphs = MirrorGraphs(
                functools.partial(self._run_depth, 0), self._input_states,
                functools.partial(self._pick, depth=0), self.graphs.feed_first, self.backend,
                self.k, self.max_rows, max_blocks, self.device, block_size=self.block_size,
                raw=(self._raw_width(), self.dtype), confidence=self.confidence,
                sliding_window=self.sliding_window, table_type=type(self.graphs.table))
            took += self.mirror_graphs.capture(self.graphs.table.pool)
        return took

