"""llama.cpp's deepseek2 GGUF files (DeepSeek-V2 / V2-Lite, V3, Kimi-K2) against transformers.

Tiny random DeepSeek models are written the way llama.cpp's converter writes them
(DeepseekV2Model in conversion/deepseek.py, ggml-org/llama.cpp): tensor names from gguf-py's
own name map for MODEL_ARCH.DEEPSEEK2, experts stacked [experts, rows, cols] per projection,
e_score_correction_bias renamed to exp_probs_b.bias, no rotary row permutation (deepseek2 uses
ggml's interleaved "normal" rope, which is the checkpoints' own layout), 1-D tensors, norms and
the router in F32, and the metadata keys of both the current converter (kv_b_proj split into
attn_k_b / attn_v_b, *_mla head sizes, head_count_kv = 1) and the one before llama.cpp's MLA
support (one attn_kv_b, per-head key/value lengths, no expert_gating_func). shoal then runs
them through the whole engine and must match transformers' greedy tokens and logprobs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from gguf_factory import byte_level_vocab
from oracle import hf_greedy, write_tiny_checkpoint
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.loader import load_model
from shoal.loader.gguf_loader import join_kv_b

Q8_0 = GGMLQuantizationType.Q8_0
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           num_key_value_heads=4)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)


def _yarn(mscale_all_dim: float) -> dict:
    return dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
                mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)


# name: (model_type, checkpoint overrides, how the file is written)
VARIANTS = {
    # V3 / Kimi-K2 shape: q_lora, sigmoid group-limited routing with the correction bias,
    # renormalized and scaled weights; today's converter, F16 matrices
    "v3": ("deepseek_v3", dict(q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5, rope_parameters=_yarn(1.0)),
           dict(legacy=False, f16=True)),
    # V2-Lite shape (no q_lora, greedy softmax routing), written by a pre-MLA converter
    "v2-lite-legacy": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy",
                                           routed_scaling_factor=1.5,
                                           rope_parameters=_yarn(0.707)),
                       dict(legacy=True, f16=False)),
    # V2 shape: q_lora, group-limited greedy softmax routing; today's converter
    "v2-grouped": ("deepseek_v2", dict(q_lora_rank=48, topk_method="group_limited_greedy",
                                       n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                       rope_parameters=_yarn(0.707)),
                   dict(legacy=False, f16=False)),
}


# ---- writing a GGUF file as llama.cpp's converter does --------------------------------------


def _converter_tensors(hf, split_kv_b: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint-style name, tensor) pairs as DeepseekV2Model.modify_tensors hands them to
    map_tensor_name: experts stacked per projection, kv_b_proj split per head into
    k_b_proj (transposed) and v_b_proj, e_score_correction_bias renamed."""
    cfg = hf.config
    for name, tensor in hf.state_dict().items():
        tensor = tensor.detach().float()
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        stacked = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$",
                           name)
        if stacked:
            # transformers 5 holds the experts stacked, [experts, rows, cols]: the same
            # torch.stack the converter applies to the checkpoint's per-expert tensors
            prefix = stacked[1]
            if stacked[2] == "down_proj":
                yield f"{prefix}.down_proj.weight", tensor
            else:
                gate, up = tensor.chunk(2, dim=1)
                yield f"{prefix}.gate_proj.weight", gate
                yield f"{prefix}.up_proj.weight", up
            continue
        assert ".experts." not in name, name
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            heads, nope, v = cfg.num_key_value_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = tensor.view(heads, nope + v, tensor.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
            continue
        yield name, tensor


def write_deepseek_gguf(path: Path, hf, *, legacy: bool, f16: bool) -> Path:
    cfg = hf.config
    writer = GGUFWriter(str(path), "deepseek2")
    _add_metadata(writer, cfg, legacy)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    for name, tensor in _converter_tensors(hf, split_kv_b=not legacy):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        values = tensor.contiguous().numpy()
        keep_f32 = (values.ndim <= 1 or gguf_name.endswith("_norm.weight")
                    or ".ffn_gate_inp." in gguf_name)  # as the converter forces F32
        writer.add_tensor(gguf_name, values.astype(np.float16 if f16 and not keep_f32
                                                   else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(w: GGUFWriter, cfg, legacy: bool) -> None:
    rope = cfg.rope_parameters
    # TextModel.set_gguf_parameters
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_attention_heads if legacy else 1)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not legacy:  # newer converters: group counts and the gating function
        if cfg.n_group is not None:
            w.add_expert_group_count(cfg.n_group)
            w.add_expert_group_used_count(cfg.topk_group)
        sigmoid = cfg.model_type == "deepseek_v3"  # config.json's scoring_func
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if not legacy:
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    # DeepseekV2Model.set_gguf_parameters
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if legacy:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.model_type == "deepseek_v3" and cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    _add_tokenizer(w, cfg.vocab_size)


def _add_tokenizer(w: GGUFWriter, vocab_size: int) -> None:
    tokens, types, merges = byte_level_vocab()
    # the converter pads a vocabulary smaller than the embedding as unused [PAD<i>] tokens
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(name) -> (name, transformers model, GGUF path), each variant written once."""
    built: dict[str, tuple[str, object, Path]] = {}

    def make(name: str):
        if name not in built:
            model_type, overrides, how = VARIANTS[name]
            folder = tmp_path_factory.mktemp(f"deepseek-{name}")
            write_tiny_checkpoint(folder, model_type, seed=3, **MLA, **MOE, **overrides)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            if how["f16"]:  # the file holds the matrices in F16: compare with rounded weights
                with torch.no_grad():
                    for pname, p in hf.named_parameters():
                        if p.dim() >= 2 and not pname.endswith("mlp.gate.weight"):
                            p.copy_(p.half().float())
            built[name] = name, hf, write_deepseek_gguf(folder / f"{name}.gguf", hf, **how)
        return built[name]

    return make


@pytest.fixture(params=list(VARIANTS))
def variant(request, build):
    return build(request.param)


@pytest.fixture
def v3_path(build) -> Path:
    return build("v3")[2]


# ---- tests ------------------------------------------------------------------------------------


def test_config_from_metadata(variant):
    _, hf, path = variant
    ours, want = load_model(str(path), load_format="dummy").hf_config, hf.config
    assert ours.model_type == want.model_type
    assert ours.architectures == [f"Deepseek{want.model_type[-2:].upper()}ForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "kv_lora_rank",
                "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "first_k_dense_replace", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(want, key), key
    assert ours.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert ours.routed_scaling_factor == pytest.approx(want.routed_scaling_factor)
    if want.model_type == "deepseek_v3":
        assert (ours.n_group, ours.topk_group, ours.norm_topk_prob) == (4, 2, True)
        assert ours.rope_interleave is True
    else:
        assert ours.topk_method == want.topk_method
        if want.topk_method == "group_limited_greedy":
            assert (ours.n_group, ours.topk_group) == (want.n_group, want.topk_group)
    rope, want_rope = ours.rope_parameters, want.rope_parameters
    assert rope["rope_type"] == "yarn"
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0}  # older converters wrote no betas
    for key in ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim"):  # mscale*: log multiplier / 0.1
        assert rope.get(key, defaults.get(key)) == want_rope[key], key


def test_weights_round_trip_to_the_checkpoint_layout(variant):
    """Every parameter comes back exactly, in the checkpoint's (interleaved-rope) layout: no
    row permutation is undone for deepseek2, experts come back one per expert, and the split
    k_b / v_b come back as one kv_b_proj."""
    _, hf, path = variant
    ours = dict(load_model(str(path)).weights())
    want = {}
    for name, tensor in hf.state_dict().items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if not m:
            want[name] = tensor
            continue
        for e, t in enumerate(tensor.unbind(0)):
            if m[2] == "down_proj":
                want[f"{m[1]}.{e}.down_proj.weight"] = t
            else:
                want[f"{m[1]}.{e}.gate_proj.weight"], want[f"{m[1]}.{e}.up_proj.weight"] = \
                    t.chunk(2, dim=0)
    assert set(ours) == set(want)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, want[name].float()), name


def test_greedy_matches_transformers(variant):
    _, hf, path = variant
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
              max_model_len=256, max_num_batched_tokens=16)
    prompts = [[5, 9, 33, 100, 7, 8, 200, 3, 11, 64, 250, 17], [300, 41], [77] * 20]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, prompt, 8)
        got = out.outputs[0]
        assert got.token_ids == ref
        for step, (tok, logits) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(logits, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)


def test_join_kv_b_inverts_the_converter_split():
    heads, lora, nope, v = 3, 10, 4, 6
    kv_b = torch.randn(heads * (nope + v), lora)
    k_b, v_b = torch.split(kv_b.view(heads, nope + v, lora), [nope, v], dim=1)
    joined = join_kv_b(k_b.transpose(1, 2).numpy(), v_b.numpy())
    np.testing.assert_array_equal(joined, kv_b.numpy())
    with pytest.raises(ValueError, match="attn_k_b"):
        join_kv_b(k_b.numpy(), v_b.numpy())  # not transposed: lora and nope disagree


# ---- files shoal must refuse or complete ------------------------------------------------------


def _rewrite(src: Path, dst: Path, *, drop: tuple[str, ...] = (), keys: dict | None = None,
             edit: Callable[[dict[str, np.ndarray]], dict[str, tuple[np.ndarray, Any]]]
             | None = None) -> Path:
    """A copy of a GGUF file without some tensors (name suffixes), with some uint32 or bool
    keys replaced or added, and its float tensors passed through `edit` (name -> values in
    torch order; returns name -> (array, raw GGML type or None))."""
    reader = gguf.GGUFReader(str(src))
    writer = GGUFWriter(str(dst), "deepseek2")
    keys = dict(keys or {})
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in keys:
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    for key, value in keys.items():
        (writer.add_bool if isinstance(value, bool) else writer.add_uint32)(key, value)
    tensors = {t.name: np.array(t.data).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
               for t in reader.tensors if not t.name.endswith(drop)}
    edited = edit(tensors) if edit else {n: (a, None) for n, a in tensors.items()}
    for name, (values, raw_dtype) in edited.items():
        writer.add_tensor(name, values, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_fused_and_quantized_expert_tensors(v3_path, tmp_path):
    """ffn_gate_up_exps (--fuse-gate-up-exps: gate's rows, then up's) splits per expert like
    the separate tensors; a quantized stack dequantizes expert by expert to the same values
    as the whole tensor."""
    expected: dict[str, np.ndarray] = {}

    def edit(tensors):
        out = {}
        for name, values in tensors.items():
            layer = name.split(".")[1]
            if name.endswith("ffn_gate_exps.weight"):
                continue
            if name.endswith("ffn_up_exps.weight"):
                gate = tensors[name.replace("ffn_up_exps", "ffn_gate_exps")]
                fused = np.concatenate([gate, values], axis=1).astype(np.float32)
                out[f"blk.{layer}.ffn_gate_up_exps.weight"] = fused, None
                for e in range(fused.shape[0]):
                    expected[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] = gate[e]
                    expected[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"] = values[e]
            elif name.endswith("ffn_down_exps.weight"):
                packed = quantize(values.astype(np.float32), Q8_0)
                whole = dequantize(packed, Q8_0).reshape(values.shape)
                out[name] = packed, Q8_0
                for e in range(values.shape[0]):
                    expected[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = whole[e]
            else:
                out[name] = values, None
        return out

    rewritten = _rewrite(v3_path, tmp_path / "fused.gguf", edit=edit)
    weights = dict(load_model(str(rewritten)).weights())
    assert len(expected) == 2 * 8 * 3
    for name, want in expected.items():
        np.testing.assert_array_equal(weights[name].numpy(), want.astype(np.float32),
                                      err_msg=name)


def test_sigmoid_routing_without_bias_gets_zero_bias(v3_path, tmp_path):
    stripped = _rewrite(v3_path, tmp_path / "nobias.gguf", drop=(".exp_probs_b.bias",))
    loaded = load_model(str(stripped))
    assert loaded.hf_config.model_type == "deepseek_v3"  # stated by expert_gating_func
    weights = dict(loaded.weights())
    for layer in (1, 2):
        bias = weights[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert torch.equal(bias, torch.zeros(8))


def test_unknown_gating_func_and_half_split_kv_b_are_refused(v3_path, tmp_path):
    odd = _rewrite(v3_path, tmp_path / "gating.gguf", keys={"deepseek2.expert_gating_func": 3})
    with pytest.raises(ValueError, match="expert_gating_func"):
        load_model(str(odd))
    half = _rewrite(v3_path, tmp_path / "half.gguf", drop=("blk.1.attn_v_b.weight",))
    with pytest.raises(ValueError, match="attn_k_b"):
        load_model(str(half))


def test_softmax_routing_with_renormalization_is_refused(build, tmp_path):
    """transformers' (and shoal's) DeepSeek-V2 routing never renormalizes the top-k weights,
    llama.cpp would: such a file is refused rather than run differently."""
    path = build("v2-grouped")[2]
    odd = _rewrite(path, tmp_path / "norm.gguf", keys={"deepseek2.expert_weights_norm": True})
    with pytest.raises(ValueError, match="expert_weights_norm"):
        load_model(str(odd))
