"""kv_cache_dtype="fp8" through the whole engine on the tiny random Llama: exactly what
transformers gives when its keys and values go through FP8 with the checkpoint's scales
(which load from the checkpoint's own names), and close to the "auto" run.

The tiny model's random weights make its logits flat (the largest |logit| is about 5, its
top two often a few hundredths apart) and sensitive: FP8's rounding of K and V (up to 1/16 of
each value) moves the gaps between its logits by up to 0.19 of that scale (median 0.06,
measured on the prompts below), so most prompts leave the auto run's tokens within a few
steps, at near ties of that size; the exact comparison with transformers carries the
correctness."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers.models.llama.modeling_llama as hf_llama
from deepseek_tiny import V3, write_deepseek
from engine_helpers import random_prompts, tiny_llm
from kv_fp8_helpers import compare_with_auto, greedy_run
from oracle import check_against_hf
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.attention.kv_quant import round_trip
from shoal.layers.attention import Attention
from shoal.layers.latent_attention import LatentAttention
from shoal.loader.kv_scales import KVScales, apply_kv_scales, without_kv_scales

STEPS = 16
PROMPTS = [p["prompt_token_ids"] for p in random_prompts(8, seed=3, lo=1, hi=60)]
# A near tie for FP8 on this model: the measured gap errors (up to 0.19 of the row's
# largest |logit|) with room.
TINY_FP8_TIE_MARGIN = 0.25
# Measured mean |logprob difference| against the auto run: 0.137 (float32), 0.139
# (bfloat16) over these prompts.
TINY_MEAN_LOGPROB_BOUND = 0.3
# (layer, k_scale, v_scale) the checkpoint carries, under the names vLLM reads: layer 0 as
# `self_attn.k_scale` / `v_scale`, layer 1 as `self_attn.k_proj.output_scale` (its v: 1.0).
# Exact in float32, as the checkpoint stores them.
SCALES = {0: (3 / 128, 3 / 64), 1: (3 / 32, 1.0)}


@pytest.fixture(scope="module")
def scaled_checkpoint(tiny_llama_dir, tmp_path_factory):
    """The tiny checkpoint plus KV-cache scales (transformers loads the folder without)."""
    path = tmp_path_factory.mktemp("tiny-llama-kv-scales")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, path / f.name)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(SCALES[0][0])
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(SCALES[0][1])
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([SCALES[1][0]])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_fp8_cache_is_transformers_with_fp8_keys_and_values(scaled_checkpoint, tiny_llama_dir,
                                                            monkeypatch):
    """Each layer's keys and values rounded through FP8 with its scales, in transformers'
    eager attention, give the engine's tokens and logprobs (float32): prefill, decode and
    chunked-prefill reads of the cache included (max_num_batched_tokens 24). Measured here:
    1e-6 apart; 1e-2 leaves room for another CPU's float32 differences putting a value
    across an FP8 rounding boundary (a few 1e-3 each), while rounding with 1.0 instead of the
    checkpoint's scales moves logprobs by 0.29 to 0.43 and changes tokens."""
    llm = tiny_llm(scaled_checkpoint, kv_cache_dtype="fp8", max_num_batched_tokens=24)
    runner = llm.llm_engine.core.runner
    attn = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == [SCALES[0], SCALES[1]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = PROMPTS[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    eager = hf_llama.eager_attention_forward

    def fp8_kv(module, query, key, value, *args, **kwargs):
        ks, vs = SCALES[module.layer_idx]
        return eager(module, query, round_trip(key, ks), round_trip(value, vs), *args, **kwargs)

    monkeypatch.setattr(hf_llama, "eager_attention_forward", fp8_kv)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    check_against_hf(outs, prompts, hf, 8, tol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_and_logprobs_close_to_the_auto_run(tiny_llama_dir, dtype):
    auto = greedy_run(tiny_llm(tiny_llama_dir, dtype=dtype), PROMPTS, STEPS)
    fp8 = greedy_run(tiny_llm(tiny_llama_dir, dtype=dtype, kv_cache_dtype="fp8"), PROMPTS,
                     STEPS)
    cmp = compare_with_auto(fp8, auto, TINY_FP8_TIE_MARGIN)
    assert cmp.mean_abs_logprob_diff < TINY_MEAN_LOGPROB_BOUND, cmp.describe()
    print(f"tiny llama {dtype}: {cmp.describe()}")


def test_checkpoint_scale_names_reach_the_attention_layers():
    """Every name vLLM reads a KV scale under, taken out of the weight stream; a query scale
    is dropped; the latent layer of MLA takes its k_scale for the row."""
    names = {
        "model.layers.0.self_attn.kv_scale": 0.5,  # older FP8 exports: both
        "model.layers.1.self_attn.attn.k_scale": 0.25,  # on the attention layer itself
        "model.layers.1.self_attn.v_proj.v_scale": 2.0,  # ModelOpt
        "model.layers.2.self_attn.k_proj.output_scale": 4.0,
        "model.layers.2.self_attn.q_scale": 9.0,
        "model.layers.2.self_attn.k_proj.weight": 1.0,
        "model.layers.2.self_attn.k_proj.weight_scale": 1.0,
    }
    scales = KVScales()
    weights = without_kv_scales(lambda: iter((n, torch.tensor([v])) for n, v in names.items()),
                                scales)
    assert [n for n, _ in weights()] == ["model.layers.2.self_attn.k_proj.weight",
                                         "model.layers.2.self_attn.k_proj.weight_scale"]
    per_head = torch.tensor([0.5, 3.0, 1.0])  # the largest serves the whole tensor
    assert scales.take("model.layers.3.self_attn.v_scale", per_head)

    class Block(nn.Module):
        def __init__(self, attn: nn.Module):
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.attn = attn

    layers = [Attention(4, 2, 16) for _ in range(4)] + [LatentAttention(4, 32, 16, 0.1)]
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(Block(a) for a in layers)
    scales.take("model.layers.4.self_attn.k_scale", torch.tensor(0.125))
    assert apply_kv_scales(model, scales) == 5
    assert [(a.k_scale, a.v_scale) for a in layers[:4]] == [
        (0.5, 0.5), (0.25, 2.0), (4.0, 1.0), (1.0, 3.0)]
    assert layers[4].kv_scale == 0.125


def test_latent_fp8_cache_is_transformers_with_fp8_latents(tmp_path, monkeypatch):
    """DeepSeek-V3's MLA: the cached row (normed latent + rotated shared key) through FP8 with
    the layer's one scale (layer 1's k_scale from the checkpoint, 1.0 elsewhere), as
    transformers' cache rows rounded the same way give it, on the torch backend.

    The two compute the latent in another order (float32 differences of 1e-5), which can put
    a value on the other side of an FP8 rounding boundary: one such flip (seen at layer 1)
    moves a logprob by up to 4e-3; rounding with 1.0 instead of layer 1's scale moves them by
    0.07 to 6 and changes tokens."""
    path, hf = write_deepseek(tmp_path / "v3", "deepseek_v3", seed=1, **V3)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(3 / 32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    scales = {1: 3 / 32}
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=24, block_size=4,
              num_gpu_blocks_override=256, max_model_len=256, kv_cache_dtype="fp8")
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    cls = hf.model.layers[0].self_attn.__class__
    expand = cls.expand_kv

    def fp8_rows(self, kv_nope, k_rot):
        s = scales.get(self.layer_idx, 1.0)
        return expand(self, round_trip(kv_nope, s), round_trip(k_rot, s))

    monkeypatch.setattr(cls, "expand_kv", fp8_rows)
    check_against_hf(outs, prompts, hf, 8, tol=1e-2)
