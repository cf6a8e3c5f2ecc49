"""Method mtp on a tiny random DeepSeek-V3 checkpoint with one multi-token-prediction layer:
greedy output is the plain engine's, and every draft the engine proposes is what a plain
torch + transformers evaluation of the MTP formula predicts (random weights: few drafts are
accepted, so losslessness alone would not show that the layer computes the right thing)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from deepseek_tiny import V3, write_deepseek
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from safetensors.torch import load_file, save_file
from spec_decode.proposal_log import StepLog, record_proposals
from spec_decode.test_spec_engine import SpecCounter
from transformers import AutoModelForCausalLM

from shoal import SamplingParams

N = V3["num_hidden_layers"]  # the main layers; the MTP layer is model.layers.{N}
K = 3


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + V3["rms_norm_eps"]) * w


class Reference:
    """The target (transformers, N layers) and the MTP formula in plain torch, whose
    decoder layer is transformers' layer N of the same random model."""

    def __init__(self, hf, extra: dict[str, torch.Tensor]):
        self.hf, self.w = hf, {k.split(f"layers.{N}.", 1)[1]: v for k, v in extra.items()}
        hf.config.num_hidden_layers = N  # the main model runs its first N layers only
        self.layer = hf.model.layers[N]

    @torch.no_grad()
    def hidden(self, seq: list[int]) -> torch.Tensor:
        """The target's final (normed) hidden state of every position."""
        return self.hf.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, next_ids: list[int], prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions 0..T-1 (causal): (output states, logits)."""
        w, t = self.w, len(next_ids)
        emb = self.hf.model.embed_tokens(torch.tensor(next_ids)).clone()
        emb[0] = 0  # position 0's embedding is masked (as vLLM does)
        x = torch.cat([_rms(emb, w["enorm.weight"]), _rms(prev, w["hnorm.weight"])], -1)
        x = (x @ w["eh_proj.weight"].T)[None]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = self.layer(x, attention_mask=mask, position_ids=pos,
                       position_embeddings=self.hf.model.rotary_emb(x, pos))
        y = (y[0] if isinstance(y, tuple) else y)[0]
        return y, _rms(y, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T

    def drafts(self, seq: list[int], k: int) -> list[int]:
        """Greedy MTP drafts after `seq`, recomputed from scratch."""
        ids, prev = list(seq[1:]), self.hidden(seq)[:-1]
        out = []
        for _ in range(k):
            y, logits = self.mtp(ids, prev)
            d = int(logits[-1].argmax())
            out.append(d)
            ids.append(d)
            prev = torch.cat([prev, y[-1:]])
        return out


def _write(root, full, weights, extra):  # root: a new folder
    """The target folder: the main layers of `weights`, the MTP layer (its decoder layer is
    layer N of `weights`) with `extra`; config num_hidden_layers=N, one MTP layer."""
    target = root
    target.mkdir()
    save_file({**weights, **extra}, target / "model.safetensors")
    cfg = json.loads((full / "config.json").read_text())
    cfg.update(num_hidden_layers=N, num_nextn_predict_layers=1)
    (target / "config.json").write_text(json.dumps(cfg))
    return target


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("mtp"))


def build_checkpoints(root):
    """name -> (target folder with an MTP layer, Reference). "random": random weights, few
    drafts accepted. "bigram": the main layers add nothing to the residual (the next token
    is a function of the current one) and the MTP layer is that function of its input token
    plus a small attention / MoE term, so most drafts are accepted and the mirror of verify
    steps with accepted drafts is exercised too."""
    full, hf = write_deepseek(root / "full", "deepseek_v3", seed=3,
                              **dict(V3, num_hidden_layers=N + 1))
    h, v = V3["hidden_size"], V3["vocab_size"]
    gen = torch.Generator().manual_seed(11)
    p = f"model.layers.{N}."
    # No embed_tokens copy (the target's is shared), a head of its own.
    extra = {p + "enorm.weight": 0.5 + torch.rand(h, generator=gen),
             p + "hnorm.weight": 0.5 + torch.rand(h, generator=gen),
             p + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=gen),
             p + "shared_head.norm.weight": 0.5 + torch.rand(h, generator=gen),
             p + "shared_head.head.weight": 0.2 * torch.randn(v, h, generator=gen)}
    weights = load_file(full / "model.safetensors")
    out = {"random": (_write(root / "random", full, weights, extra), Reference(hf, extra))}

    bigram = dict(weights)
    for name, t in weights.items():
        m = re.match(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\..*down_proj)\.weight$",
                     name)
        if m:
            bigram[name] = t * (0.0 if int(m[1]) < N else 0.15)
    extra_b = dict(extra)
    extra_b[p + "enorm.weight"] = torch.ones(h)
    extra_b[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    extra_b[p + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    extra_b[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    folder = root / "bigram-full"
    folder.mkdir()
    save_file(bigram, folder / "model.safetensors")
    shutil.copy(full / "config.json", folder / "config.json")
    hf_b = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out["bigram"] = (_write(root / "bigram", full, bigram, extra_b), Reference(hf_b, extra_b))
    return out


@pytest.fixture(scope="module")
def ckpt(ckpts):
    return ckpts["random"]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name,async_scheduling", [("random", False), ("bigram", False),
                                                    ("random", True), ("bigram", True)])
def test_mtp_is_lossless_and_drafts_the_mtp_prediction(ckpts, name, async_scheduling) -> None:
    target, ref = ckpts[name]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # Chunked prefills (24 tokens a step) and blocks of 4: the mirror covers chunks that
    # sample nothing, decodes, and verify steps with rejections.
    kw = dict(max_num_batched_tokens=24)
    plain = tiny_llm(target, **kw)
    kw["async_scheduling"] = async_scheduling  # drafting steps one at a time, others pipelined
    llm = tiny_llm(target, speculative_config={"method": "mtp", "num_speculative_tokens": K},
                   **kw)
    counter = SpecCounter(llm)
    log = record_proposals(llm)
    steps = StepLog(llm)
    prompts = random_prompts(4, seed=8, lo=2, hi=40)
    want = _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
    for p, w in zip(prompts[:2], want):  # alone
        assert _ids(llm.generate([p], sp, use_tqdm=False)) == [w]
    assert blocks_all_free(llm)
    assert not steps.verify_pipelined()
    if async_scheduling and name == "random":  # rejected drafts back off: mirror-only steps
        assert steps.pipelined > 0, steps.steps
    # Spec metrics count the drafts that were verified.
    assert counter.drafts > 0 and counter.draft_tokens >= counter.drafts
    assert 0 <= counter.accepted <= counter.draft_tokens <= K * counter.drafts
    # Every proposal (after prefills, decodes, and verify steps) is the MTP formula's.
    assert len(log) > 20
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_mtp_layer_matches_the_formula(ckpt) -> None:
    """One MTP pass over a fresh sequence: shoal's layer (its cache, MLA, MoE, rope
    permutation) against the plain evaluation, logits to 1e-4."""
    target, ref = ckpt
    llm = tiny_llm(target, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    mtp = llm.llm_engine.core.runner.drafter
    seq = random_prompts(1, seed=3, lo=13, hi=14)[0]["prompt_token_ids"]
    hidden = ref.hidden(seq)
    want_y, want_logits = ref.mtp(seq[1:], hidden[:-1])
    t = len(seq) - 1
    md = mtp._metadata([t], [0], [list(range(-(-t // 4)))], 0)
    with torch.inference_mode():
        y = mtp.model(torch.tensor(seq[1:]), torch.arange(t), hidden[:-1], md)
        logits = mtp.model.compute_logits(y)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_mtp_needs_mtp_layers(ckpt, tiny_llama_dir, tmp_path) -> None:
    target, _ = ckpt
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    none = tmp_path / "no-mtp-layers"
    shutil.copytree(target, none)
    cfg = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction"):
        tiny_llm(none, speculative_config=spec)
    with pytest.raises(ValueError, match="needs a model with multi-token-prediction"):
        tiny_llm(tiny_llama_dir, speculative_config=spec)
    # The config names a layer, the checkpoint has none.
    bare = tmp_path / "no-mtp-tensors"
    bare.mkdir()
    shutil.copy(target / "config.json", bare / "config.json")
    save_file({k: v for k, v in load_file(target / "model.safetensors").items()
               if not k.startswith(f"model.layers.{N}.")}, bare / "model.safetensors")
    with pytest.raises(ValueError, match="no multi-token-prediction tensors"):
        tiny_llm(bare, speculative_config=spec)
