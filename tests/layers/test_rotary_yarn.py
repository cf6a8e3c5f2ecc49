"""YaRN rope scaling and DeepSeek's softmax mscale against transformers: the frequencies and the
attention factor of ROPE_INIT_FUNCTIONS["yarn"], the cos/sin table they make (cos and sin times
the attention factor, float32 within 1e-6), DeepseekV3RotaryEmbedding's output and rotation,
yarn_apply_mscale / DeepseekV3Attention.scaling, and the config spellings of transformers 4
and 5."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

from shoal.layers.rotary import (  # noqa: E402
    RotaryEmbedding,
    _rope_freqs,
    get_rope,
    rope_parameters,
    yarn_softmax_scale,
)

DSV3 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}

# name -> (rope dim, theta, max_position_embeddings, yarn settings)
SETTINGS: dict[str, tuple[int, float, int, dict[str, Any]]] = {
    "deepseek_v3": (64, 10000.0, 163840, DSV3),
    "deepseek_v2_lite": (64, 10000.0, 163840,
                         {**DSV3, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "mscale_ne_all_dim": (64, 10000.0, 8192,
                          {**DSV3, "factor": 8, "original_max_position_embeddings": 1024,
                           "mscale": 1.0, "mscale_all_dim": 0.5}),
    "qwen_style": (128, 1e6, 32768, {"factor": 4.0, "original_max_position_embeddings": 32768}),
    "no_truncate_betas": (32, 50000.0, 4096,
                          {"factor": 8.0, "original_max_position_embeddings": 512,
                           "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    "attention_factor": (64, 10000.0, 8192,
                         {"factor": 2.0, "original_max_position_embeddings": 4096,
                          "attention_factor": 1.25}),
    "mscale_only": (64, 10000.0, 16384,
                    {"factor": 16.0, "original_max_position_embeddings": 1024, "mscale": 0.8}),
}


def hf_config(dim: int, theta: float, max_pos: int, yarn: dict[str, Any],
              cls: type = DeepseekV3Config) -> Any:
    return cls(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
               qk_rope_head_dim=dim, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=32,
               q_lora_rank=64, max_position_embeddings=max_pos,
               rope_parameters={**yarn, "rope_type": "yarn", "rope_theta": theta})


def table_from(inv: torch.Tensor, attention: float, positions: torch.Tensor) -> torch.Tensor:
    freqs = positions.double()[:, None] * inv.double()[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention).float()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_yarn_matches_transformers_rope_init(name: str) -> None:
    dim, theta, max_pos, yarn = SETTINGS[name]
    cfg = hf_config(dim, theta, max_pos, yarn)
    ref_inv, ref_attention = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    th, scaling = rope_parameters(cfg)
    assert th == theta and scaling is not None
    inv, attention = _rope_freqs(dim, th, scaling, cfg.max_position_embeddings)
    # The same float32 operations in the same order: transformers' frequencies, bit for bit.
    assert torch.equal(inv.float(), ref_inv)
    assert attention == pytest.approx(ref_attention, rel=1e-15, abs=0)
    if name in ("deepseek_v3", "deepseek_v2_lite"):
        assert attention == 1.0  # mscale == mscale_all_dim: the factors cancel
    else:
        assert attention != 1.0
    rope = RotaryEmbedding(dim, cfg.max_position_embeddings, th, scaling)
    assert rope.attention_factor == attention
    n = rope.cos_sin_cache.shape[0]
    assert n == max(max_pos, int(yarn["original_max_position_embeddings"] * yarn["factor"]))
    expect = table_from(ref_inv, ref_attention, torch.arange(n))
    torch.testing.assert_close(rope.cos_sin_cache, expect, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_yarn_matches_deepseek_v3_rotary_embedding(name: str) -> None:
    """DeepseekV3RotaryEmbedding's own cos/sin, and q/k rotated with them (the rotate_half
    layout: the model permutes interleaved checkpoints' rope columns at load time). It
    multiplies positions by frequencies in float32, so far positions differ by its rounding
    (about position * 6e-8): compare the first 64 positions and a few far ones loosely."""
    dim, theta, max_pos, yarn = SETTINGS[name]
    cfg = hf_config(dim, theta, max_pos, yarn)
    ref = hf_v3.DeepseekV3RotaryEmbedding(cfg)
    th, scaling = rope_parameters(cfg)
    rope = RotaryEmbedding(dim, cfg.max_position_embeddings, th, scaling)
    g = torch.Generator().manual_seed(0)
    for positions, tol in ((torch.arange(64), 1e-5),
                           (torch.randint(0, max_pos, (32,), generator=g), 2e-7 * max_pos)):
        cos, sin = ref(torch.zeros(1), positions[None])
        half = dim // 2
        got_cos, got_sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
        torch.testing.assert_close(got_cos, cos[0, :, :half], atol=tol, rtol=0)
        torch.testing.assert_close(got_sin, sin[0, :, :half], atol=tol, rtol=0)
        q = torch.randn(len(positions), 3, dim, generator=g)
        k = torch.randn(len(positions), 1, dim, generator=g)
        # transformers' layout: [batch, heads, seq, dim].
        ref_q, ref_k = hf_v3.apply_rotary_pos_emb(q.transpose(0, 1)[None],
                                                  k.transpose(0, 1)[None], cos, sin)
        got_q, got_k = rope.forward_native(positions, q, k)
        torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), atol=10 * tol, rtol=1e-5)
        torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), atol=10 * tol, rtol=1e-5)


def test_yarn_factor_none_takes_the_context_ratio() -> None:
    """transformers: without a factor, max_position_embeddings / original."""
    yarn = {"factor": None, "original_max_position_embeddings": 1024, "mscale": 1.0,
            "mscale_all_dim": 0.5}
    cfg = hf_config(64, 10000.0, 8192, yarn)
    ref_inv, ref_attention = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    inv, attention = _rope_freqs(64, *rope_parameters(cfg), cfg.max_position_embeddings)
    assert torch.equal(inv.float(), ref_inv) and attention == pytest.approx(ref_attention)
    rope = RotaryEmbedding(64, 8192, 10000.0, rope_parameters(cfg)[1])
    assert rope.cos_sin_cache.shape == (8192, 64)


# ---- softmax scale -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_softmax_scale_matches_yarn_apply_mscale(name: str) -> None:
    dim, theta, max_pos, yarn = SETTINGS[name]
    cfg = hf_config(dim, theta, max_pos, yarn)
    base = cfg.qk_head_dim ** -0.5
    _, scaling = rope_parameters(cfg)
    got = yarn_softmax_scale(scaling, base)
    assert got == hf_v3.yarn_apply_mscale(cfg.rope_parameters, base)
    assert got == hf_v2.yarn_apply_mscale(cfg.rope_parameters, base)
    assert got == hf_v3.DeepseekV3Attention(cfg, layer_idx=0).scaling
    if yarn.get("mscale_all_dim"):
        m = 0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0
        assert got == pytest.approx(base * m * m, rel=1e-15) and got != base
    else:
        assert got == base


def test_softmax_scale_without_yarn_is_the_base() -> None:
    assert yarn_softmax_scale(None, 0.125) == 0.125
    assert yarn_softmax_scale({}, 0.125) == 0.125
    assert yarn_softmax_scale({"rope_type": "default", "mscale_all_dim": 1.0,
                               "factor": 40}, 0.125) == 0.125
    assert yarn_softmax_scale({"rope_type": "yarn", "factor": 40,
                               "mscale_all_dim": 0}, 0.125) == 0.125
    # The factor at or below one: mscale is 1.
    assert yarn_softmax_scale({"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},
                              0.125) == 0.125
    # The transformers 4 spelling ("type") is honoured.
    v4 = yarn_softmax_scale({"type": "yarn", **DSV3}, 0.125)
    assert v4 == pytest.approx(0.125 * (0.1 * math.log(40) + 1) ** 2)


# ---- config spellings --------------------------------------------------------------------------


def test_config_spellings_give_one_table() -> None:
    """A transformers 5 DeepseekV3Config / DeepseekV2Config (built from rope_parameters or from
    a legacy rope_scaling), and a transformers 4 style object with rope_scaling {"type":
    "yarn"}, all give the same scaling and table."""
    dim, theta, max_pos, yarn = SETTINGS["deepseek_v2_lite"]
    v3 = hf_config(dim, theta, max_pos, yarn)
    v2 = hf_config(dim, theta, max_pos, yarn, cls=DeepseekV2Config)
    legacy = DeepseekV3Config(max_position_embeddings=max_pos, rope_theta=theta,
                              qk_rope_head_dim=dim, rope_scaling={**yarn, "type": "yarn"})
    v4 = SimpleNamespace(rope_theta=theta, max_position_embeddings=max_pos,
                         rope_scaling={**yarn, "type": "yarn"})
    ref_inv, ref_attention = ROPE_INIT_FUNCTIONS["yarn"](v3)
    expect = table_from(ref_inv, ref_attention, torch.arange(max_pos))
    for cfg in (v3, v2, legacy, v4):
        th, scaling = rope_parameters(cfg)
        assert th == theta and scaling["factor"] == 40
        assert scaling["original_max_position_embeddings"] == 4096
        assert yarn_softmax_scale(scaling, 0.1) == hf_v3.yarn_apply_mscale(v3.rope_parameters, 0.1)
        rope = RotaryEmbedding(dim, max_pos, th, scaling)
        torch.testing.assert_close(rope.cos_sin_cache, expect, atol=1e-6, rtol=0)
    assert v4.rope_scaling.get("rope_type") is None  # the config's own dict is not changed


def test_rope_parameters_fills_original_max_position_like_transformers() -> None:
    yarn = {"type": "yarn", "factor": 4.0}
    v4 = SimpleNamespace(rope_theta=1e4, max_position_embeddings=2048, rope_scaling=yarn)
    assert rope_parameters(v4)[1]["original_max_position_embeddings"] == 2048
    assert "original_max_position_embeddings" not in yarn
    hf = DeepseekV3Config(max_position_embeddings=2048, rope_theta=1e4, rope_scaling=dict(yarn))
    assert rope_parameters(hf)[1]["original_max_position_embeddings"] == 2048
    # A top-level original_max_position_embeddings wins over the dict's, as in transformers.
    phi = SimpleNamespace(rope_theta=1e4, max_position_embeddings=8192,
                          original_max_position_embeddings=1024,
                          rope_scaling={**yarn, "original_max_position_embeddings": 4096})
    assert rope_parameters(phi)[1]["original_max_position_embeddings"] == 1024


# ---- sharing and the kernel --------------------------------------------------------------------


def test_get_rope_shares_by_value_with_nested_settings() -> None:
    a = {"rope_type": "yarn", **DSV3, "extra": {"x": [1, 2], "y": {"b": 1, "a": 2}}}
    b = {"extra": {"y": {"a": 2, "b": 1}, "x": [1, 2]}, **DSV3, "rope_type": "yarn"}
    c = {**a, "extra": {"x": [1, 3], "y": {"b": 1, "a": 2}}}
    ra = get_rope(64, 1024, 10000.0, a, use_triton_ops=False)
    assert get_rope(64, 1024, 10000.0, b, use_triton_ops=False) is ra
    assert get_rope(64, 1024, 10000.0, c, use_triton_ops=False) is not ra
    assert get_rope(64, 1024, 10000.0, {**a, "factor": 20},
                    use_triton_ops=False) is not ra
    assert ra.cos_sin_cache.shape == (4096 * 40, 64)  # spans original * factor


def test_triton_kernel_reads_the_scaled_table() -> None:
    pytest.importorskip("triton")
    from shoal.layers.ops.rotary import rotary_embedding

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dim, theta, max_pos, yarn = SETTINGS["mscale_ne_all_dim"]
    rope = RotaryEmbedding(dim, max_pos, theta, {**yarn, "rope_type": "yarn"}).to(dev)
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, max_pos, (7,), generator=g).to(dev)
    q = torch.randn(7, 4, dim, generator=g).to(dev)
    k = torch.randn(7, 1, dim, generator=g).to(dev)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    got_q, got_k = rotary_embedding(positions, q.clone(), k.clone(), rope.cos_sin_cache)
    torch.testing.assert_close(got_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, ref_k, atol=1e-5, rtol=1e-5)
