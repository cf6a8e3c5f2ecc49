"""What every linear-attention layer (Gated DeltaNet, Kimi Delta Attention) shares: its
recurrent state in the paged pool, and the walk of a step over it.

A layer declares a LinearStateSpec (its conv and delta-rule state shapes); the runner binds it
to the cache tensor it shares with the attention layers (`kv_cache`), whose pages then hold
its states (shoal/attention/linear_state.py). A step runs its decodes as one batch through
the recurrent form (one read and one write of each state), then each prefill chunk through
the chunked form, from the state its metadata names and into the blocks it names.

A subclass says how a token becomes the conv input (`conv_input`), how the convolved
channels become the delta rule's q and k per key head, v per value head, log-decay g and
beta (`heads`; `mix` then L2-norms q and k and repeats them to the value heads), and how the
output becomes the hidden state (`output`). On CUDA a decode batch runs two Triton kernels
that update the states in place in their pages (shoal/layers/ops/linear_state_decode.py), on
the CPU one C++ call (shoal/layers/ops/cpu_linear_state.py); the torch ops are the reference.
A CUDA step of decodes only goes further (shoal/layers/ops/linear_decode_fused.py): from the
conv input to what the out-projection takes, gates and output norm included, in one or two
kernels, where the subclass hands over its gates (`decode_gates`).
Speculative decoding: a verify keeps its tokens' inputs (shoal/layers/linear_replays.py) and
the next step folds the accepted run in; a verify graph's rows do both at fixed shapes
(StateRows, shoal/layers/ops/delta_rule_rows.py). A prefill graph's chunk is padded to the
graph's q tokens: its real count is a device value (StateChunk.count), the padding gets
g = 0 and beta = 0 (identity steps of the delta rule) and the conv window is taken after the
last real token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal import envs
from shoal.attention.linear_state import (
    StateChunk,
    StateFold,
    StateMetadata,
    StatePages,
    StateRows,
)
from shoal.attention.metadata import GroupedMetadata
from shoal.core.kv_cache_spec import LinearStateSpec
from shoal.host_to_device import to_device
from shoal.layers.linear_replays import KeptInputs
from shoal.layers.ops import cpu_linear_state, fla_chunk, linear_decode_fused
from shoal.layers.ops import linear_state_decode as decode_kernels
from shoal.layers.ops.delta_rule_rows import causal_conv1d_rows, gated_delta_rule_rows
from shoal.layers.ops.gated_delta_rule import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

Rest = tuple[torch.Tensor, ...]  # per-token tensors beside the conv input, [T, ...] each


# EARLY_READS: the decode kernels read their block ids and states before they wait on the
# kernel before (shoal/pdl.py). Safe because in a step nothing writes those states but the
# decode kernels themselves and torch ops (a speculative step's fold, just before them;
# prefill chunks; tier restores), and torch ops are not launched with PDL: a kernel that is
# starts only once the torch op before it has finished. A fold written by a PDL kernel
# would have to pass early_states=False.


def triton_decode(x: torch.Tensor) -> bool:
    """Whether decode rows run the Triton kernels: CUDA tensors. (A seam: the tests and
    benchmarks/hybrid_decode_trace.py run CPU tensors through them in Triton's interpreter.)"""
    return x.is_cuda


def fused_decode_enabled() -> bool:
    return envs.SHOAL_LINEAR_DECODE_FUSED.get()


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim (float32), as fla's kernels normalize q and k."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def padding_masked(heads: tuple[torch.Tensor, ...], real: torch.Tensor | None
                   ) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta zeroed at the tokens where real [T] is False: each is then an
    identity step of the delta rule (g = 0: no decay, beta = 0: nothing written), so a padded
    chunk leaves the states its real tokens leave. q, k and v are zeroed too (torch.where,
    which does not carry a NaN along): a padding token attends to cache slots past the real
    ones, which may hold an earlier linear state's float32 words, non-finite as bf16, and
    0 x NaN in the chunk's products would poison the state. None: every token is real."""
    if real is None:
        return heads

    def zeroed(x: torch.Tensor) -> torch.Tensor:
        keep = real.view(-1, *(1,) * (x.dim() - 1))
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

    return tuple(zeroed(x) for x in heads)


class LinearAttention(nn.Module):
    def __init__(self, *, conv_dim: int, conv_kernel: int, state_heads: int, key_dim: int,
                 value_dim: int, conv_parts: tuple[int, ...]):
        """Per rank: conv_dim channels convolved over conv_kernel taps, in consecutive parts
        each split over the ranks (LinearStateSpec.conv_parts); state_heads delta-rule heads
        of key_dim x value_dim."""
        super().__init__()
        if sum(conv_parts) != conv_dim:
            raise ValueError(f"conv_parts {conv_parts} do not add up to conv_dim {conv_dim}")
        self.conv_dim, self.conv_kernel, self.conv_parts = conv_dim, conv_kernel, conv_parts
        self.state_heads, self.key_dim, self.value_dim = state_heads, key_dim, value_dim
        self.scale = key_dim ** -0.5
        self.kv_group = 0  # its KV cache group (a linear-state group)
        self.backend: Any = None  # set by the runner like an attention layer's; unused
        self._cache: torch.Tensor | None = None
        self.pages: StatePages | None = None
        self.block_size = 0
        # speculative decoding: each verifying request's tokens (conv input and the rest of
        # its projections) in its slot until the next step folds the accepted run in;
        # allocated with the pages once keep_replays() has sized it
        self.kept: KeptInputs | None = None
        self._kept_size: tuple[int, int, torch.dtype] | None = None

    # ---- the cache ------------------------------------------------------------------------
    def kv_cache_spec(self, dtype_bytes: int) -> LinearStateSpec:
        """Its state; the page row (planes, heads, head size, dtype) is the attention
        layers' it shares pages with, filled in by the runner (kv_cache_tensors.py)."""
        return LinearStateSpec(0, 0, dtype_bytes, conv_dim=self.conv_dim,
                               conv_width=self.conv_kernel - 1, state_heads=self.state_heads,
                               key_dim=self.key_dim, value_dim=self.value_dim,
                               conv_parts=self.conv_parts)

    def bind_pages(self, cache: torch.Tensor, block_size: int) -> None:
        self._cache, self.block_size = cache, block_size
        self.pages = StatePages(cache, block_size, (self.conv_dim, self.conv_kernel - 1),
                                (self.state_heads, self.key_dim, self.value_dim))
        if self._kept_size is not None:
            slots, tokens, dtype = self._kept_size
            self.kept = KeptInputs(slots, tokens, self.replay_width, dtype, cache.device)

    def keep_replays(self, slots: int, tokens: int, dtype: torch.dtype) -> None:
        """Speculative decoding: keep up to `tokens` verified tokens of `slots` requests (the
        buffer comes with the pages, whose memory budget left room for it)."""
        self._kept_size = (slots, tokens, dtype)
        if self._cache is not None:
            self.bind_pages(self._cache, self.block_size)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self._cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor | None) -> None:
        if cache is None:
            self._cache, self.pages, self.kept = None, None, None
        elif self.block_size:
            self.bind_pages(cache, self.block_size)
        else:
            raise RuntimeError("bind a linear-attention layer with bind_pages(cache, block_size)")

    # ---- what a subclass defines ------------------------------------------------------------
    def conv_input(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Rest]:
        raise NotImplementedError

    @property
    def replay_width(self) -> int:
        """Values a token's conv input and rest hold (what a verify keeps per token for its
        replay, in the model dtype)."""
        raise NotImplementedError

    def heads(self, y: torch.Tensor, rest: Rest) -> tuple[torch.Tensor, ...]:
        """q, k [n, Hk, Dk] (any dtype, not normed), v [n, H, Dv], g [n, H] or [n, H, Dk]
        and beta [n, H] (float32)."""
        raise NotImplementedError

    def gates(self, rest: Rest) -> tuple[torch.Tensor, torch.Tensor]:
        """heads()'s g and beta, which need only `rest`."""
        raise NotImplementedError

    # q and k's L2 norm (Kimi's rounds as fla's sqrt-and-divide does); qk_norm_divides says
    # which of the two the C++ decode kernel takes
    qk_norm = staticmethod(l2_normed)
    qk_norm_divides = False

    def mix(self, y: torch.Tensor, rest: Rest) -> tuple[torch.Tensor, ...]:
        q, k, v, g, beta = self.heads(y, rest)
        q, k = self.qk_norm(q), self.qk_norm(k)
        r = v.shape[1] // q.shape[1]
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        return q, k, v.float(), g, beta

    def output(self, o: torch.Tensor, rest: Rest) -> torch.Tensor:
        raise NotImplementedError

    def decode_gates(self, rest: Rest) -> linear_decode_fused.DecodeGates | None:
        """What the fused decode kernel needs of `rest` and the layer's parameters (None:
        the layer has no fused decode)."""
        return None

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """The out-projection of the gated, normed output [T, heads * value_dim]."""
        raise NotImplementedError

    @property
    def conv_weight(self) -> torch.Tensor:
        """[conv_dim, conv_kernel]"""
        raise NotImplementedError

    conv_bias: torch.Tensor | None = None

    # ---- a step ---------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        if isinstance(md, GroupedMetadata):
            md = md.of(self.kv_group)
        if not isinstance(md, StateMetadata):
            raise TypeError(f"a linear-attention layer needs StateMetadata, got {type(md).__name__}")
        if self.pages is None:
            raise RuntimeError("the KV cache is not bound to the linear-attention layer")
        x, rest = self.conv_input(hidden)
        if md.rows is not None:  # a verify graph's rows
            return self.output(self._rows(x, rest, md.rows), rest)
        if md.fold is not None:
            self._fold_into_pages(md.fold, (x, rest))
        if md.num_decodes == x.shape[0] and not md.chunks:
            out = self._fused_decodes(x, rest, md)
            if out is not None:
                return self.project(out)
        o = torch.empty(x.shape[0], self.state_heads, self.value_dim, dtype=torch.float32,
                        device=x.device)
        nd = md.num_decodes
        if nd:
            o[:nd] = self._decodes(x[:nd], tuple(r[:nd] for r in rest), md)
        for ch in md.chunks:
            rows = slice(ch.start, ch.start + ch.length)
            x_ch, rest_ch = x[rows], tuple(r[rows] for r in rest)
            o[rows] = (self._verify(x_ch, rest_ch, ch) if ch.verify
                       else self._chunk(x_ch, rest_ch, ch, md.block_size))
        return self.output(o, rest)

    def _fused_decodes(self, x: torch.Tensor, rest: Rest,
                       md: StateMetadata) -> torch.Tensor | None:
        """A step of decodes only, on CUDA: conv, gates, the delta rule and the gated output
        norm in the fused kernels (None: not here, or a shape they do not take)."""
        if not (x.shape[0] and triton_decode(x) and fused_decode_enabled()):
            return None
        gates = self.decode_gates(rest)
        assert self.pages is not None and md.decode_read is not None
        assert md.decode_write is not None
        pages = self._page_words()
        key_heads = self.conv_parts[0] // self.key_dim
        if gates is None or not linear_decode_fused.fits(
                x, gates, self.conv_weight, pages, key_heads, self.state_heads, self.key_dim,
                self.value_dim):
            return None
        return linear_decode_fused.decode_step(
            x, self.conv_weight, self.conv_bias, gates, pages, self.pages.conv_words,
            md.decode_read, md.decode_write, key_heads=key_heads, heads=self.state_heads,
            key_dim=self.key_dim, value_dim=self.value_dim, scale=self.scale,
            early_states=True)  # (EARLY_READS)

    def _decodes(self, x: torch.Tensor, rest: Rest, md: StateMetadata) -> torch.Tensor:
        assert self.pages is not None and md.decode_read is not None
        if triton_decode(x) and decode_kernels.kernel_fits(self.key_dim, self.value_dim):
            return self._decodes_in_place(x, rest, md)
        if cpu_linear_state.usable(x) and self.conv_weight.dtype == x.dtype:  # one C++ call
            g, beta = self.gates(rest)
            return cpu_linear_state.decode_step(
                x, self.conv_weight, self.conv_bias, g, beta, self.pages, md.decode_read,
                md.decode_write, self.scale, self.qk_norm_divides)
        conv, state = self.pages.read(md.decode_read)
        y, conv = causal_conv1d_step(x, self.conv_weight, self.conv_bias, conv.to(x.dtype))
        q, k, v, g, beta = self.mix(y, rest)
        o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state, scale=self.scale)
        self.pages.write(md.decode_write, conv, state)
        return o

    def _page_words(self) -> decode_kernels.PageWords:
        """Where the decode kernels find the states' float32 words."""
        assert self.pages is not None
        words = self.pages.words
        return decode_kernels.PageWords(words, words.shape[2], words.stride(0),
                                        words.stride(1))

    def _decodes_in_place(self, x: torch.Tensor, rest: Rest,
                          md: StateMetadata) -> torch.Tensor:
        pages = self._page_words()
        y = decode_kernels.conv_step(x, self.conv_weight, self.conv_bias, pages,
                                     md.decode_read, md.decode_write,
                                     early_states=True)  # (EARLY_READS)
        q, k, v, g, beta = self.heads(y, rest)
        return decode_kernels.delta_rule_step(q, k, v, g, beta, pages, self.pages.conv_words,
                                              md.decode_read, md.decode_write, self.scale)

    def _chunk(self, x: torch.Tensor, rest: Rest, ch: StateChunk,
               block_size: int) -> torch.Tensor:
        """A prefill chunk: nothing here waits on the device (the block ids are a device
        vector, ch.blocks) and its op count does not grow with the block ends inside it (one
        gather of their conv windows, one write of every state it leaves)."""
        assert self.pages is not None
        blocks = self._chunk_blocks(ch)
        conv, state = self.pages.read(blocks[:1])
        conv0 = conv[0].to(x.dtype)
        y, conv_end = causal_conv1d(x, self.conv_weight, self.conv_bias, conv0)
        # the [K-1 + L, C] inputs (conv state, then x), for conv windows that do not end at x's
        inputs = (torch.cat([conv0.t(), x], dim=0)
                  if ch.saves or ch.count is not None else None)
        real = None
        if ch.count is not None:  # a prefill graph's padded chunk
            real = torch.arange(x.shape[0], device=x.device) < ch.count
            # the conv window after the real tokens: the K-1 inputs ending at the last one
            ends = ch.count + torch.arange(self.conv_kernel - 1, device=x.device)
            assert inputs is not None
            conv_end = inputs.index_select(0, ends).t()
        if fla_chunk.usable(x):
            o, state, saved = self._fla_chunk(y, rest, state[0], ch, block_size, real)
        else:
            q, k, v, g, beta = padding_masked(self.mix(y, rest), real)
            o, state, saved = chunk_gated_delta_rule(
                q, k, v, g, beta, state[0], scale=self.scale, offset=ch.offset,
                save_every=block_size if ch.saves else 0)
        if ch.saves:  # the prefix cache's snapshots at the block ends inside the chunk
            # each block end's conv window: the K-1 inputs ending there, as one strided view
            first = block_size - ch.offset % block_size  # tokens of x up to the first end
            assert inputs is not None
            width = self.conv_kernel - 1
            windows = inputs[first:].unfold(0, width, block_size)[:len(ch.saves)]
            convs = torch.cat([windows, conv_end[None].to(windows.dtype)])
            states = torch.stack([*saved[:len(ch.saves)], state])
            self.pages.write(blocks[1:], convs, states)
        else:
            self.pages.write(blocks[1:], conv_end[None], state[None])
        return o

    def _chunk_blocks(self, ch: StateChunk) -> torch.Tensor:
        """read, saves..., write on the device (the metadata's copy when it made one)."""
        if ch.blocks is not None:
            return ch.blocks
        assert self.pages is not None
        return to_device([ch.read, *ch.saves, ch.write], torch.long, self.pages.words.device)

    def _fla_chunk(self, y: torch.Tensor, rest: Rest, state: torch.Tensor, ch: StateChunk,
                   block_size: int, real: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The chunk through fla-core's kernels, a call per piece between block ends when
        their states are kept (real: padding_masked's)."""
        q, k, v, g, beta = padding_masked(self.heads(y, rest), real)
        pieces = (fla_chunk.block_end_segments(y.shape[0], ch.offset, block_size)
                  if ch.saves else [(0, y.shape[0])])
        outs, saved = [], []
        for a, b in pieces:
            o, state = fla_chunk.chunk_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state,
                                            self.scale)
            outs.append(o)
            saved.append(state)
        return torch.cat(outs) if len(outs) > 1 else outs[0], state, saved

    # ---- speculative decoding (ReplaySSM, see shoal/attention/linear_state.py) -------------
    def _run(self, x: torch.Tensor, rest: Rest, conv: torch.Tensor, state: torch.Tensor,
             counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """R rows of T tokens (x [R, T, C], rest [R, T, ...]) from their conv states
        [R, C, K-1] and states [R, H, Dk, Dv], the first counts[r] tokens of row r real (None:
        all). Returns (o [R, T, H, Dv] float32, the conv states and states after them)."""
        R, T = x.shape[:2]
        y, conv_end = causal_conv1d_rows(x, self.conv_weight, self.conv_bias, conv, counts)
        heads = self.mix(y.flatten(0, 1), tuple(r.flatten(0, 1) for r in rest))
        o, state = gated_delta_rule_rows(*(t.unflatten(0, (R, T)) for t in heads), state,
                                         counts, scale=self.scale)
        return o, conv_end, state

    def _fold(self, conv: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
              counts: torch.Tensor, like: tuple[torch.Tensor, Rest]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of R rows after the first counts[r] inputs kept in slots[r] (like: a
        step's x and rest, whose per-token shapes the kept values take)."""
        kept = self._kept()
        x, rest = kept.unpack(kept.gather(slots), like)
        _, conv, state = self._run(x, rest, conv, state, counts)
        return conv, state

    def _fold_into_pages(self, fold: StateFold, like: tuple[torch.Tensor, Rest]) -> None:
        """An eager step's replays: each accepted run folded into the state of its block.
        Written through torch ops (EARLY_READS below)."""
        assert self.pages is not None
        conv, state = self.pages.read(fold.block)
        conv, state = self._fold(conv, state, fold.slot, fold.count, like)
        self.pages.write(fold.block, conv, state)

    def _verify(self, x: torch.Tensor, rest: Rest, ch: StateChunk) -> torch.Tensor:
        """Outputs of an eager verify step's tokens; the state read is copied into every
        block they reach and their inputs kept for the replay of the accepted run."""
        assert self.pages is not None
        blocks = self._chunk_blocks(ch)  # read, the blocks reached, (no write: -1)
        conv, state = self.pages.read(blocks[:1])
        o, _, _ = self._run(x[None], tuple(r[None] for r in rest), conv, state, None)
        if ch.saves:
            reach = len(ch.saves)
            self.pages.write(blocks[1:1 + reach], conv.expand(reach, *conv.shape[1:]),
                             state.expand(reach, *state.shape[1:]))
        kept = self._kept()
        kept.keep_one(ch.slot, kept.pack(x, rest))
        return o[0]

    def _rows(self, x: torch.Tensor, rest: Rest, rows: StateRows) -> torch.Tensor:
        """A verify graph's R rows of q tokens (see StateRows): fixed shapes, every block,
        count and slot a device value."""
        assert self.pages is not None
        R, q = rows.read.shape[0], rows.q
        xs, rs = x.unflatten(0, (R, q)), tuple(r.unflatten(0, (R, q)) for r in rest)
        conv, state = self.pages.read(rows.read)
        conv, state = self._fold(conv, state, rows.fold_slot, rows.fold_count, (x, rest))
        o, conv_end, state_end = self._run(xs, rs, conv, state, rows.count)
        self.pages.write(rows.write, conv_end, state_end)
        for blocks in rows.reach:  # (verify rows; the trash block for the others)
            self.pages.write(blocks, conv, state)
        kept = self._kept()
        kept.keep(rows.keep, kept.pack(xs, rs))
        return o.flatten(0, 1)

    def _kept(self) -> KeptInputs:
        if self.kept is None:
            raise RuntimeError("speculative decoding on a linear-attention layer whose kept "
                               "inputs were never sized (keep_replays) or whose cache is unbound")
        return self.kept
