"""Drafting from the target's hidden states: methods "mtp" and "eagle".

Both draft with a small "head" that reads the target's final (normed) hidden states: "mtp"
with DeepSeek-V3's multi-token-prediction layer (shoal/models/deepseek_mtp.py; DeepSeek-V4's,
whose hidden states are hyper-connection streams: deepseek_v4_mtp.py), "eagle" with
an EAGLE-1 head for a Llama-family target (shoal/models/llama_eagle.py). HiddenStateDrafter
runs either; a head is a module with

    head(next_ids, positions, prev_hidden, attn_metadata) -> output state (one row each)
    head.compute_logits(output state) -> logits over the target's vocabulary
    head.attention_layers() -> its attention layers (their KV cache is the drafter's)

built and loaded by build_mtp_head / build_eagle_head. The output state is also what a
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

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shoal.config import EngineConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.host_to_device import to_device
from shoal.loader.dummy import initialize_dummy_weights
from shoal.models.deepseek_mtp import DeepseekMTP, DeepseekMTPDepths, mtp_prefix
from shoal.models.qwen3_next import Qwen3NextForCausalLM
from shoal.models.qwen3_next_mtp import PREFIX as QWEN_MTP_PREFIX
from shoal.models.qwen3_next_mtp import Qwen3NextMTP
from shoal.spec_decode import mirror_backlog as backlog
from shoal.spec_decode.draft_graphs import DraftGraphs
from shoal.spec_decode.drafter_cache import DrafterCache
from shoal.spec_decode.drafting_rows import DraftingRows, drafting_rows
from shoal.spec_decode.mirror_backlog import MirrorBacklog, RawRows
from shoal.spec_decode.mtp_chain import MirrorPass, MirrorRequest, MtpChain
from shoal.spec_decode.mtp_target import check_mtp_target, is_v4, mtp_layer_count
from shoal.worker.drafter import TargetStep

logger = logging.getLogger(__name__)


@dataclass
class MtpRequest:
    """One request of a target step, as the mirror needs it."""

    serial: int
    start: int  # its first token's row in the step's hidden states
    context_len: int
    num_new_tokens: int
    block_ids: list[int]
    state: Any  # the runner's RequestState: prompt + outputs, read once the step is sampled
    sample: bool
    paused: bool = False  # its drafts are not wanted next step: deferred (mirror_backlog.py)


def read_mtp_tensors(source: str, hf_config: Any,
                     prefix: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One MTP layer's tensors of a safetensors folder (only those are read), one at a time
    in the checkpoint's dtype (dequantized, when the checkpoint is quantized: see
    shoal/quantization): DeepSeek-V3's layer holds 256 experts. prefix: the layer's
    (DeepSeek's first, model.layers.{n}., by default)."""
    from safetensors import safe_open

    from shoal.loader.safetensors_loader import safetensors_files
    from shoal.quantization.config import detect_quantization
    from shoal.quantization.weights import dequantized_weights

    prefix = prefix or mtp_prefix(hf_config)
    found = 0

    def stored() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal found
        for file in safetensors_files(Path(source)):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name.startswith(prefix):
                        found += 1
                        yield name, handle.get_tensor(name)

    qconfig = detect_quantization(hf_config, Path(source))  # a quantized checkpoint's layer
    yield from (stored() if qconfig is None else dequantized_weights(stored, qconfig)())
    if not found:
        raise ValueError(
            f"speculative_config: method 'mtp': {source} has no multi-token-prediction "
            f"tensors ({prefix}*), although its config has {mtp_layer_count(hf_config)} "
            "MTP layers")


class DraftHead(Protocol):
    """What HiddenStateDrafter drafts with (see the module's docstring)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 prev_hidden: torch.Tensor, md: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list[Any]: ...


def build_mtp_head(config: EngineConfig, target: nn.Module, loaded: Any) -> nn.Module:
    """The target's MTP layers (method "mtp"), loaded from the target's checkpoint: the
    first min(layers, num_speculative_tokens) of them (mtp_chain.py)."""
    hf = loaded.hf_config
    spec = config.speculative_config
    k = spec.num_speculative_tokens if spec is not None else 1
    depths = max(1, min(mtp_layer_count(hf), k))
    if mtp_layer_count(hf) > 1:
        logger.info("mtp: the checkpoint has %d MTP layers; drafts 1..%d use the first %d "
                    "in a chain%s", mtp_layer_count(hf), depths, depths,
                    f", the later {k - depths} the last one alone" if k > depths else "")
    if is_v4(hf):
        return _v4_mtp_head(config, target, loaded, depths)
    if isinstance(target, Qwen3NextForCausalLM):  # (Qwen3.5's classes too)
        return _qwen_mtp_head(config, target, loaded, depths)
    check_mtp_target(hf)
    dtype = config.model_config.dtype
    with torch.device(config.device):
        head: nn.Module = (DeepseekMTP(hf, dtype, use_triton_ops=config.use_triton_ops)
                           if depths == 1 else
                           DeepseekMTPDepths(hf, dtype, depths, config.use_triton_ops))
    if config.model_config.load_format == "dummy":
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.share_with(target, embed=True, head=True)
    else:
        if loaded.load_format != "safetensors":
            raise ValueError("speculative_config: method 'mtp' loads its layer from a "
                             f"safetensors folder, not {loaded.load_format}")
        for j, layer in enumerate([head] if depths == 1 else head.layers):
            layer.load_weights(read_mtp_tensors(loaded.source, hf, mtp_prefix(hf, j)), target)
    return head.eval()


def _qwen_mtp_head(config: EngineConfig, target: nn.Module, loaded: Any,
                   depths: int) -> nn.Module:
    """Qwen3-Next's / Qwen3.5's MTP layers (mtp.*), on the target's embedding and head."""
    hf = loaded.hf_config
    check_mtp_target(hf, qwen=True)
    with torch.device(config.device):
        head = Qwen3NextMTP(hf, config.model_config.dtype, target,
                            use_triton_ops=config.use_triton_ops, depths=depths)
    if config.model_config.load_format == "dummy":
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
    elif loaded.load_format != "safetensors":
        raise ValueError("speculative_config: method 'mtp' loads its layer from a "
                         f"safetensors folder, not {loaded.load_format}")
    else:
        head.load_weights(read_mtp_tensors(loaded.source, hf, QWEN_MTP_PREFIX))
    return head.eval()


def _v4_mtp_head(config: EngineConfig, target: nn.Module, loaded: Any,
                 depths: int) -> nn.Module:
    """DeepSeek-V4's first `depths` MTP layers (mtp.{j}.*), chained as V3's are; the target
    hands them its hyper-connection streams from now on."""
    from shoal.models.deepseek_v4_mtp import DeepseekV4MTP, DeepseekV4MTPDepths, mtp_prefix

    hf = loaded.hf_config
    check_mtp_target(hf)
    dtype, ops = config.model_config.dtype, config.use_triton_ops
    with torch.device(config.device):
        head: nn.Module = (DeepseekV4MTP(hf, dtype, ops) if depths == 1 else
                           DeepseekV4MTPDepths(hf, dtype, depths, ops))
    if config.model_config.load_format == "dummy":
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.share_with(target, embed=True, head=True)
    elif loaded.load_format != "safetensors":
        raise ValueError("speculative_config: method 'mtp' loads its layer from a "
                         f"safetensors folder, not {loaded.load_format}")
    else:
        for j, layer in enumerate([head] if depths == 1 else head.layers):
            layer.load_weights(read_mtp_tensors(loaded.source, hf, mtp_prefix(j)), target)
    target.output_streams()
    return head.eval()


class HiddenStateDrafter(DrafterCache):
    """Methods "mtp" and "eagle": `head` (a DraftHead) drafts k tokens greedily from the
    target's hidden states, with a KV cache of its own on the target's block tables."""

    keeps_hidden = True

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

    def on_launch(self, step: TargetStep) -> torch.Tensor | None:
        """Mirrored once sampled (propose): it needs the next tokens. A graph's hidden states
        are its static output, which the next step (launched before this one is mirrored,
        with async scheduling) may overwrite: a copy then (an eager step's are its own)."""
        hidden = step.hidden
        if hidden is not None and step.hidden_static and self.async_scheduling:
            return hidden.clone()
        return hidden

    def propose(self, step: TargetStep, state: torch.Tensor | None, out: ModelRunnerOutput,
                latest: bool) -> None:
        inp = step.inputs
        assert state is not None, "a hidden-state drafter without the target's hidden states"
        reqs = [MtpRequest(it.serial, start, it.context_len, it.num_new_tokens, it.block_ids,
                           st, it.sample, it.drafts_paused)
                for it, st, start in zip(inp.items, inp.states, inp.starts())]
        drafts = self.mirror_and_propose(reqs, state, out.failed_serials, propose=latest)
        for serial, d in drafts.items():
            if d and serial in out.sampled_token_ids:
                out.draft_token_ids[serial] = d
                if serial in self.last_draft_probs:
                    out.draft_probs[serial] = self.last_draft_probs[serial]

    @torch.inference_mode()
    def mirror_and_propose(self, reqs: list[MtpRequest], hidden: torch.Tensor | RawRows,
                           failed: set[int], propose: bool = True) -> dict[int, list[int]]:
        """Mirrors a sampled target step (hidden: its final hidden states, one row per
        token; EAGLE-3: RawRows, its aux states) into the head's cache and drafts for its
        sampling requests (serial -> drafts; none with propose=False: the mirror is then
        only queued, nothing waits for the device). `failed`: requests whose step produced
        non-finite values (neither mirrored nor drafted). A paused request's rows are kept
        instead (mirror_backlog.py); the first later step that mirrors it runs them first."""
        rows: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        kept: list[tuple[MtpRequest, int]] = []  # (request, rows mirrored)
        deferred: list[tuple[MtpRequest, int]] = []
        backlogs: list[MirrorBacklog | None] = []
        for r in reqs:
            if r.serial in failed:
                continue
            n = min(r.num_new_tokens, r.state.num_tokens - 1 - r.context_len)
            if n < 1:
                continue
            if (r.paused and self.chain is None  # (a chain's carry wants every mirror)
                    and backlog.can_defer(r.state, r.context_len, n)):
                deferred.append((r, n))
                continue
            back = backlog.take(r.state, r.context_len)
            c0 = r.context_len if back is None else back.start
            rows.extend(range(r.start, r.start + n))
            pos.extend(range(c0, r.context_len + n))
            ids.extend(r.state.token_ids(c0 + 1, r.context_len + n + 1))
            kept.append((r, n))
            backlogs.append(back)
        if self.chain is not None:
            for serial in failed:
                self.chain.forget(serial)
        if deferred:
            backlog.defer_rows([(r.state, r.context_len, r.start, n) for r, n in deferred],
                               hidden, self.device)
        if not kept:
            return {}
        caught = [0 if b is None else r.context_len - b.start for (r, _), b in zip(kept, backlogs)]
        lens = [n + c for (_, n), c in zip(kept, caught)]
        num_decodes = 0
        while num_decodes < len(lens) and lens[num_decodes] == 1:
            num_decodes += 1
        # Every index list of the pass goes to the device with the metadata, in one copy
        # (each copy of its own costs the host a few Python-issued torch calls).
        states = hidden.rows if isinstance(hidden, RawRows) else hidden
        gather = all(b is None for b in backlogs) and len(rows) != states.shape[0]
        sel = [s + i for s, c, n in zip(accumulate(lens, initial=0), caught, lens)
               for i in range(c, n)] if any(caught) else []
        plan = drafting_rows(kept, self.max_model_len) if propose else None
        carry = [ids, pos, rows if gather else [], sel, plan.last if plan else []]
        md, (ids_t, pos_t, rows_t, sel_t, last_t) = self._metadata_and_inputs(
            lens, [r.context_len - c for (r, _), c in zip(kept, caught)],
            [r.block_ids for r, _ in kept], num_decodes, carry)
        h = backlog.mirror_states(hidden, rows, [(r.start, n) for r, n in kept], backlogs,
                                  self._input_states, self.device,
                                  row_index=rows_t if gather else None)
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

    def _propose(self, kept: list[tuple[MtpRequest, int]], out: torch.Tensor,
                 mirrored: MirrorPass | None = None,
                 plan: DraftingRows | None = None) -> dict[int, list[int]]:
        """Greedy drafts, up to k, fewer near max_model_len (as the draft model's)."""
        plan = plan or drafting_rows(kept, self.max_model_len)
        last, reqs, lens, picks = plan.last, plan.reqs, plan.lens, plan.picks
        self.last_draft_probs = {}
        if not reqs:
            return {}
        k = min(self.k, self.max_model_len - 1 - max(lens))
        if k < 1:
            return {}
        index = plan.last_index
        h = out[to_device(last, torch.long, self.device) if index is None else index]
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
        return {r.serial: d for r, d in zip(reqs, result)}

    def _input_states(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's input state of raw rows (RawRows; EAGLE-3: fc over aux states)."""
        return rows

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
        return super().capture_graphs(pool, max_blocks, graphs_type)

