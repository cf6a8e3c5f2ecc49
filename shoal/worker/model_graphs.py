"""The model runner's CUDA graphs: one GraphTable (worker/graph_table.py) of the model's forward
and logits for every step shape it replays, and how a step's inputs are laid out for a shape.

- decode: batches of one token per request, padded to capture_sizes (1, 2, 4, 8, then steps
  of 8 to 256, then of 16: vLLM's sizes); for a model whose decode work follows the block
  tables' width rather than each request's context (DeepSeek-V4: its decodes score or attend
  every compressed entry the tables could hold, masked per row), also per table width
  (table_widths: doubling from the model's `decode_table_buckets_from` tokens), and a step
  replays the narrowest that holds its longest request;
- verify: requests of up to k + 1 tokens each (speculative decoding), padded to q = d + 1 for
  d in draft_ladder(k) (a step replays the smallest q that holds its longest request: at batch
  32 on the H200, padding every request to 5 tokens made a verify step 1.42x a decode step),
  batches of up to 64 requests (the logits of B * q rows bound it; speculation pays at small
  batches); every token gives logits;
- a lone prefill chunk (what a lone request's first token waits for: a new prompt, or the
  tail after a prefix-cache hit), padded to 16 .. 512 tokens; the LM head runs on its last
  real token only.

Models with linear-attention layers capture these shapes too: a decode step that folds a
verify's accepted run into the states replays a verify graph; a lone chunk's padding is
masked out of the states (attention/linear_state.py StateGraphBuffers), and with prefix
caching only a chunk that starts at a block start replays one (its block-end saves are then
fixed by its graph's q).

Padding tokens write no KV (slot -1) and repeat their row's last position; padding rows are
empty. The runner takes the real rows' logits (and, for a hidden-state drafter, every real
token's final hidden state)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import token_slots
from shoal.host_to_device import to_device
from shoal.worker.graph_table import GraphTable, StepShape, round_up
from shoal.worker.step_inputs import StepInputs

PREFILL_GRAPH_SIZES = (16, 32, 64, 128, 256, 512)
# Speculation pays at small batches; the logits of B * (k + 1) rows bound the largest.
VERIFY_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256, then steps of 16, capped at max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    out = [s for s in sizes if s <= max_num_seqs]
    if not out or out[-1] < max_num_seqs:
        out.append(max_num_seqs)
    return out


def draft_ladder(k: int) -> list[int]:
    """The draft counts verify graphs are captured for: 1, 2, 4, ... and k."""
    counts, d = [], 1
    while d < k:
        counts.append(d)
        d *= 2
    return counts + [k]


def table_widths(max_blocks: int, narrowest: int) -> list[int]:
    """The narrower table widths (blocks) decode graphs are captured for besides the whole
    width: narrowest, twice that, ... up to half of max_blocks (none when narrowest is more).
    A step's decode work is then at most about twice its longest request's (or narrowest's):
    past the last width, the whole table's is."""
    if narrowest < 1:
        raise ValueError(f"the narrowest table width must be >= 1 block, got {narrowest}")
    widths, w = [], narrowest
    while 2 * w <= max_blocks:
        widths.append(w)
        w *= 2
    return widths


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int, *, prefill: bool = True,
                num_speculative_tokens: int = 0,
                decode_widths: Sequence[int] = ()) -> list[StepShape]:
    """decode_widths: narrower table widths (blocks) of decode graphs besides the whole one."""
    shapes = [StepShape(b, 1, 1, w) for b in capture_sizes(max_num_seqs)
              for w in (0, *decode_widths)]
    if prefill:
        shapes += [StepShape(1, n) for n in PREFILL_GRAPH_SIZES if n <= max_num_batched_tokens]
    if num_speculative_tokens:
        for d in draft_ladder(num_speculative_tokens):
            shapes += [StepShape(b, d + 1, d + 1) for b in VERIFY_GRAPH_SIZES
                       if b <= max_num_seqs]
    return shapes


class ModelGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 shapes: list[StepShape], max_blocks: int, device: torch.device, *,
                 block_size: int, windows: tuple[int | None, ...] = (None,),
                 keep_hidden: bool = False, table_type: type[GraphTable] = GraphTable,
                 group_backends: list[Any] | None = None):
        """windows: each KV cache group's sliding window; table_type: a test's stand-in for
        GraphTable (replays emulated on the CPU); group_backends: GraphTable's."""
        self.model = model
        # Hold each graph's hidden states (a hidden-state drafter reads them): otherwise they
        # are an intermediate whose pool memory the smaller graphs reuse.
        self.keep_hidden = keep_hidden
        self.block_size = block_size
        # Padding tokens of a row may attend up to q - 1 positions past its real ones.
        width = max_blocks + -(-max(s.q for s in shapes) // block_size)
        self.table = table_type(backend, shapes, width, device, block_size=block_size,
                                windows=windows, group_backends=group_backends)
        self.num_groups = len(windows)
        self.decode_sizes = sorted({s.rows for s in shapes if s.q == 1})
        # narrower decode tables (blocks) than the whole width, when the model has them
        self.decode_widths = sorted({s.blocks for s in shapes if s.q == 1 and s.blocks})
        self.prefill_sizes = sorted(s.q for s in shapes if s.rows == 1 and s.logits_per_row == 1)
        self.verify_qs = sorted({s.q for s in shapes if s.logits_per_row > 1})
        self.verify_sizes = sorted({s.rows for s in shapes if s.logits_per_row > 1})

    def capture(self) -> float:
        """Captures every shape in its own graph memory pool (the drafter's graphs share it)."""
        return self.table.capture(self._body, None, "model step")

    @property
    def pool(self) -> Any:
        return self.table.pool

    def invalidate_tables(self) -> None:
        self.table.invalidate_tables()

    def _body(self, shape: StepShape, tokens: torch.Tensor, md: Any
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, pos, last = tokens[0], tokens[1], tokens[2]
        hidden = self.model(ids, pos, md)
        if shape.logits_per_row == shape.q:  # decode, verify: every token's logits
            logits = self.model.compute_logits(hidden)
        else:  # a chunk: its last real token's
            logits = self.model.compute_logits(hidden.index_select(0, last[:shape.rows]))
        return logits, (hidden if self.keep_hidden else None)

    def pick(self, inp: StepInputs) -> StepShape | None:
        """The shape whose graph runs this step, or None (the step runs eagerly)."""
        n = len(inp.items)
        if inp.prompt_lp_spans or n == 0:
            return None
        # Linear-attention layers fold the run a request's last verify accepted into its
        # state: verify graphs do (decode graphs do not), so such decodes replay those.
        replays = any(it.replay for it in inp.items)
        if inp.num_decodes == n == inp.num_tokens and not replays:
            rows = round_up(n, self.decode_sizes)
            if rows is None:
                return None
            return self._known(StepShape(rows, 1, 1, self.decode_width(inp)))
        if inp.has_drafts or replays:
            if inp.pending_dst or not all(it.sample for it in inp.items):
                return None
            rows = round_up(n, self.verify_sizes)
            q = round_up(max(inp.query_lens()), self.verify_qs)
            return None if rows is None or q is None else self._known(StepShape(rows, q, q))
        if n == 1 and inp.num_decodes == 0 and inp.items[0].sample:
            q = round_up(inp.num_tokens, self.prefill_sizes)
            if q is None or not self._chunk_fits(inp.items[0].context_len):
                return None
            return self._known(StepShape(1, q))
        return None

    def _chunk_fits(self, context_len: int) -> bool:
        """Whether every KV cache group's buffers can hold a lone chunk after context_len
        tokens (a linear-state group's may not: StateGraphBuffers.chunk_fits)."""
        return all(b.chunk_fits(context_len) for b in self.table.group_backends
                   if hasattr(b, "chunk_fits"))

    def decode_width(self, inp: StepInputs) -> int:
        """The narrowest captured table width (blocks) holding the blocks of the step's
        longest request (its new token's included), or 0 (the whole width). A table may hold
        more blocks (ahead of its tokens): a decode reads none of them."""
        if not self.decode_widths:
            return 0
        longest = max(it.context_len + it.num_new_tokens for it in inp.items)
        return round_up(-(-longest // self.block_size), self.decode_widths) or 0

    def _known(self, shape: StepShape) -> StepShape | None:
        return shape if shape in self.table else None

    def run(self, shape: StepShape, inp: StepInputs,
            fill_pending: Callable[[torch.Tensor], None] | None, state_spec: Any = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Replays the step's graph; returns the logits of its sampling rows (in the order of
        inp.logits_index), when kept every real token's hidden states, and with them where
        the graph wrote each real token (its padded row, on the device; None: in order,
        first, or hidden not kept): what a drafter needs to read the model's other per-token
        buffers of the step (EAGLE-3's aux states). state_spec: the step's linear-attention
        replays and verifies (attention/linear_state.py StateSpecInputs), or None."""
        ids, pos, padded = self._layout(shape, inp)
        # Each row's last real token (read only by a chunk's shape: its logits row)
        last = ([r * shape.q + it.num_new_tokens - 1 for r, it in enumerate(inp.items)]
                if shape.logits_per_row != shape.q else [])
        context_lens = inp.context_lens()
        tables = [inp.block_tables(g) for g in range(self.num_groups)]
        staged = self.table.stage(shape, (ids, pos, last), context_lens, tables,
                                  [self._slots(shape, inp, context_lens, t) for t in tables],
                                  serials=[it.serial for it in inp.items],
                                  state_spec=state_spec)
        if fill_pending is not None:  # decodes and lone chunks: flat index = padded index
            fill_pending(staged[0])
        logits, hidden = self.table.replay(shape)
        if padded is None:  # one token per row, or one row: real tokens come first
            n = len(inp.logits_index)
            return logits[:n], (hidden[:inp.num_tokens] if hidden is not None else None), None
        device = logits.device
        rows = to_device([padded[i] for i in inp.logits_index], torch.long, device)
        real = None  # (only a drafter that keeps the hidden states reads per-token buffers)
        if hidden is not None:
            real = to_device(padded, torch.long, device)
            hidden = hidden.index_select(0, real)
        return logits.index_select(0, rows), hidden, real

    def _layout(self, shape: StepShape, inp: StepInputs
                ) -> tuple[list[int], list[int], list[int] | None]:
        """Token ids and positions of every row padded to shape.q, and the padded index of
        each real token (None when it is its own index)."""
        if shape.q == 1 or shape.rows == 1:
            pad = shape.q * len(inp.items) - inp.num_tokens
            return inp.input_ids, inp.positions + [inp.positions[-1]] * pad, None
        ids: list[int] = []
        pos: list[int] = []
        padded: list[int] = []
        flat = 0
        for r, it in enumerate(inp.items):
            n, pad = it.num_new_tokens, shape.q - it.num_new_tokens
            padded.extend(range(r * shape.q, r * shape.q + n))
            ids += inp.input_ids[flat:flat + n] + [0] * pad
            pos += inp.positions[flat:flat + n] + [inp.positions[flat + n - 1]] * pad
            flat += n
        return ids, pos, padded

    def _slots(self, shape: StepShape, inp: StepInputs, context_lens: list[int],
               tables: list[list[int]]) -> list[int]:
        """The slot of every padded token through a group's tables (-1 for padding)."""
        bs = self.block_size
        if shape.q == 1 or shape.rows == 1:
            pad = shape.q * len(inp.items) - inp.num_tokens
            return token_slots(inp.query_lens(), context_lens, tables, bs) + [-1] * pad
        slots: list[int] = []
        for it, table in zip(inp.items, tables):
            n = it.num_new_tokens
            slots += token_slots([n], [it.context_len], [table], bs) + [-1] * (shape.q - n)
        return slots
