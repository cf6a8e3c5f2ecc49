"""Method eagle on a tiny random Llama target with a tiny EAGLE-1 head: greedy output is the
plain engine's, and every draft the engine proposes is what a plain torch + transformers
evaluation of the EAGLE formula predicts (random weights: few drafts are accepted, so
losslessness alone would not show that the head computes the right thing).

The head's folder is laid out as SafeAILab's published EAGLE-1 checkpoints (e.g.
yuhuili/EAGLE-LLaMA3.1-Instruct-8B): a Llama config.json with one hidden layer and the
target's sizes, and un-prefixed tensors fc.weight, layers.0.{self_attn,mlp}.*,
layers.0.post_attention_layernorm.weight (no input_layernorm), a frozen embed_tokens copy,
in pytorch_model.bin."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from oracle import TINY_COMMON
from safetensors.torch import load_file, save_file
from spec_decode.proposal_log import StepLog, record_proposals
from spec_decode.test_spec_engine import SpecCounter
from transformers import AutoModelForCausalLM, LlamaConfig

from shoal import SamplingParams
from shoal.config.speculative import SpeculativeConfig

K = 3
H, V, FF = TINY_COMMON["hidden_size"], TINY_COMMON["vocab_size"], TINY_COMMON["intermediate_size"]
HEADS, KV = TINY_COMMON["num_attention_heads"], TINY_COMMON["num_key_value_heads"]
D = H // HEADS


def eagle_config(**overrides) -> dict:
    """config.json of an EAGLE-1 Llama head (the published EAGLE-LLaMA3 ones' keys)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": False,
           "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": H,
           "initializer_range": 0.02, "intermediate_size": FF,
           "max_position_embeddings": TINY_COMMON["max_position_embeddings"],
           "num_attention_heads": HEADS, "num_hidden_layers": 1, "num_key_value_heads": KV,
           "pretraining_tp": 1, "rms_norm_eps": TINY_COMMON["rms_norm_eps"],
           "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "float16", "use_cache": True, "vocab_size": V}
    cfg.update(overrides)
    return cfg


def eagle_weights(seed: int, attn_scale: float = 1.0, mlp_scale: float = 1.0
                  ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return s * torch.randn(*shape, generator=gen)
    p = "layers.0."
    return {"fc.weight": r(H, 2 * H),
            p + "self_attn.q_proj.weight": r(HEADS * D, H),
            p + "self_attn.k_proj.weight": r(KV * D, H),
            p + "self_attn.v_proj.weight": r(KV * D, H),
            p + "self_attn.o_proj.weight": r(H, HEADS * D, s=0.2 * attn_scale),
            p + "mlp.gate_proj.weight": r(FF, H),
            p + "mlp.up_proj.weight": r(FF, H),
            p + "mlp.down_proj.weight": r(H, FF, s=0.2 * mlp_scale),
            p + "post_attention_layernorm.weight": 0.5 + torch.rand(H, generator=gen)}


def write_eagle(folder, weights: dict[str, torch.Tensor], bin_format: bool = True, **cfg):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(eagle_config(**cfg)))
    if bin_format:
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, folder / "model.safetensors")
    return folder


class Reference:
    """The target (transformers) and the EAGLE-1 formula in plain torch, whose decoder layer
    is a transformers LlamaDecoderLayer (input_layernorm dropped) with the head's weights."""

    def __init__(self, target_dir, eagle_dir, w: dict[str, torch.Tensor]):
        # Imported here: importing it imports triton, which must come after
        # tests/worker/test_decode_graphs_cpu.py sets TRITON_INTERPRET (at collection).
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        self.hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        cfg = LlamaConfig.from_pretrained(eagle_dir)
        cfg._attn_implementation = "eager"
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
        state = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
        missing, unexpected = self.layer.load_state_dict(state, strict=False)
        assert missing == ["input_layernorm.weight"] and not unexpected, (missing, unexpected)
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.w = w

    @torch.no_grad()
    def hidden(self, seq: list[int]) -> torch.Tensor:
        """The target's final (normed) hidden state of every position."""
        return self.hf.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]

    @torch.no_grad()
    def eagle(self, next_ids: list[int], prev: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions 0..T-1 (causal): (output states, logits)."""
        w, t = self.w, len(next_ids)
        emb = self.hf.model.embed_tokens(torch.tensor(next_ids))
        x = torch.cat([emb, prev], -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        x = x[None]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = self.layer(x, attention_mask=mask, position_ids=pos,
                       position_embeddings=self.rotary(x, pos))
        y = (y[0] if isinstance(y, tuple) else y)[0]
        return y, y @ self.hf.lm_head.weight.T  # the target's head, no final norm

    def drafts(self, seq: list[int], k: int) -> list[int]:
        """Greedy EAGLE drafts after `seq`, recomputed from scratch."""
        ids, prev = list(seq[1:]), self.hidden(seq)[:-1]
        out = []
        for _ in range(k):
            y, logits = self.eagle(ids, prev)
            d = int(logits[-1].argmax())
            out.append(d)
            ids.append(d)
            prev = torch.cat([prev, y[-1:]])
        return out


@pytest.fixture(scope="module")
def ckpts(tiny_llama_dir, tmp_path_factory):
    return build_checkpoints(tiny_llama_dir, tmp_path_factory.mktemp("eagle"))


def build_checkpoints(tiny_llama_dir, root):
    """name -> (target folder, EAGLE folder, Reference). "random": random head weights in
    pytorch_model.bin with the target's embedding copied in (as published), few drafts
    accepted. "bigram": the target's layers add nothing to the residual (its next token is
    a function of the current one); the head's fc passes the (norm-weighted) embedding of
    its input token through, plus a small attention / MLP term and a bias, so its logits
    are mostly the target's next-token choice: most drafts are accepted and the mirror of
    verify steps with accepted drafts is exercised. Safetensors, no embedding copy."""
    target_w = load_file(tiny_llama_dir / "model.safetensors")
    w = eagle_weights(seed=5)
    folder = write_eagle(root / "random", {**w, "embed_tokens.weight":
                                           target_w["model.embed_tokens.weight"].clone()})
    out = {"random": (tiny_llama_dir, folder, Reference(tiny_llama_dir, folder, w))}

    bigram_target = root / "bigram-target"
    bigram_target.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", bigram_target / "config.json")
    save_file({n: t * 0.0 if re.search(r"(o_proj|down_proj)\.weight$", n) else t
               for n, t in target_w.items()}, bigram_target / "model.safetensors")
    wb = eagle_weights(seed=6, attn_scale=0.02, mlp_scale=0.02)
    norm = target_w["model.norm.weight"]
    wb["fc.weight"] = torch.cat([10 * torch.diag(norm), torch.zeros(H, H)], dim=1)
    wb["fc.bias"] = 0.01 * torch.randn(H, generator=torch.Generator().manual_seed(7))
    folder = write_eagle(root / "bigram", wb, bin_format=False)
    out["bigram"] = (bigram_target, folder, Reference(bigram_target, folder, wb))
    return out


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _spec(folder, k=K) -> dict:
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": k}


@pytest.mark.parametrize("name,async_scheduling", [("random", False), ("bigram", False),
                                                    ("random", True), ("bigram", True)])
def test_eagle_is_lossless_and_drafts_the_eagle_prediction(ckpts, name, async_scheduling) -> None:
    target, folder, ref = ckpts[name]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # Chunked prefills (24 tokens a step) and blocks of 4: the mirror covers chunks that
    # sample nothing, decodes, and verify steps with rejections (and acceptances).
    kw = dict(max_num_batched_tokens=24)
    plain = tiny_llm(target, **kw)
    kw["async_scheduling"] = async_scheduling  # drafting steps one at a time, others pipelined
    llm = tiny_llm(target, speculative_config=_spec(folder), **kw)
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
    assert counter.drafts > 0 and counter.draft_tokens >= counter.drafts
    assert 0 <= counter.accepted <= counter.draft_tokens <= K * counter.drafts
    if name == "bigram":  # verify steps with accepted drafts are exercised
        assert counter.accepted >= 0.7 * counter.draft_tokens, vars(counter)
    # Every proposal (after prefills, decodes, and verify steps) is the EAGLE formula's.
    assert len(log) > 20
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_eagle_head_matches_the_formula(ckpts) -> None:
    """One head pass over a fresh sequence against the plain evaluation, to 1e-4; the head
    shares the target's embedding and output head (no copies kept)."""
    target, folder, ref = ckpts["bigram"]
    llm = tiny_llm(target, speculative_config=_spec(folder, 1))
    runner = llm.llm_engine.core.runner
    head = runner.drafter.model
    assert head.embed_tokens.weight is runner.model.model.embed_tokens.weight
    assert head.lm_head.weight is runner.model.lm_head.weight
    assert head.fc.bias is not None
    seq = random_prompts(1, seed=3, lo=13, hi=14)[0]["prompt_token_ids"]
    hidden = ref.hidden(seq)
    want_y, want_logits = ref.eagle(seq[1:], hidden[:-1])
    t = len(seq) - 1
    md = runner.drafter._metadata([t], [0], [list(range(-(-t // 4)))], 0)
    with torch.inference_mode():
        y = head(torch.tensor(seq[1:]), torch.arange(t), hidden[:-1], md)
        logits = head.compute_logits(y)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_eagle_with_dummy_weights_is_lossless(ckpts) -> None:
    target, folder, _ = ckpts["random"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(2, seed=4, lo=2, hi=20)
    plain = tiny_llm(target, load_format="dummy")
    llm = tiny_llm(target, load_format="dummy", speculative_config=_spec(folder))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        plain.generate(prompts, sp, use_tqdm=False))


def test_eagle_errors(ckpts, tiny_llama_dir, tmp_path) -> None:
    _, folder, _ = ckpts["random"]
    with pytest.raises(ValueError, match="method 'eagle' needs 'model'"):
        SpeculativeConfig.from_user({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method 'eagle' needs 'model'"):
        tiny_llm(tiny_llama_dir,
                 speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    w = eagle_weights(seed=1)
    narrow = write_eagle(tmp_path / "narrow", w, hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size=32, the target 64"):
        tiny_llm(tiny_llama_dir, speculative_config=_spec(narrow))
    small = write_eagle(tmp_path / "small-vocab", w, vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size=256, the target 512"):
        tiny_llm(tiny_llama_dir, speculative_config=_spec(small))
    with pytest.raises(ValueError, match="not an EAGLE-1 head"):  # a plain Llama folder
        tiny_llm(tiny_llama_dir, speculative_config=_spec(tiny_llama_dir))
    with pytest.raises(ValueError, match="needs a local folder"):
        tiny_llm(tiny_llama_dir, speculative_config=_spec(tmp_path / "absent"))
    eagle3 = write_eagle(tmp_path / "eagle3", w, architectures=["LlamaForCausalLMEagle3"])
    with pytest.raises(ValueError, match="use method 'eagle3'"):
        tiny_llm(tiny_llama_dir, speculative_config=_spec(eagle3))
