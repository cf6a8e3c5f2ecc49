"""The gated delta rule over R rows of T tokens (shoal/layers/ops/delta_rule_rows.py) in one
Triton kernel: what a speculative verify, a replay fold and a verify graph's rows run on CUDA
instead of T rounds of small torch ops.

A program owns one (row, value head, block of Dv columns): it holds the state's [Dk, BV]
slice in registers in float32 and walks the row's T tokens (T <= ~9, unrolled). Per token,
as recurrent_gated_delta_rule: S = diag(exp(g)) S; S += k (beta (v - k^T S))^T;
o = scale q^T S. The Dv columns of a head are independent in this recurrence, so the blocks
need nothing from each other. Token t of row r is real when t < counts[r], read on the
device (no host sync, fixed shapes: CUDA-graph safe); a padding token's k, v, g and beta are
masked to 0, an exact identity step whatever the padding holds (NaN included). Its output,
scale q^T S of the unchanged state, is unspecified for callers, as on the torch path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program's state tile is [next_pow2(Dk), BLOCK_V] float32: 128 x 32 is 32 registers a thread
# over 4 warps, and Dv = 128 then gives 4 programs a head (R * H * 4 programs for the GPU).
_BLOCK_V = 32
_NUM_WARPS = 4


@triton.jit
def _rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, counts_ptr, o_ptr, out_ptr,
                 sq_r, sq_t, sq_h, sq_d, sk_r, sk_t, sk_h, sk_d, sv_r, sv_t, sv_h, sv_d,
                 sg_r, sg_t, sg_h, sg_d, sb_r, sb_t, sb_h, ss_r, ss_h, ss_k, ss_v,
                 so_r, so_t, so_h, so_d, se_r, se_h, se_k, se_v, DK, DV, scale,
                 T: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 G_PER_CHANNEL: tl.constexpr, HAS_COUNTS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dk = tl.arange(0, BK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = dk < DK, dv < DV
    tile = mk[:, None] & mv[None, :]
    s = tl.load(state_ptr + r * ss_r + h * ss_h + dk[:, None] * ss_k + dv[None, :] * ss_v,
                mask=tile, other=0.0).to(tl.float32)
    if HAS_COUNTS:
        count = tl.load(counts_ptr + r)
    else:
        count = T
    for t in tl.static_range(T):
        real = t < count
        q = tl.load(q_ptr + r * sq_r + t * sq_t + h * sq_h + dk * sq_d, mask=mk,
                    other=0.0).to(tl.float32)
        # A padding token's values are read (in bounds: every row has T tokens) and replaced
        # by 0 with a select, which also drops NaN. (A mask `mk & real` would skip the reads,
        # but the interpreter rejects a vector mask and-ed with a scalar one.)
        k = tl.where(real, tl.load(k_ptr + r * sk_r + t * sk_t + h * sk_h + dk * sk_d,
                                   mask=mk, other=0.0).to(tl.float32), 0.0)
        v = tl.where(real, tl.load(v_ptr + r * sv_r + t * sv_t + h * sv_h + dv * sv_d,
                                   mask=mv, other=0.0).to(tl.float32), 0.0)
        beta = tl.where(real, tl.load(beta_ptr + r * sb_r + t * sb_t + h * sb_h), 0.0)
        beta = beta.to(tl.float32)
        if G_PER_CHANNEL:  # KDA: a log-decay per key channel, over the state's rows
            g = tl.where(real, tl.load(g_ptr + r * sg_r + t * sg_t + h * sg_h + dk * sg_d,
                                       mask=mk, other=0.0).to(tl.float32), 0.0)
            s = s * tl.exp(g)[:, None]
        else:  # Gated DeltaNet: one log-decay per head
            g = tl.where(real, tl.load(g_ptr + r * sg_r + t * sg_t + h * sg_h), 0.0)
            s = s * tl.exp(g.to(tl.float32))
        delta = beta * (v - tl.sum(s * k[:, None], 0))  # [BV]: v minus what S predicts for k
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0) * scale
        tl.store(o_ptr + r * so_r + t * so_t + h * so_h + dv * so_d, o, mask=mv)
    tl.store(out_ptr + r * se_r + h * se_h + dk[:, None] * se_k + dv[None, :] * se_v, s,
             mask=tile)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, state: torch.Tensor, counts: torch.Tensor | None) -> None:
    R, T, H, Dk = q.shape
    Dv = v.shape[-1]
    want = {"k": (k, (R, T, H, Dk)), "v": (v, (R, T, H, Dv)), "beta": (beta, (R, T, H)),
            "state": (state, (R, H, Dk, Dv))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"gated_delta_rule_rows: {name} has shape {tuple(x.shape)}, "
                             f"expected {shape} from q {tuple(q.shape)} and v {tuple(v.shape)}")
    if tuple(g.shape) not in ((R, T, H), (R, T, H, Dk)):
        raise ValueError(f"gated_delta_rule_rows: g has shape {tuple(g.shape)}, expected "
                         f"{(R, T, H)} (per head) or {(R, T, H, Dk)} (per key channel)")
    if counts is not None and tuple(counts.shape) != (R,):
        raise ValueError(f"gated_delta_rule_rows: counts has shape {tuple(counts.shape)}, "
                         f"expected ({R},)")


def launch_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, counts: torch.Tensor | None, *,
                scale: float, block_v: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta_rule_rows_triton with its tile width and warps chosen (for timing them)."""
    _check(q, k, v, g, beta, state, counts)
    R, T, H, Dk = q.shape
    Dv = v.shape[-1]
    o = torch.empty(R, T, H, Dv, dtype=torch.float32, device=q.device)
    out = torch.empty(R, H, Dk, Dv, dtype=torch.float32, device=q.device)
    if R == 0 or T == 0:
        return o, out.copy_(state)
    per_channel = g.dim() == 4
    sg = g.stride() if per_channel else (*g.stride(), 0)
    bv = min(block_v, triton.next_power_of_2(Dv))
    _rows_kernel[(R, H, triton.cdiv(Dv, bv))](
        q, k, v, g, beta, state, counts if counts is not None else q, o, out,
        *q.stride(), *k.stride(), *v.stride(), *sg, *beta.stride(), *state.stride(),
        *o.stride(), *out.stride(), Dk, Dv, scale,
        T=T, BK=triton.next_power_of_2(Dk), BV=bv, G_PER_CHANNEL=per_channel,
        HAS_COUNTS=counts is not None, num_warps=num_warps)
    return o, out


def gated_delta_rule_rows_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                 counts: torch.Tensor | None, *, scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta_rule_rows in one kernel: q, k [R, T, H, Dk] (normed, repeated to v's heads);
    v [R, T, H, Dv]; g [R, T, H] or [R, T, H, Dk]; beta [R, T, H]; state [R, H, Dk, Dv];
    counts [R] (None: all T real), any strides and float dtypes. Returns (o [R, T, H, Dv]
    float32, padding tokens' outputs unspecified; each row's state after its real tokens,
    float32, a new tensor)."""
    return launch_rows(q, k, v, g, beta, state, counts, scale=scale, block_v=_BLOCK_V,
                       num_warps=_NUM_WARPS)
