"""The model runner's side of images: the encoder cache (outputs by content hash, exactly
the entries the scheduler's EncoderSchedule names), the encoder runs a step asks for, and
each step's input rows of encoder outputs and M-RoPE positions.

A step over image positions runs eagerly: its input embeddings are the token embeddings
with the encoder outputs placed over the images' positions (a chunk that reaches into an
image reads the slice of its output that the chunk covers). M-RoPE models (Qwen-VL) give
image tokens 3-D positions; text tokens have three equal streams shifted by the request's
delta, which is plain rotary at the shifted position, so decode steps keep their CUDA
graphs with 1-D positions, and so does a step of prompt text past a request's images (the
images in a cached prefix: a repeated request, a chat's next turn).

EVS (video_pruning_rate): a video's prompt holds pads only for the tokens pruning keeps, so
its positions are known only once the tower has run: the model's prune_video gives the kept
rows (cached) and their original (t, h, w) positions, which overwrite the placeholder
positions of every request's span of that video before a step reads them.

Prompt logprobs under EVS: the prompt (and the prompt_token_ids a user gets back) keeps the
planned layout, while a Qwen3-VL span reads its timestamp texts where the kept tokens put
them, so at some span positions the model reads another token than the prompt's. Those
positions' prompt logprobs are left None (as the first token's): scoring the prompt's id
there would score a token the model never read at that place. Every other position, pads
included, scores the prompt's id, so the list still lines up with prompt_token_ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.core.scheduler_output import SchedulerOutput
from shoal.host_to_device import tensor_to_device
from shoal.worker.request_state import RequestState
from shoal.worker.step_inputs import StepInputs


@dataclass
class MultiModalStepInputs:
    rows: torch.Tensor | None  # [n, D]: encoder outputs in the step's flat order
    mask: torch.Tensor | None  # [T] bool: the flat positions they go to
    positions: torch.Tensor | None  # [3, T] M-RoPE positions (None: the step's own)


@dataclass
class _MRope:
    positions: torch.Tensor  # [3, L] of the prompt (host)
    delta: int  # a token at index i >= L is at position i + delta


class MultiModalRunner:
    def __init__(self, model: Any, device: torch.device):
        self.model, self.device = model, device
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.cache: dict[str, torch.Tensor] = {}
        self.mrope: dict[int, _MRope] = {}  # request serial -> its prompt's positions
        self.prunes = hasattr(model, "prune_video")
        self.kept_positions: dict[str, torch.Tensor] = {}  # video identifier -> [3, kept]
        # video identifier -> the ids the model reads over its span, where not the prompt's
        self.span_ids: dict[str, np.ndarray] = {}
        # serial -> prompt positions whose prompt token the model does not read there
        self.unread: dict[int, frozenset[int]] = {}
        self.pending: dict[int, list[Any]] = {}  # serial -> videos whose positions wait
        self.num_encoded = 0  # images encoded (tests count them)

    def begin_step(self, sched: SchedulerOutput, states: dict[int, RequestState]) -> None:
        """New requests' M-RoPE positions; the cache's evictions, then its new entries."""
        if self.uses_mrope:
            for new in sched.new_requests:
                if new.mm_features and new.serial not in self.mrope:
                    pos, delta = self.model.get_mrope_positions(new.prompt_token_ids,
                                                                new.mm_features)
                    self.mrope[new.serial] = _MRope(pos, delta)
                    videos = [f for f in new.mm_features if f.modality == "video"]
                    if videos and self.prunes:
                        self.pending[new.serial] = videos
        for ident in sched.encoder_free:
            self.cache.pop(ident, None)
            self.kept_positions.pop(ident, None)
            self.span_ids.pop(ident, None)
        if sched.encoder_inputs:
            self._encode(sched, states)
        if self.pending:
            self._place_videos(states)

    def _encode(self, sched: SchedulerOutput, states: dict[int, RequestState]) -> None:
        todo: dict[str, Any] = {}
        for serial, index in sched.encoder_inputs:
            feature = states[serial].mm_features[index]
            todo.setdefault(feature.identifier, feature)
        outputs = self.model.embed_multimodal(list(todo.values()))
        for (ident, feature), out in zip(todo.items(), outputs):
            if feature.modality == "video" and self.prunes:
                span = self.model.prune_video(feature, out)
                out, self.kept_positions[ident] = span.rows, span.positions
                if span.token_ids is not None:
                    self.span_ids[ident] = span.token_ids
            self.cache[ident] = out
        self.num_encoded += len(todo)

    def _place_videos(self, states: dict[int, RequestState]) -> None:
        """Pending video spans whose kept positions are known take them, offset by the
        span's first position (its first token, always kept, is at (start, start, start)),
        and note the span positions where the model reads another id than the prompt's."""
        for serial in list(self.pending):
            rope, left = self.mrope.get(serial), []
            for f in self.pending[serial]:
                rel = self.kept_positions.get(f.identifier)
                if rel is None:
                    left.append(f)
                    continue
                if rope is not None:
                    span = rope.positions[:, f.offset:f.end]
                    span.copy_(rel + span[0, 0])
                seen = self.span_ids.get(f.identifier)
                if seen is not None and serial in states:
                    planned = np.asarray(states[serial].prompt_token_ids[f.offset:f.end])
                    moved = f.offset + np.flatnonzero(planned != seen)
                    self.unread[serial] = self.unread.get(serial, frozenset()) | frozenset(
                        moved.tolist())
            if left:
                self.pending[serial] = left
            else:
                del self.pending[serial]

    def remove(self, serials: set[int]) -> None:
        for serial in serials:
            self.mrope.pop(serial, None)
            self.pending.pop(serial, None)
            self.unread.pop(serial, None)

    def reset(self) -> None:
        self.cache.clear()
        self.kept_positions.clear()
        self.span_ids.clear()

    def prepare(self, inp: StepInputs) -> None:
        """Sets inp.mm for a step that places encoder outputs or needs 3-D positions, and
        shifts the 1-D positions of M-RoPE requests by their delta; hands the prompt
        logprobs the positions they leave None (unread)."""
        for serial, *_ in inp.prompt_lp_spans:
            if serial in self.unread:
                inp.prompt_lp_unread[serial] = self.unread[serial]
        rows: list[torch.Tensor] = []
        flat: list[int] = []
        tables: list[tuple[int, int, int, _MRope]] = []  # (flat start, ctx, n, positions)
        for it, st, start in zip(inp.items, inp.states, inp.starts()):
            ctx, n = it.context_len, it.num_new_tokens
            for f in st.mm_features or ():
                if f.offset >= ctx + n or f.end <= ctx:
                    continue
                lo, hi = max(ctx, f.offset), min(ctx + n, f.end)
                e0, e1 = f.embeds_before(lo), f.embeds_before(hi)
                if e1 > e0:
                    rows.append(self.cache[f.identifier][e0:e1])
                mask = f.embed_mask
                flat.extend(start + p - ctx for p in range(lo, hi)
                            if mask is None or mask[p - f.offset])
            rope = self.mrope.get(it.serial) if self.uses_mrope else None
            if rope is not None:
                if ctx < rope.positions.shape[1] and not _text_only(inp, start, ctx, n, rope):
                    tables.append((start, ctx, n, rope))
                elif ctx >= rope.positions.shape[1] and rope.delta:
                    for j in range(start, start + n):
                        inp.positions[j] += rope.delta
        if not rows and not tables:
            return
        inp.mm = MultiModalStepInputs(
            torch.cat(rows) if rows else None,
            self._mask(flat, inp.num_tokens) if rows else None,
            self._positions(inp, tables) if tables else None)

    def _mask(self, flat: list[int], num_tokens: int) -> torch.Tensor:
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        mask[torch.tensor(flat, dtype=torch.long)] = True
        return tensor_to_device(mask, self.device)

    def _positions(self, inp: StepInputs, tables: list[tuple[int, int, int, _MRope]]
                   ) -> torch.Tensor:
        """[3, T]: each stream the step's 1-D positions (already shifted), then the prompt
        rows of the requests that have 3-D ones."""
        pos = torch.tensor(inp.positions, dtype=torch.long).expand(3, -1).clone()
        for start, ctx, n, rope in tables:
            length = rope.positions.shape[1]
            end = min(ctx + n, length)
            pos[:, start:start + end - ctx] = rope.positions[:, ctx:end]
            if ctx + n > length:  # outputs recomputed after a preemption
                pos[:, start + end - ctx:start + n] += rope.delta
        return tensor_to_device(pos, self.device)


def _text_only(inp: StepInputs, start: int, ctx: int, n: int, rope: _MRope) -> bool:
    """Whether a request's prompt tokens in this step are text (three equal position
    streams: plain rotary at one shifted position). If so their positions go into the
    step's 1-D positions, shifted like a decode's past the prompt, and need no 3-D table:
    a step of such text alone (a prompt whose images sit in a cached prefix: a repeated
    request, the next turn of a chat) keeps its CUDA graph."""
    end = min(ctx + n, rope.positions.shape[1])
    span = rope.positions[:, ctx:end]
    if not (torch.equal(span[0], span[1]) and torch.equal(span[0], span[2])):
        return False
    inp.positions[start:start + end - ctx] = span[0].tolist()
    for j in range(start + end - ctx, start + n):  # (outputs recomputed after a preemption)
        inp.positions[j] += rope.delta
    return True
