"""Multi-layer MTP: drafting with several multi-token-prediction layers ("depths") of one
checkpoint, each with its own KV cache (HiddenStateDrafter runs it for heads with
num_depths > 1; shoal/spec_decode/mtp.py).

The chain (DeepSeek-V3's sequential MTP): depth j's row at position p reads depth j - 1's
output at p (depth 0: the target's final hidden state) and the token at p + j + 1, runs at
position p and writes its KV at p's slot; its logits predict the token at p + j + 2. So for a
sequence of L tokens (q = L - 2, the last position whose hidden state the target computed):

    draft 1     = depth 0 at q      (token t[L-1], the one just sampled)
    draft j + 1 = depth j at q      (token draft j, over depth j's cache up to q)

Depth j's rows at positions q - j + 1 .. q read drafts (positions p + j + 1 > L - 1), the
rows before read only known tokens. Hence two passes per target step:

- the mirror (`mirror`), once the step's tokens are known: depth j runs the rows whose tokens
  are now known and that no earlier mirror computed with known tokens, positions c - j ..
  c + n - 1 - j for a request whose step starts at c and mirrors n rows (the rows of depth 0
  shifted j back; their tokens are depth 0's: t[c + 1 .. c + n]). Its first row reads depth
  j - 1's output at c - j, the last row the previous mirror ran of depth j - 1: each request
  keeps that row of every depth but the last (`carry`). These rows overwrite what the last
  drafting pass wrote there from drafts, rejected or not, before anything reads it.
- the drafting pass (`draft`): depth j runs its j rows q - j + 1 .. q (tokens drafts 1..j),
  the first reading depth j - 1's last mirrored row, the others depth j - 1's drafting rows.

Where a row's input is missing (a request's first mirror after a prefix-cache hit or a
preemption: no carry), the rows of that depth start later and the positions before keep
whatever the cache held: those drafts can differ from the formula; what is verified stays
lossless. Positions below 0 (the start of a sequence) have no rows.

Drafts past the layer count (num_speculative_tokens k > n layers; vLLM cycles the layers and
asks k to be a multiple of n): the LAST depth goes on alone, as one MTP layer does for drafts
2..k: draft n + e is depth n - 1 at position q + e, reading draft n + e - 1 and its own
output at q + e - 1 (HiddenStateDrafter's greedy steps, captured as CUDA graphs). With k < n
only the first k depths are built. The mirror and the drafting pass of depths 1..n-1 run
eagerly (their queries are several tokens a request)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoal.host_to_device import to_device

# (depth, token ids, positions, previous states, attention metadata) -> output states
RunDepth = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
# (query lens, context lens, block tables, decodes first) -> attention metadata
BuildMetadata = Callable[[list[int], list[int], list[list[int]], int], Any]
# (output states, depth) -> (greedy ids, their probabilities or None)
Greedy = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class MirrorRequest:
    """A request of the mirror: its step's first position, rows mirrored, block table."""

    serial: int
    context_len: int
    num_rows: int
    block_ids: list[int]


@dataclass
class DepthRows:
    """One depth's rows in a pass, per request: the index of its first row (mirror: row i is
    position c - depth + i; drafting: row u is position q - depth + u), how many, and where
    they start in `out` (the depth's output states)."""

    first: list[int]
    count: list[int]
    offset: list[int]
    out: torch.Tensor

    def last_row(self, b: int) -> int:
        return self.offset[b] + self.count[b] - 1


@dataclass
class MirrorPass:
    """A mirror's requests and every depth's rows (depth 0's first)."""

    reqs: list[MirrorRequest]
    depths: list[DepthRows]


def _offsets(counts: list[int]) -> list[int]:
    out, n = [], 0
    for c in counts:
        out.append(n)
        n += c
    return out


def _leading_ones(counts: list[int]) -> int:
    n = 0
    while n < len(counts) and counts[n] == 1:
        n += 1
    return n


class MtpChain:
    """The mirror and drafting passes of depths 1..n-1, and each request's carry."""

    def __init__(self, run: RunDepth, metadata: BuildMetadata, depths: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, capacity: int):
        """capacity: requests whose carry is kept (the least recently mirrored go first: a
        request without one only loses draft quality)."""
        assert depths > 1
        self.run, self.metadata, self.depths = run, metadata, depths
        self.device = device
        self.carry = torch.zeros(capacity, depths - 1, hidden_size, dtype=dtype, device=device)
        self._slots: OrderedDict[int, int] = OrderedDict()  # serial -> row of carry (LRU)
        self._carry_pos: dict[int, list[int]] = {}  # serial -> position per depth (-1: none)

    def forget(self, serial: int) -> None:
        """The request's carry no longer holds (its step failed)."""
        self._carry_pos.pop(serial, None)

    def mirror(self, reqs: list[MirrorRequest], ids: torch.Tensor, out0: torch.Tensor
               ) -> MirrorPass:
        """Depths 1..n-1 of a mirror whose depth 0 ran `ids` (t[c + 1 .. c + n] of each
        request in turn) into `out0`; keeps each request's carry for the next mirror."""
        counts = [r.num_rows for r in reqs]
        rows = [DepthRows([0] * len(reqs), counts, _offsets(counts), out0)]
        ids_at = rows[0].offset  # depth 0's row 0 of each request in `ids`
        for j in range(1, self.depths):
            prev = rows[-1]
            first, count, src, carried = [], [], [], []
            for b, r in enumerate(reqs):
                pos = self._carry_pos.get(r.serial)
                at = r.context_len - j  # row 0's position
                use_carry = (prev.first[b] == 0 and at >= 0 and pos is not None
                             and pos[j - 1] == at)
                i0 = 0 if use_carry else prev.first[b] + 1
                first.append(i0)
                count.append(max(0, r.num_rows - i0))
                for i in range(i0, r.num_rows):
                    if i == 0:  # depth j - 1 at c - j: the last mirror's
                        src.append(-1 - len(carried))
                        carried.append(self._slots[r.serial])
                    else:
                        src.append(prev.offset[b] + i - 1 - prev.first[b])
            if not src:
                rows.append(DepthRows(first, count, _offsets(count), out0[:0]))
                continue
            states = prev.out
            if carried:
                states = torch.cat([states, self.carry[to_device(carried, torch.long,
                                                                  self.device), j - 1]])
                src = [s if s >= 0 else prev.out.shape[0] - 1 - s for s in src]
            live = [b for b, n in enumerate(count) if n]
            tok = [ids_at[b] + i for b in live for i in range(first[b], reqs[b].num_rows)]
            positions = [reqs[b].context_len - j + i for b in live
                         for i in range(first[b], reqs[b].num_rows)]
            lens = [count[b] for b in live]
            md = self.metadata(lens, [reqs[b].context_len - j + first[b] for b in live],
                               [reqs[b].block_ids for b in live], _leading_ones(lens))
            out = self.run(j, ids[to_device(tok, torch.long, self.device)],
                           to_device(positions, torch.long, self.device),
                           states[to_device(src, torch.long, self.device)], md)
            rows.append(DepthRows(first, count, _offsets(count), out))
        self._keep_carry(reqs, rows)
        return MirrorPass(reqs, rows)

    def _keep_carry(self, reqs: list[MirrorRequest], rows: list[DepthRows]) -> None:
        """Each request's last mirrored row of depths 0..n-2, for the next mirror."""
        for r in reqs:  # this batch's are the most recent: never evicted below
            if r.serial in self._slots:
                self._slots.move_to_end(r.serial)
        capacity = self.carry.shape[0]
        for j in range(self.depths - 1):
            slots, src = [], []
            for b, r in enumerate(reqs):
                pos = self._carry_pos.setdefault(r.serial, [-1] * (self.depths - 1))
                if not rows[j].count[b]:
                    pos[j] = -1
                    continue
                if r.serial not in self._slots:
                    if len(self._slots) >= capacity:
                        old, slot = self._slots.popitem(last=False)
                        self._carry_pos.pop(old, None)
                    else:
                        slot = len(self._slots)
                    self._slots[r.serial] = slot
                slots.append(self._slots[r.serial])
                src.append(rows[j].last_row(b))
                pos[j] = r.context_len + r.num_rows - 1 - j
            if slots:
                self.carry[:, j].index_copy_(0, to_device(slots, torch.long, self.device),
                                             rows[j].out[to_device(src, torch.long,
                                                                   self.device)])

    def draft(self, mirrored: MirrorPass, picks: list[int], first: torch.Tensor, depths: int,
              greedy: Greedy
              ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
        """Drafts 2..`depths` of the requests `picks` (indices into the mirror's requests,
        each sampled: q = its last mirrored position) from their draft 1 `first`. Returns
        the drafts' columns (draft 1's first), the probabilities of drafts 2..depths (None
        without confidence), and the last depth's output state at q (what drafts past the
        depths feed back)."""
        reqs, rows = mirrored.reqs, mirrored.depths
        cols: list[torch.Tensor] = [first]
        probs: list[torch.Tensor | None] = []
        chain: DepthRows | None = None  # depth j - 1's drafting rows
        last = first.new_empty(0)
        for j in range(1, depths):
            below = rows[j - 1]
            drafts = torch.stack(cols, dim=1).reshape(-1)  # [len(picks) * j]
            u0s, src, tok, positions, ctx, mirror_rows = [], [], [], [], [], []
            for s, b in enumerate(picks):
                r = reqs[b]
                q = r.context_len + r.num_rows - 1
                has_last = below.count[b] > 0  # depth j - 1 at q - j + 1
                u0 = 1 if has_last else (chain.first[s] + 1 if chain else j)
                u0s.append(u0)
                for u in range(u0, j + 1):
                    if u == 1:  # (-1: the k-th row of mirror_rows is -1 - k)
                        src.append(-1 - len(mirror_rows))
                        mirror_rows.append(below.last_row(b))
                    else:
                        assert chain is not None
                        src.append(chain.offset[s] + u - 1 - chain.first[s])
                    tok.append(s * j + u - 1)
                    positions.append(q - j + u)
                ctx.append(q - j + u0)
            states = chain.out if chain is not None else below.out[:0]
            if mirror_rows:  # rows reading depth j - 1's last mirrored row
                n_chain = states.shape[0]
                states = torch.cat([states, below.out[to_device(mirror_rows, torch.long,
                                                                self.device)]])
                src = [x if x >= 0 else n_chain - 1 - x for x in src]
            counts = [j + 1 - u for u in u0s]
            md = self.metadata(counts, ctx, [reqs[b].block_ids for b in picks],
                               _leading_ones(counts))
            out = self.run(j, drafts[to_device(tok, torch.long, self.device)],
                           to_device(positions, torch.long, self.device),
                           states[to_device(src, torch.long, self.device)], md)
            chain = DepthRows(u0s, counts, _offsets(counts), out)
            last = out[to_device([chain.last_row(s) for s in range(len(picks))], torch.long,
                                 self.device)]
            ids, p = greedy(last, j)
            cols.append(ids)
            probs.append(p)
        return cols, probs, last
