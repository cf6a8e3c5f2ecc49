"""llama.cpp's Gated DeltaNet hybrid files (qwen3next, qwen35, qwen35moe) against transformers.

Tiny random Qwen3-Next, Qwen3.5 and Qwen3.5-MoE models are written the way llama.cpp's
converter writes them (Qwen3NextModel and its Qwen3.5 subclasses, convert_hf_to_gguf.py /
conversion/qwen.py): names from gguf-py's own map for each architecture, offset norms stored
as 1 + w, A_log as -exp(A_log), dt_bias as ssm_dt.bias, the conv1d weight squeezed, Qwen3-Next's
in_proj_qkvz split into attn_qkv and attn_gate, Qwen3.5's value heads reordered from grouped to
tiled, experts stacked per projection, and Qwen3.5's MTP layer appended as an extra block.
shoal reads them back as the checkpoints and must match transformers' greedy tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_factory import byte_level_vocab
from oracle import check_against_hf, write_tiny_checkpoint
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.loader import load_model

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
              full_attention_interval=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, norm_topk_prob=True)
# model_type: (llama.cpp architecture, checkpoint overrides)
KINDS = {
    "qwen3_next": (gguf.MODEL_ARCH.QWEN3NEXT, {**LINEAR, **MOE}),
    "qwen3_5_text": (gguf.MODEL_ARCH.QWEN35, LINEAR),
    "qwen3_5_moe_text": (gguf.MODEL_ARCH.QWEN35MOE, {**LINEAR, **MOE}),
}


# ---- writing a GGUF file as llama.cpp's converter does --------------------------------------


def _tiled(t: torch.Tensor, dim: int, nk: int, r: int, width: int) -> torch.Tensor:
    """Value heads grouped by key head -> tiled (the converter's reorder for Qwen3.5)."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], nk, r, width, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape)


def _qwen35_reorder(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r, dk, dv = nv // nk, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if ".linear_attn." not in name or nk == nv:
        return t
    if ".in_proj_qkv." in name or ".conv1d." in name:
        t = t.squeeze() if ".conv1d." in name else t
        qk = 2 * nk * dk
        return torch.cat([t[:qk], _tiled(t[qk:], 0, nk, r, dv)])
    if ".in_proj_z." in name:
        return _tiled(t, 0, nk, r, dv)
    if ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
        return _tiled(t, 0, nk, r, 1)
    if ".out_proj." in name:
        return _tiled(t, 1, nk, r, dv)
    return t


def _converter_tensors(hf, arch) -> Iterator[tuple[str, torch.Tensor]]:
    cfg = hf.config
    for name, t in hf.state_dict().items():
        t = t.detach().float()
        if arch != gguf.MODEL_ARCH.QWEN3NEXT:
            t = _qwen35_reorder(name, t, cfg)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if m := re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name):
            if m[2] == "down_proj":
                yield f"{m[1]}.down_proj.weight", t
            else:
                gate, up = t.chunk(2, dim=1)
                yield f"{m[1]}.gate_proj.weight", gate
                yield f"{m[1]}.up_proj.weight", up
            continue
        if "in_proj_qkvz.weight" in name:
            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            parts = t.T.reshape(cfg.hidden_size, nk, -1).split(
                [dk, dk, nv // nk * dv, nv // nk * dv], dim=-1)
            q, k, v, z = (p.reshape(cfg.hidden_size, -1) for p in parts)
            yield "ATTN_QKV", torch.cat([q, k, v], dim=-1).T.contiguous(), name
            yield "ATTN_GATE", z.T.contiguous(), name
            continue
        yield name, t


def write_hybrid_gguf(path: Path, hf, arch, *, q8: bool = False, mtp: bool = False,
                      drop: tuple[str, ...] = (), inner_size: int | None = None) -> Path:
    """drop: tensors left out; inner_size: a wrong ssm.inner_size to state."""
    cfg = hf.config
    blocks = cfg.num_hidden_layers + (1 if mtp else 0)
    writer = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, cfg, arch, blocks, mtp, inner_size)
    names = gguf.get_tensor_name_map(arch, blocks)
    for item in _converter_tensors(hf, arch):
        if len(item) == 3:  # the qkvz split: named by tensor kind and block
            kind, t, source = item
            bid = int(source.split(".")[2])
            gguf_name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, kind)].format(bid=bid)
            gguf_name += ".weight"
        else:
            name, t = item
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, item[0]
        if gguf_name in drop:
            continue
        values = t.contiguous().numpy().astype(np.float32)
        if q8 and values.ndim == 2 and values.shape[-1] % 32 == 0 \
                and ".ffn_gate_inp" not in gguf_name:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, values)
    if mtp:  # a stand-in for the MTP block the Qwen3.5 converter appends
        bid = cfg.num_hidden_layers
        h = cfg.hidden_size
        writer.add_tensor(f"blk.{bid}.nextn.eh_proj.weight", np.ones((h, 2 * h), np.float32))
        writer.add_tensor(f"blk.{bid}.attn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(w: GGUFWriter, cfg, arch, blocks: int, mtp: bool,
                  inner_size: int | None) -> None:
    # TextModel.set_gguf_parameters
    w.add_block_count(blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if arch == gguf.MODEL_ARCH.QWEN35:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch != gguf.MODEL_ARCH.QWEN35:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    # Qwen3NextModel.set_gguf_parameters
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(inner_size or cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(cfg.full_attention_interval)
    rotary = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(cfg.head_dim * rotary))
    if arch != gguf.MODEL_ARCH.QWEN3NEXT:
        w.add_rope_dimension_sections([2, 1, 1, 0])
    if mtp:
        w.add_nextn_predict_layers(1)
    tokens, types, merges = byte_level_vocab()
    types += [gguf.TokenType.UNUSED] * (cfg.vocab_size - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == gguf.MODEL_ARCH.QWEN3NEXT else "qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(KINDS))
def tiny(request, tmp_path_factory):
    model_type = request.param
    arch, overrides = KINDS[model_type]
    folder = tmp_path_factory.mktemp(model_type)
    write_tiny_checkpoint(folder, model_type, seed=5, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    mtp = arch != gguf.MODEL_ARCH.QWEN3NEXT
    return model_type, hf, write_hybrid_gguf(folder / "model.gguf", hf, arch, mtp=mtp)


# ---- tests ------------------------------------------------------------------------------------


def test_config_from_metadata(tiny):
    model_type, hf, path = tiny
    ours, want = load_model(str(path), load_format="dummy").hf_config, hf.config
    assert ours.model_type == model_type
    assert ours.architectures == [type(hf).__name__]
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "layer_types", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "tie_word_embeddings"]
    if model_type == "qwen3_5_text":
        keys.append("intermediate_size")
    else:
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "norm_topk_prob"]
    for key in keys:
        assert getattr(ours, key) == getattr(want, key), key
    rope = ours.rope_parameters
    assert rope["partial_rotary_factor"] == want.rope_parameters["partial_rotary_factor"]
    assert rope["rope_theta"] == want.rope_parameters["rope_theta"]


def test_weights_round_trip_to_the_checkpoint_layout(tiny):
    """Every tensor comes back in the checkpoint's layout (value heads grouped, q/k/v/z of
    Qwen3-Next interleaved, norms without the stored + 1, A_log from -exp(A_log)); the MTP
    block is left out."""
    _, hf, path = tiny
    ours = dict(load_model(str(path)).weights())
    want = {}
    for name, t in hf.state_dict().items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if not m:
            want[name] = t
            continue
        for e, x in enumerate(t.unbind(0)):
            if m[2] == "down_proj":
                want[f"{m[1]}.{e}.down_proj.weight"] = x
            else:
                want[f"{m[1]}.{e}.gate_proj.weight"], want[f"{m[1]}.{e}.up_proj.weight"] = \
                    x.chunk(2, dim=0)
    assert set(ours) == set(want)
    for name, t in ours.items():
        assert t.shape == want[name].shape, name
        # (w + 1) - 1 and log(exp(x)) round in float32
        torch.testing.assert_close(t, want[name].float(), rtol=1e-6, atol=1e-6, msg=name)


def test_greedy_matches_transformers(tiny):
    _, hf, path = tiny
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=64, max_model_len=512,
              max_num_batched_tokens=48)
    prompts = [[5, 9, 33, 100, 7, 8, 200, 3, 11, 64, 250, 17] * 6, [300, 41], [77] * 20]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # float32 on both sides, but summed in other orders (shoal's C++ layer kernels or torch,
    # against transformers' MKL): one step of the tiny Qwen3-Next (the 12-id x 6 prompt, its
    # fifth token) lands 0.9-1.04e-4 from transformers on an AMX Intel host with either path,
    # 1e-5 elsewhere; the gated delta rule's state carries such differences forward.
    check_against_hf(outs, prompts, hf, 8, tol=3e-4)


def test_quantized_matrices_load(tmp_path, tiny):
    """Q8_0 matrices (Qwen3-Next's attn_qkv / attn_gate among them) dequantize before the
    join and the value-head reorder: the result is the round-tripped checkpoint."""
    model_type, hf, _ = tiny
    arch = KINDS[model_type][0]
    path = write_hybrid_gguf(tmp_path / "q8.gguf", hf, arch, q8=True)
    ours = dict(load_model(str(path)).weights())
    name = ("model.layers.0.linear_attn.in_proj_qkvz.weight" if model_type == "qwen3_next"
            else "model.layers.0.linear_attn.in_proj_qkv.weight")
    want = hf.state_dict()[name]
    assert (ours[name] - want).abs().max() <= want.abs().max() / 127  # one Q8_0 step


def test_tokenizer_splits_like_qwen35(tiny):
    """qwen35's pre-tokenizer keeps combining marks inside a word."""
    model_type, _, path = tiny
    if model_type == "qwen3_next":
        pytest.skip("qwen3next files use qwen2's pre-tokenizer")
    from shoal.loader.gguf_pretokenizers import QWEN2_SPLIT, QWEN35_SPLIT, SPLITS
    assert SPLITS["qwen35"].regex == QWEN35_SPLIT != QWEN2_SPLIT
    tok = load_model(str(path), load_format="dummy").tokenizer
    word = "e\u0301t\u00e9"  # a combining acute accent, then a precomposed one
    assert tok.decode(tok.encode(word, add_special_tokens=False)) == "\u00e9t\u00e9"  # NFC


def test_missing_partner_and_bad_ssm_metadata_are_refused(tmp_path, tiny):
    model_type, hf, _ = tiny
    arch = KINDS[model_type][0]
    bad = write_hybrid_gguf(tmp_path / "bad.gguf", hf, arch, inner_size=30)
    with pytest.raises(ValueError, match="ssm.inner_size 30 for 4 value heads"):
        load_model(str(bad), load_format="dummy")
    if model_type == "qwen3_next":
        half = write_hybrid_gguf(tmp_path / "half.gguf", hf, arch,
                                 drop=("blk.0.attn_gate.weight",))
        with pytest.raises(ValueError, match="in_proj_qkvz needs both"):
            load_model(str(half))
