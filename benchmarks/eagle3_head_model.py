"""A trainable EAGLE-3 head in plain torch (fp32 parameters), the formula of
shoal/spec_decode/eagle3.py's docstring, with training-time-test unrolling, and its
checkpoint folder in the layout shoal loads (config.json LlamaForCausalLMEagle3 +
model.safetensors: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d).

Unrolling (as EAGLE-3 trains): for each position q of a sequence (tokens t, aux states a,
target greedy tokens g, g[p] being the target's argmax after t[:p + 1]),

    step 1: row at position q, state fc(a[q]), token t[q + 1]; attends to the step-1 rows
            0..q (causal); predicts g[q + 1]
    step j: row at position q + j - 1, state y (step j - 1's output of branch q), token
            t[q + j]; attends to the step-1 rows 0..q and to branch q's rows of steps 2..j;
            predicts g[q + j]

which is what the engine computes at serve time: the mirror's rows (target states) up to
the last verified position, then the draft steps' rows of the request, each feeding its
output state back (shoal/spec_decode/mtp.py). t[q + j] is the token the draft must have
matched for step j to be verified at all, so teacher forcing it is the acceptance condition.
The embedding is the target's, frozen and not saved (the engine shares the target's)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from shoal.layers.rotary import RotaryEmbedding, rope_parameters

IGNORE = -100


@dataclass(frozen=True)
class HeadShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    eps: float
    num_aux: int = 3

    @classmethod
    def of_target(cls, cfg: Any, draft_vocab: int) -> HeadShape:
        """The head of a Llama-family target config (the target's layer shape)."""
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                raise ValueError(f"{flag}: biased projections are not supported by the "
                                 "trainable head")
        heads = cfg.num_attention_heads
        return cls(cfg.hidden_size, heads, getattr(cfg, "num_key_value_heads", None) or heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   cfg.intermediate_size, cfg.vocab_size, draft_vocab, float(cfg.rms_norm_eps))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)


@dataclass
class _Keys:
    """Keys and values of the rows so far, [B, Hk, n, D]: the causal step-1 rows, and
    branch-diagonal ones of each later step."""

    k1: torch.Tensor
    v1: torch.Tensor
    diag: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class TrainableEagle3Head(nn.Module):
    """Parameters named as the checkpoint's tensors (checkpoint_tensors(): state_dict()
    with fc_in_scale folded into fc.weight)."""

    def __init__(self, shape: HeadShape, target_cfg: Any, embed: torch.Tensor,
                 draft_ids: torch.Tensor):
        """embed: the target's embedding [V, H] (kept frozen); draft_ids: the draft
        vocabulary, sorted target ids [draft_vocab]."""
        super().__init__()
        s = self.shape = shape
        if draft_ids.shape != (s.draft_vocab,):
            raise ValueError(f"draft_ids: shape {list(draft_ids.shape)}, expected "
                             f"[{s.draft_vocab}]")
        self.fc = nn.Linear(s.num_aux * s.hidden, s.hidden, bias=False)
        self.midlayer = _MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, s.draft_vocab, bias=False)
        self.register_buffer("d2t", draft_ids - torch.arange(s.draft_vocab))
        t2d = torch.zeros(s.vocab, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)
        # target id -> draft id (IGNORE outside the draft vocabulary): the labels' map
        to_draft = torch.full((s.vocab,), IGNORE, dtype=torch.long)
        to_draft[draft_ids] = torch.arange(s.draft_vocab)
        self.register_buffer("to_draft", to_draft, persistent=False)
        # fc reads aux / fc_in_scale (see set_input_scale); the checkpoint folds it into fc
        self.register_buffer("fc_in_scale", torch.ones(s.num_aux * s.hidden), persistent=False)
        # a plain attribute, neither trained, saved nor moved: the target's, on its device
        self.embed = embed.detach()
        theta, scaling = rope_parameters(target_cfg)
        self.rope = RotaryEmbedding(s.head_dim, target_cfg.max_position_embeddings, theta,
                                    scaling, use_triton_ops=False)

    def init_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """lm_head: the target's rows of the draft vocabulary, norm: its final norm's weight
        (a head whose output state resembles the target's last residual then reads out right
        from the start)."""
        draft_ids = self.d2t + torch.arange(self.shape.draft_vocab, device=self.d2t.device)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head[draft_ids.to(lm_head.device)].float())
            self.norm.weight.copy_(final_norm.float())

    @torch.no_grad()
    def set_input_scale(self, aux: list[torch.Tensor]) -> None:
        """Trains fc on aux features of unit RMS (a reparametrisation, not a new formula:
        checkpoint_tensors() saves fc.weight / scale). The residual stream has a few
        features thousands of times the others' size (SmolLM2: RMS 0.9 to 1900), which
        with AdamW's per-weight steps swamp fc's early training."""
        total = torch.zeros_like(self.fc_in_scale)
        for a in aux:
            total += a.to(total.device, torch.float32).pow(2).sum(0)
        self.fc_in_scale.copy_((total / sum(len(a) for a in aux)).sqrt().clamp_min(1e-3))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (fp32, on the CPU), fc_in_scale folded into fc.weight."""
        out = {k: v.detach().float().contiguous().cpu() if v.is_floating_point()
               else v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        out["fc.weight"] = (self.fc.weight.detach() / self.fc_in_scale).float().cpu()
        return out

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary."""
        return self.lm_head(self.norm(y))

    def _row(self, h: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
             keys: _Keys | None) -> tuple[torch.Tensor, _Keys]:
        """One step over every branch: h [B, n, H] the input states, ids [B, n] the tokens,
        positions [n]; keys None for step 1. Returns the output states and the keys."""
        s, layer = self.shape, self.midlayer
        b, n, _ = h.shape
        e = layer.input_layernorm(F.embedding(ids, self.embed).to(h.dtype))
        x = torch.cat([e, layer.hidden_norm(h)], dim=-1)
        att = layer.self_attn
        q = att.q_proj(x).view(b * n, s.heads, s.head_dim)
        k = att.k_proj(x).view(b * n, s.kv_heads, s.head_dim)
        v = att.v_proj(x).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = self.rope.forward_native(positions.repeat(b), q, k)
        q = q.view(b, n, s.heads, s.head_dim).transpose(1, 2)  # [B, Hq, n, D]
        k = k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        if keys is None:
            keys = _Keys(k, v)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys.diag.append((k, v))
            o = self._branch_attention(q, keys)
        o = att.o_proj(o.transpose(1, 2).reshape(b, n, s.heads * s.head_dim))
        r = o + h
        return layer.mlp(layer.post_attention_layernorm(r)) + r, keys

    def _branch_attention(self, q: torch.Tensor, keys: _Keys) -> torch.Tensor:
        """Query q of branch i attends to step-1 keys 0..i and to branch i's key of each
        later step (keys.diag, this step's last)."""
        s = self.shape
        rep = s.heads // s.kv_heads
        n = q.shape[2]
        scale = s.head_dim ** -0.5
        k1 = keys.k1.repeat_interleave(rep, dim=1)
        v1 = keys.v1.repeat_interleave(rep, dim=1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = [(q @ k1.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        for k, _ in keys.diag:
            scores.append((q * k.repeat_interleave(rep, dim=1)).sum(-1, keepdim=True) * scale)
        p = torch.cat(scores, dim=-1).softmax(-1)
        out = p[..., :n] @ v1
        for i, (_, v) in enumerate(keys.diag):
            out = out + p[..., n + i:n + i + 1] * v.repeat_interleave(rep, dim=1)
        return out

    def unroll(self, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """aux [B, L, 3H], ids [B, L] (sequences padded at the end): each step's output
        states [B, L - 1, H] for branches q = 0..L-2 (see the module docstring)."""
        b, length, _ = aux.shape
        n = length - 1
        positions = torch.arange(n, device=aux.device)
        h = self.fc(aux[:, :n].to(self.fc.weight.dtype) / self.fc_in_scale)
        keys = None
        outs = []
        for j in range(1, steps + 1):
            tok = torch.zeros(b, n, dtype=torch.long, device=aux.device)
            tok[:, :length - j] = ids[:, j:]  # t[q + j], 0 past the end (masked)
            h, keys = self._row(h, tok, positions + j - 1, keys)
            outs.append(h)
        return outs

    def labels(self, greedy: torch.Tensor, lengths: torch.Tensor, steps: int
               ) -> list[torch.Tensor]:
        """Each step's draft-vocabulary labels [B, L - 1]: g[q + j] mapped, IGNORE where
        q + j is past the sequence or g outside the draft vocabulary."""
        b, length = greedy.shape
        n = length - 1
        q = torch.arange(n, device=greedy.device)
        out = []
        for j in range(1, steps + 1):
            lab = torch.full((b, n), IGNORE, dtype=torch.long, device=greedy.device)
            lab[:, :length - j] = self.to_draft[greedy[:, j:]]
            lab[q[None, :] + j >= lengths[:, None]] = IGNORE
            out.append(lab)
        return out


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 8  # sequences per step
    ttt_steps: int = 3  # unrolled draft steps per sequence position
    lr: float = 1e-3
    warmup: int = 20
    step_decay: float = 0.8  # loss weight of step j: step_decay ** (j - 1)
    max_seconds: float | None = None  # stop early past this (the steps done are reported)
    seed: int = 0
    log_every: int = 25


@dataclass
class TrainLog:
    steps_done: int = 0
    seconds: float = 0.0
    loss: list[float] = field(default_factory=list)  # per step
    accuracy: list[list[float]] = field(default_factory=list)  # per logged step, per TTT step


def batch_of(data: Any, idx: list[int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded aux [B, L, 3H], ids, greedy [B, L] and lengths [B] of sequences idx of a
    HeadData (eagle3_head_data.py)."""
    lengths = torch.tensor([len(data.ids[i]) for i in idx], device=device)
    length = int(lengths.max())
    width = data.aux[idx[0]].shape[-1]
    aux = torch.zeros(len(idx), length, width, device=device)
    ids = torch.zeros(len(idx), length, dtype=torch.long, device=device)
    greedy = torch.zeros_like(ids)
    for row, i in enumerate(idx):
        n = len(data.ids[i])
        aux[row, :n] = data.aux[i].to(device, torch.float32)
        ids[row, :n] = data.ids[i].to(device)
        greedy[row, :n] = data.greedy[i].to(device)
    return aux, ids, greedy, lengths


def train_head(head: TrainableEagle3Head, data: Any, cfg: TrainConfig,
               log: Any = print) -> TrainLog:
    """AdamW, linear warm-up then cosine decay, cross-entropy of every unrolled step's
    logits against the target's greedy tokens (weights step_decay ** (j - 1))."""
    if cfg.steps < 1 or cfg.ttt_steps < 1 or cfg.batch_size < 1:
        raise ValueError("steps, ttt_steps and batch_size must be >= 1")
    device = head.fc.weight.device
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(cfg.seed)
    out = TrainLog()
    weights = [cfg.step_decay ** j for j in range(cfg.ttt_steps)]
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    t0 = time.perf_counter()
    head.train()
    for step in range(cfg.steps):
        idx = torch.randint(len(data.ids), (cfg.batch_size,), generator=gen).tolist()
        aux, ids, greedy, lengths = batch_of(data, idx, device)
        with autocast:
            states = head.unroll(aux, ids, cfg.ttt_steps)
            logits = [head.logits(y).float() for y in states]
        labels = head.labels(greedy, lengths, cfg.ttt_steps)
        losses = [F.cross_entropy(lg.flatten(0, 1), lab.flatten(), ignore_index=IGNORE,
                                  reduction="sum") / (lab != IGNORE).sum().clamp_min(1)
                  for lg, lab in zip(logits, labels)]
        loss = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        out.loss.append(loss.item())
        out.steps_done = step + 1
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            acc = [float((lg.argmax(-1) == lab)[lab != IGNORE].float().mean())
                   for lg, lab in zip(logits, labels)]
            out.accuracy.append(acc)
            log(f"train step {step}: loss {out.loss[-1]:.3f}, accuracy by draft step "
                f"{[round(a, 3) for a in acc]}, {time.perf_counter() - t0:.0f} s")
        if cfg.max_seconds is not None and time.perf_counter() - t0 > cfg.max_seconds:
            log(f"train: stopping after {step + 1} steps ({cfg.max_seconds} s budget)")
            break
    head.eval()
    out.seconds = time.perf_counter() - t0
    return out


def head_config(target_cfg: Any, shape: HeadShape, aux_layer_ids: tuple[int, ...]
                ) -> dict[str, Any]:
    """config.json: the target's (its layer shape, rotary), one layer, the draft vocabulary
    and the aux layers it was trained on."""
    cfg = {k: v for k, v in target_cfg.to_dict().items()
           if not k.startswith("_") and k not in ("eos_token_id", "bos_token_id",
                                                  "pad_token_id", "id2label", "label2id")}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
               num_hidden_layers=1, tie_word_embeddings=False,
               vocab_size=shape.vocab, draft_vocab_size=shape.draft_vocab,
               target_hidden_size=shape.hidden,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)})
    return cfg


def save_checkpoint(head: TrainableEagle3Head, folder: Path, target_cfg: Any,
                    aux_layer_ids: tuple[int, ...]) -> Path:
    """The EAGLE-3 checkpoint folder shoal's speculative_config {"method": "eagle3",
    "model": folder} loads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(head_config(target_cfg, head.shape, aux_layer_ids), indent=1, default=str))
    save_file(head.checkpoint_tensors(), folder / "model.safetensors")
    return folder
