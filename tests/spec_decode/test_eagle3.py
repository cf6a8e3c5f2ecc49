"""Method eagle3 on a tiny random 8-layer Llama target with a tiny EAGLE-3 head (draft
vocabulary of 128 of the target's 512 ids, mapped by d2t): greedy output is the plain
engine's, and every draft the engine proposes is what an independent plain-torch evaluation
of the EAGLE-3 formula predicts from the target's aux hidden states (transformers'
output_hidden_states at layers 2, L // 2, L - 3: the residual stream entering each).

The head's folder is laid out as the published EAGLE-3 heads (yuhuili/EAGLE3-LLaMA3.1-
Instruct-8B): config.json with architectures LlamaForCausalLMEagle3 and draft_vocab_size,
tensors fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t and t2d in safetensors."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from oracle import TINY_COMMON, write_tiny_checkpoint
from safetensors.torch import save_file
from spec_decode.proposal_log import record_proposals
from spec_decode.test_spec_engine import SpecCounter
from transformers import AutoModelForCausalLM

from shoal import SamplingParams

K = 3
H, V, FF = TINY_COMMON["hidden_size"], TINY_COMMON["vocab_size"], TINY_COMMON["intermediate_size"]
HEADS, KV = TINY_COMMON["num_attention_heads"], TINY_COMMON["num_key_value_heads"]
D, DV, LAYERS, EPS = H // HEADS, 128, 8, TINY_COMMON["rms_norm_eps"]
AUX = (2, LAYERS // 2, LAYERS - 3)


def head_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_act": "silu", "hidden_size": H, "intermediate_size": FF,
           "max_position_embeddings": 128, "num_attention_heads": HEADS,
           "num_hidden_layers": 1, "num_key_value_heads": KV, "rms_norm_eps": EPS,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": V,
           "draft_vocab_size": DV, "torch_dtype": "float16"}
    cfg.update(overrides)
    return cfg


def head_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return s * torch.randn(*shape, generator=gen)

    def norm():
        return 0.5 + torch.rand(H, generator=gen)
    p = "midlayer."
    chosen = torch.randperm(V, generator=gen)[:DV].sort().values  # the draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return {"fc.weight": r(H, 3 * H, s=0.1),
            p + "self_attn.q_proj.weight": r(HEADS * D, 2 * H),
            p + "self_attn.k_proj.weight": r(KV * D, 2 * H),
            p + "self_attn.v_proj.weight": r(KV * D, 2 * H),
            p + "self_attn.o_proj.weight": r(H, HEADS * D),
            p + "mlp.gate_proj.weight": r(FF, H), p + "mlp.up_proj.weight": r(FF, H),
            p + "mlp.down_proj.weight": r(H, FF),
            p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(), "norm.weight": norm(),
            "lm_head.weight": r(DV, H), "d2t": chosen - torch.arange(DV), "t2d": t2d}


def write_head(folder, weights: dict[str, torch.Tensor], **cfg):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(head_config(**cfg)))
    save_file(weights, folder / "model.safetensors")
    return folder


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding of x [T, heads, D] at positions 0..T-1 (theta 10000)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Reference:
    """The target (transformers) and the EAGLE-3 formula in plain torch."""

    def __init__(self, target_dir, w: dict[str, torch.Tensor],
                 aux_layers: tuple[int, ...] = AUX):
        self.hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.w = w
        self.aux_layers = aux_layers

    @torch.no_grad()
    def aux(self, seq: list[int]) -> torch.Tensor:
        """cat of the residual stream entering the aux layers, every position: [T, 3H]."""
        hs = self.hf.model(torch.tensor([seq]), output_hidden_states=True,
                           use_cache=False).hidden_states
        return torch.cat([hs[i][0] for i in self.aux_layers], -1)

    @torch.no_grad()
    def head(self, next_ids: list[int], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions 0..T-1 (causal): (pre-norm output states, target ids argmax)."""
        w, p, t = self.w, "midlayer.", len(next_ids)
        e = _rms(self.hf.model.embed_tokens(torch.tensor(next_ids)), w[p + "input_layernorm.weight"])
        x = torch.cat([e, _rms(g, w[p + "hidden_norm.weight"])], -1)
        q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, HEADS, D))
        k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, KV, D))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, KV, D)
        k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
        s = s + torch.full((t, t), float("-inf")).triu(1)
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, HEADS * D)
        r = o @ w[p + "self_attn.o_proj.weight"].T + g
        m = _rms(r, w[p + "post_attention_layernorm.weight"])
        m = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (
            m @ w[p + "mlp.up_proj.weight"].T)
        y = m @ w[p + "mlp.down_proj.weight"].T + r
        draft = (_rms(y, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
        return y, draft + w["d2t"][draft]

    def drafts(self, seq: list[int], k: int) -> list[int]:
        """Greedy EAGLE-3 drafts after `seq`, recomputed from scratch."""
        ids, g = list(seq[1:]), self.aux(seq)[:-1] @ self.w["fc.weight"].T
        out = []
        for _ in range(k):
            y, tok = self.head(ids, g)
            out.append(int(tok[-1]))
            ids.append(out[-1])
            g = torch.cat([g, y[-1:]])
        return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = write_tiny_checkpoint(root / "target", "llama", seed=3, num_hidden_layers=LAYERS)
    w = head_weights(seed=5)
    return target, write_head(root / "head", w), Reference(target, w)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _spec(folder, k=K) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eagle3_is_lossless_and_drafts_the_formula(ckpt, async_scheduling) -> None:
    target, folder, ref = ckpt
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(max_num_batched_tokens=24)  # chunked prefills: chunks that sample nothing
    plain = tiny_llm(target, **kw)
    llm = tiny_llm(target, speculative_config=_spec(folder), async_scheduling=async_scheduling,
                   **kw)
    runner = llm.llm_engine.core.runner
    assert runner.model.model.aux_layers == AUX
    assert runner.drafter.model.embed_tokens.weight is runner.model.model.embed_tokens.weight
    counter = SpecCounter(llm)
    log = record_proposals(llm)
    prompts = random_prompts(3, seed=8, lo=2, hi=40)
    want = _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert _ids(llm.generate(prompts[:1], sp, use_tqdm=False)) == want[:1]
    assert blocks_all_free(llm)
    assert counter.drafts > 0 and counter.draft_tokens >= counter.drafts
    assert len(log) > 10
    for seq, drafts in log:  # after prefills, decodes and verify steps alike
        assert drafts == ref.drafts(seq, len(drafts)), seq
        assert all(d in ref.w["t2d"].nonzero() for d in drafts)  # the draft vocabulary's


def test_eagle3_with_dummy_weights_is_lossless(ckpt) -> None:
    target, folder, _ = ckpt
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(2, seed=4, lo=2, hi=20)
    plain = tiny_llm(target, load_format="dummy")
    llm = tiny_llm(target, load_format="dummy", speculative_config=_spec(folder))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))


def test_eagle3_errors(ckpt, tiny_llama_dir, tmp_path) -> None:
    target, _, _ = ckpt
    w = head_weights(seed=1)
    no_d2t = write_head(tmp_path / "no-d2t", {n: t for n, t in w.items() if n != "d2t"})
    with pytest.raises(ValueError, match="no d2t tensor"):
        tiny_llm(target, speculative_config=_spec(no_d2t))
    narrow = write_head(tmp_path / "narrow", w, hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size=32, the target 64"):
        tiny_llm(target, speculative_config=_spec(narrow))
    wrong_fc = write_head(tmp_path / "wrong-fc", {**w, "fc.weight": torch.zeros(H, 2 * H)})
    with pytest.raises(ValueError, match=r"fc.weight has shape \[64, 128\]"):
        tiny_llm(target, speculative_config=_spec(wrong_fc))
    big = write_head(tmp_path / "big-draft-vocab", w, draft_vocab_size=1000)
    with pytest.raises(ValueError, match="draft_vocab_size=1000"):
        tiny_llm(target, speculative_config=_spec(big))
    # the 2-layer tiny target has no layers 2, 1, -1 to read
    with pytest.raises(ValueError, match="do not fit a target of 2 layers"):
        tiny_llm(tiny_llama_dir, speculative_config=_spec(tmp_path / "no-d2t"))
    with pytest.raises(ValueError, match="method 'eagle3' needs 'model'"):
        tiny_llm(target, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


def test_eagle3_over_a_moe_target_is_lossless(tmp_path) -> None:
    """A Qwen3-MoE target records its aux hidden states as a dense one (its stack is built by
    build_stages like Llama's: it once lacked the attributes the recording reads)."""
    moe = dict(num_hidden_layers=LAYERS, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, head_dim=D, architectures=["Qwen3MoeForCausalLM"])
    target = write_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=2, **moe)
    folder = write_head(tmp_path / "head", head_weights(seed=6))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(2, seed=5, lo=2, hi=20)
    llm = tiny_llm(target, speculative_config=_spec(folder))
    assert llm.llm_engine.core.runner.model.model.aux_layers == AUX
    got = _ids(llm.generate(prompts, sp, use_tqdm=False))
    assert got == _ids(tiny_llm(target).generate(prompts, sp, use_tqdm=False))
