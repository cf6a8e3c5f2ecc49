"""shoal's own classes for OLMo 2, Gemma 2, GLM-4, GLM-4.5 MoE, StarCoder2 and Cohere against
transformers' on tiny random checkpoints (fp32, 2-4 layers), through the whole engine.

Each config exercises what is particular to its family: post-norms and whole-projection q/k
norms (OLMo 2); sliding and global layers with prompts past the window, attention and final
logit soft-capping with caps small enough to bend the tiny model's values (Gemma 2); partial,
interleaved rotary and four norms per layer with a fused gate_up tensor (GLM-4); sigmoid routing
over groups with a large score-correction bias, shared experts and a first dense layer
(GLM-4.5 MoE); LayerNorm with biases, biased projections and a GELU MLP under a sliding window
(StarCoder2); parallel attention + MLP blocks, per-head q/k LayerNorm, interleaved rotary and
the logit scale (Cohere). Greedy tokens must equal transformers' and each token's logprob be
within 1e-4, in one batch run in chunked prefill steps beside other requests' decodes, and
again for prompts that start with the first batch's (prefix-cache hits). A second test undoes
each family's features in transformers' model (a cap, a window, the correction bias, ...) and
checks that the logits move: the checkpoints exercise what the first test claims to check."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import check_against_hf, randomize_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams

VOCAB = 256
WINDOW = 8
STEPS = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=256, max_model_len=128)


class _PerHeadRMSNorm(nn.Module):
    """OLMo 2's q/k norm applied per head instead of over the whole projection."""

    def __init__(self, norm: nn.Module, head_dim: int):
        super().__init__()
        self.norm, self.d = norm, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(*x.shape[:-1], -1, self.d)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        return h.reshape(x.shape) * self.norm.weight


def _per_head_qk_norm(hf) -> None:
    for layer in hf.model.layers:
        a = layer.self_attn
        a.q_norm, a.k_norm = _PerHeadRMSNorm(a.q_norm, a.head_dim), _PerHeadRMSNorm(a.k_norm,
                                                                                  a.head_dim)


def _no_attn_softcap(hf) -> None:
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def _set_config(**values: Any) -> Callable[[Any], None]:
    return lambda hf: [setattr(hf.config, k, v) for k, v in values.items()] and None


def _no_logit_scale(hf) -> None:
    hf.logit_scale = 1.0  # (CohereForCausalLM copies it from the config)


def _no_correction_bias(hf) -> None:
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()


@dataclass(frozen=True)
class Family:
    arch: str
    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window, when some slide
    # each undoes one of the family's features in transformers' model: the test's long
    # prompt must then give other logits (the checkpoint exercises that feature)
    ablations: tuple[Callable[[Any], None], ...] = ()


FAMILIES = {
    "olmo2": Family("Olmo2ForCausalLM", "olmo2", dict(num_hidden_layers=2, rms_norm_eps=1e-6),
                    ablations=(_per_head_qk_norm,)),
    "cohere": Family("CohereForCausalLM", "cohere",
                     dict(num_hidden_layers=2, use_qk_norm=True, attention_bias=True,
                          logit_scale=0.5, layer_norm_eps=1e-5),
                     ablations=(_no_logit_scale,)),
    "gemma2": Family("Gemma2ForCausalLM", "gemma2",
                     dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
                          sliding_window=WINDOW, attn_logit_softcapping=2.0,
                          final_logit_softcapping=3.0, rms_norm_eps=1e-6),
                     windows=(WINDOW, None, WINDOW, None),
                     ablations=(_no_attn_softcap, _set_config(final_logit_softcapping=None),
                                _set_config(sliding_window=1000))),
    "glm4": Family("Glm4ForCausalLM", "glm4",
                   dict(num_hidden_layers=2, head_dim=16, attention_bias=True,
                        partial_rotary_factor=0.5, rms_norm_eps=1e-6)),
    # 8 experts in 4 groups, 2 groups kept, top-3 among their experts; layer 0 is dense
    "glm4_moe": Family("Glm4MoeForCausalLM", "glm4_moe",
                       dict(num_hidden_layers=3, head_dim=16, partial_rotary_factor=0.5,
                            attention_bias=True, use_qk_norm=True, n_routed_experts=8,
                            num_experts_per_tok=3, n_group=4, topk_group=2,
                            moe_intermediate_size=32, n_shared_experts=1,
                            first_k_dense_replace=1, norm_topk_prob=True,
                            routed_scaling_factor=2.5, rms_norm_eps=1e-6),
                       ablations=(_no_correction_bias,)),
    "starcoder2": Family("Starcoder2ForCausalLM", "starcoder2",
                         dict(num_hidden_layers=2, sliding_window=WINDOW),
                         windows=(WINDOW, WINDOW),
                         ablations=(_set_config(sliding_window=None),)),
}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))]
            for _ in range(n)] + [[(7 * i) % 250 + 3 for i in range(40)]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory) -> tuple[Family, Path, Any]:
    fam = FAMILIES[request.param]
    cfg = AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.fields},
                               architectures=[fam.arch])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_weights(hf)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: randomize_weights skips it
                buf.uniform_(-1.0, 1.0)  # as large as the sigmoid scores: it changes choices
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return fam, path, hf


def test_greedy_and_prefix_hits_match_transformers(tiny) -> None:
    fam, path, hf = tiny
    llm = LLM(model=str(path), **ENGINE)
    model = llm.llm_engine.core.runner.model
    assert type(model).__name__ == fam.arch  # shoal's own class, not the backend
    if fam.windows:
        assert tuple(a.sliding_window for a in model.attention_layers()) == fam.windows
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    prompts = _prompts(4, seed=1)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(first, prompts, hf, STEPS)
    # the same prompts with new tails: their full blocks come from the prefix cache
    again = [p + [5, 6, 7] for p in prompts if len(p) >= 8]
    outs = llm.generate([{"prompt_token_ids": p} for p in again], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 4 for o in outs), [o.num_cached_tokens for o in outs]
    check_against_hf(outs, again, hf, STEPS)


def test_the_checkpoints_exercise_each_feature(tiny) -> None:
    fam, _, hf = tiny
    prompt = torch.tensor([_prompts(0, seed=0)[-1]])  # longer than the window
    with torch.no_grad():
        ref = torch.log_softmax(hf(prompt).logits[0], -1)
        for ablate in fam.ablations:
            other = copy.deepcopy(hf)
            ablate(other)
            diff = (torch.log_softmax(other(prompt).logits[0], -1) - ref).abs().max().item()
            assert diff > 1e-2, (fam.arch, ablate)


@pytest.mark.parametrize("arch, model_type, act", [
    ("Olmo2ForCausalLM", "olmo2", "gelu"), ("Glm4ForCausalLM", "glm4", "relu"),
    ("Starcoder2ForCausalLM", "starcoder2", "relu")])
def test_an_activation_the_class_lacks_is_refused(arch, model_type, act) -> None:
    from shoal.models.registry import resolve_model_class

    cfg = AutoConfig.for_model(model_type, **{**COMMON, "num_hidden_layers": 1},
                               hidden_act=act, architectures=[arch])
    with pytest.raises(ValueError, match=f"hidden_act must be .*got '{act}'"):
        resolve_model_class(cfg)(cfg, torch.float32)


def test_a_backend_without_soft_capping_refuses_gemma2() -> None:
    """A backend that cannot cap (here one that fuses rotary into its cache write, as Triton
    does) must not run Gemma 2's layers without the cap: they refuse it when it is bound,
    saying why. (The Triton backend caps: tests/attention/test_triton_softcap.py.)"""
    from shoal.attention.triton_backend import TritonAttentionBackend
    from shoal.models.gemma2 import Gemma2ForCausalLM

    class NoCap(TritonAttentionBackend):
        supports_softcap = False

    fam = FAMILIES["gemma2"]
    cfg = AutoConfig.for_model("gemma2", **{**COMMON, **fam.fields, "num_hidden_layers": 1})
    model = Gemma2ForCausalLM(cfg, torch.float32, use_triton_ops=False)
    for layer in model.attention_layers():
        with pytest.raises(NotImplementedError,
                           match="soft-capping; use attention_backend='torch'"):
            layer.backend = NoCap()
