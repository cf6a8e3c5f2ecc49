from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf_factory import F32, llama_cpp_permute

from shoal.loader import load_model
from shoal.loader.gguf_loader import unpermute_qk


def _weights(tiny) -> dict[str, torch.Tensor]:
    return dict(load_model(str(tiny.path)).weights())


def test_config_from_metadata(tiny_llama):
    config = load_model(str(tiny_llama.path)).hf_config
    spec = tiny_llama.spec
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size == spec.hidden
    assert config.intermediate_size == spec.intermediate
    assert config.num_hidden_layers == spec.layers
    assert config.num_attention_heads == spec.heads
    assert config.num_key_value_heads == spec.kv_heads
    assert config.head_dim == spec.head_dim
    assert config.max_position_embeddings == spec.context_length
    assert config.rope_parameters["rope_theta"] == spec.rope_theta
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.vocab_size == tiny_llama.original["model.embed_tokens.weight"].shape[0]
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert config.dtype == torch.float32


def test_weights_are_float32_in_hf_layout(tiny_llama):
    weights = _weights(tiny_llama)
    assert set(weights) == set(tiny_llama.expected)
    assert "lm_head.weight" not in weights  # tied
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.is_contiguous(), name
        np.testing.assert_array_equal(tensor.numpy(), tiny_llama.expected[name], err_msg=name)


def test_q8_0_dequantization_is_close_to_original(tiny_llama):
    weights = _weights(tiny_llama)
    name = "model.layers.0.mlp.gate_proj.weight"  # stored as Q8_0
    original = tiny_llama.original[name]
    assert not np.array_equal(weights[name].numpy(), original)  # really was quantized
    # Q8_0: 32 values share one step = max|x| / 127 (kept as fp16), so each value is off by about
    # half a step; the fp16 rounding of the step adds up to 127 * 2**-11 steps on top
    step = np.abs(original).reshape(original.shape[0], -1, 32).max(axis=-1) / 127
    error = np.abs(weights[name].numpy() - original).reshape(step.shape + (32,))
    assert (error <= step[..., None] * (0.5 + 127 * 2**-11)).all()


def test_llama_qk_unpermutation_restores_original(make_gguf):
    tiny = make_gguf(matrix_type=F32)  # unquantized, so the comparison is exact
    weights = _weights(tiny)
    for layer in range(tiny.spec.layers):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            np.testing.assert_array_equal(weights[name].numpy(), tiny.original[name])


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(1)
    for heads, head_dim in [(4, 16), (3, 64), (1, 8)]:
        weight = rng.standard_normal((heads * head_dim, 24)).astype(np.float32)
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        np.testing.assert_array_equal(unpermute_qk(permuted, heads), weight)
        bias = rng.standard_normal(heads * head_dim).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(bias, heads), heads), bias)


def test_untied_model_yields_lm_head(make_gguf):
    tiny = make_gguf(tied=False)
    loaded = load_model(str(tiny.path))
    assert loaded.hf_config.tie_word_embeddings is False
    weights = dict(loaded.weights())
    np.testing.assert_array_equal(
        weights["lm_head.weight"].numpy(), tiny.expected["lm_head.weight"]
    )


def test_weights_can_be_iterated_twice_and_lazily(tiny_llama):
    loaded = load_model(str(tiny_llama.path))
    first = next(iter(loaded.weights()))
    again = dict(loaded.weights())
    assert torch.equal(again[first[0]], first[1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_architectures(make_gguf, arch):
    # head_dim != hidden / heads, so it must come from key_length
    tiny = make_gguf(arch=arch, head_dim=32)
    loaded = load_model(str(tiny.path))
    assert loaded.hf_config.model_type == arch
    assert loaded.hf_config.head_dim == 32
    weights = dict(loaded.weights())
    assert set(weights) == set(tiny.expected)
    for name, tensor in weights.items():
        # no q/k un-permutation for qwen: llama.cpp stores their rows as transformers does
        np.testing.assert_array_equal(tensor.numpy(), tiny.expected[name], err_msg=name)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in weights
    else:
        assert "model.layers.0.self_attn.q_norm.weight" in weights


@pytest.mark.parametrize(
    ("arch", "head_dim"),
    # transformers' own qwen3 GGUF config ignores key_length, so give it its default head_dim
    [("llama", 16), ("qwen2", 16), ("qwen3", 128)],
)
def test_matches_transformers_gguf_loader(make_gguf, arch, head_dim):
    from transformers import AutoModelForCausalLM

    tiny = make_gguf(name=f"{arch}.gguf", arch=arch, head_dim=head_dim, tied=arch != "qwen2")
    ours = dict(load_model(str(tiny.path)).weights())
    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32
    ).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


def test_dummy_gguf_yields_no_weights(tiny_llama):
    loaded = load_model(str(tiny_llama.path), load_format="dummy")
    assert loaded.load_format == "dummy"
    assert list(loaded.weights()) == []
    assert loaded.hf_config.hidden_size == tiny_llama.spec.hidden
    assert loaded.tokenizer is not None


# ---- errors ---------------------------------------------------------------------------------


def test_unknown_architecture(tmp_path: Path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "'mamba'" in message and str(path) in message
    assert "llama" in message and "qwen2" in message and "qwen3" in message


def test_bad_magic(tiny_llama, tmp_path: Path):
    damaged = tmp_path / "bad_magic.gguf"
    data = bytearray(tiny_llama.path.read_bytes())
    data[:4] = b"GGML"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a GGUF file") as info:
        load_model(str(damaged))
    assert str(damaged) in str(info.value)


@pytest.mark.parametrize("keep", [10, 100, 0.5, -64])
def test_truncated_file(tiny_llama, tmp_path: Path, keep):
    data = tiny_llama.path.read_bytes()
    if isinstance(keep, float):
        cut = int(len(data) * keep)
    else:
        cut = keep if keep > 0 else len(data) + keep
    damaged = tmp_path / "truncated.gguf"
    damaged.write_bytes(data[:cut])
    with pytest.raises(ValueError) as info:
        load_model(str(damaged))
    assert str(damaged) in str(info.value)


def test_empty_file(tmp_path: Path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        load_model(str(empty))


def test_corrupted_header_bytes(tiny_llama, tmp_path: Path):
    damaged = tmp_path / "garbled.gguf"
    shutil.copy(tiny_llama.path, damaged)
    data = bytearray(damaged.read_bytes())
    data[8:24] = b"\xff" * 16  # absurd tensor and metadata counts
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="garbled.gguf"):
        load_model(str(damaged))


def test_unmappable_tensor_name(tmp_path: Path, make_gguf):
    tiny = make_gguf()
    # rename one tensor by editing its name in the header (same length keeps offsets valid)
    data = tiny.path.read_bytes().replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_xx.weight")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(data)
    with pytest.raises(ValueError, match="ffn_xx"):
        load_model(str(odd))
