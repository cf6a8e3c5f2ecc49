"""DeepseekRouter against transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter built from
tiny configs: the chosen experts (as a set per token) and their weights, in float32 and bf16."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (  # noqa: E402
    DeepseekV2TopkRouter,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3TopkRouter,
)

from shoal.layers.moe.deepseek_router import DeepseekRouter  # noqa: E402

H, T = 64, 64


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id, so routings that list the same experts in another order
    compare equal."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def check_same_routing(ours: DeepseekRouter, hf: torch.nn.Module, x: torch.Tensor) -> None:
    weights, ids = ours(x)
    assert ids.dtype == torch.int64 and weights.dtype == x.dtype
    assert weights.shape == ids.shape == (x.shape[0], ours.top_k)
    _, ref_w, ref_ids = hf(x)
    got_w, got_ids = by_id(weights, ids)
    ref_w, ref_ids = by_id(ref_w.to(x.dtype), ref_ids)
    assert torch.equal(got_ids, ref_ids)
    # The same float32 operations in the same order: equal up to the final rounding.
    torch.testing.assert_close(got_w, ref_w, atol=0, rtol=1e-6)


def make_inputs(e: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, H, generator=g) / H ** 0.5).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    return w, x


def build(cfg, hf_cls, w: torch.Tensor, params_dtype: torch.dtype,
          bias: torch.Tensor | None = None) -> tuple[DeepseekRouter, torch.nn.Module]:
    """Ours with the weight in params_dtype; transformers' gate in float32 (as its
    _keep_in_fp32_modules_strict keeps it) holding the same values."""
    ours = DeepseekRouter(cfg, params_dtype)
    ours.weight.weight_loader(ours.weight, w)
    hf = hf_cls(cfg)
    with torch.no_grad():
        hf.weight.copy_(w.float())
        if bias is not None:
            ours.e_score_correction_bias.weight_loader(ours.e_score_correction_bias, bias)
            hf.e_score_correction_bias.copy_(bias)
    return ours, hf


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.bfloat16)]  # (activations, gate weight)


# ---- V3: sigmoid, noaux_tc ---------------------------------------------------------------------


@pytest.mark.parametrize(("act_dtype", "params_dtype"), DTYPES)
@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (4, 2), (8, 3), (4, 4)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_v3_matches_transformers(act_dtype, params_dtype, n_group, topk_group, norm,
                                 scale) -> None:
    e, k = 32, 6
    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=e, num_experts_per_tok=k,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                           routed_scaling_factor=scale)
    w, x = make_inputs(e, act_dtype, seed=n_group * 10 + topk_group)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(7)) * 0.05
    ours, hf = build(cfg, DeepseekV3TopkRouter, w, params_dtype, bias)
    assert ours.version == 3 and ours.e_score_correction_bias.dtype == torch.float32
    check_same_routing(ours, hf, x)


def test_v3_bias_and_groups_change_the_choice() -> None:
    """The cases above are not vacuous: the correction bias and the group limit each change
    some tokens' experts, and the weights stay the unbiased scores."""
    e, k = 32, 6
    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=e, num_experts_per_tok=k,
                           n_group=8, topk_group=3, norm_topk_prob=False,
                           routed_scaling_factor=1.0)
    w, x = make_inputs(e, torch.float32, seed=1)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(7)) * 0.05
    biased, _ = build(cfg, DeepseekV3TopkRouter, w, torch.float32, bias)
    plain, _ = build(cfg, DeepseekV3TopkRouter, w, torch.float32)
    wb, ib = by_id(*biased(x))
    _, ip = by_id(*plain(x))
    assert (ib != ip).any(dim=-1).sum() > 0
    scores = torch.sigmoid(x @ w.t())
    torch.testing.assert_close(wb, scores.gather(1, ib))
    ungrouped = torch.topk(scores, k, dim=-1)[1].sort(dim=-1)[0]
    assert (ungrouped != ip).any(dim=-1).sum() > 0


# ---- V2: softmax, greedy / group_limited_greedy ------------------------------------------------


@pytest.mark.parametrize(("act_dtype", "params_dtype"), DTYPES)
@pytest.mark.parametrize(("method", "n_group", "topk_group"),
                         [("greedy", None, None), ("group_limited_greedy", 1, 1),
                          ("group_limited_greedy", 4, 2), ("group_limited_greedy", 8, 3)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_v2_matches_transformers(act_dtype, params_dtype, method, n_group, topk_group, norm,
                                 scale) -> None:
    e, k = 32, 6
    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=e, num_experts_per_tok=k,
                           topk_method=method, n_group=n_group, topk_group=topk_group,
                           norm_topk_prob=norm, routed_scaling_factor=scale)
    w, x = make_inputs(e, act_dtype, seed=3)
    ours, hf = build(cfg, DeepseekV2TopkRouter, w, params_dtype)
    assert ours.version == 2 and not hasattr(ours, "e_score_correction_bias")
    check_same_routing(ours, hf, x)
    if norm and scale == 1.0:
        # transformers applies no norm_topk_prob for V2: the weights do not sum to one.
        assert not torch.allclose(ours(x)[0].float().sum(-1), torch.ones(T))


def test_v2_group_limit_changes_the_choice() -> None:
    e, k = 32, 6
    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=e, num_experts_per_tok=k,
                           topk_method="group_limited_greedy", n_group=8, topk_group=3,
                           routed_scaling_factor=1.0)
    w, x = make_inputs(e, torch.float32, seed=3)
    ours, _ = build(cfg, DeepseekV2TopkRouter, w, torch.float32)
    _, ids = by_id(*ours(x))
    ungrouped = torch.topk(torch.softmax(x @ w.t(), -1), k, dim=-1)[1].sort(dim=-1)[0]
    assert (ungrouped != ids).any(dim=-1).sum() > 0


# ---- construction ------------------------------------------------------------------------------


def test_version_and_parameter_names() -> None:
    v3 = DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=2, n_group=4,
                          topk_group=2)
    router = DeepseekRouter(v3, torch.bfloat16)
    assert router.version == 3
    params = dict(router.named_parameters())
    assert set(params) == {"weight", "e_score_correction_bias"}
    assert params["weight"].dtype == torch.bfloat16 and params["weight"].shape == (16, H)
    assert params["e_score_correction_bias"].dtype == torch.float32
    assert all(hasattr(p, "weight_loader") for p in params.values())
    assert DeepseekRouter(v3).weight.dtype == torch.float32  # float32 unless told
    # A hub config.json spells the V3 method out; V2 configs carry topk_method.
    v3.topk_method, v3.scoring_func = "noaux_tc", "sigmoid"
    assert DeepseekRouter(v3).version == 3
    v2 = DeepseekV2Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=2)
    assert DeepseekRouter(v2).version == 2
    assert set(dict(DeepseekRouter(v2).named_parameters())) == {"weight"}


def test_rejects_bad_configs() -> None:
    def v3(**kw) -> DeepseekV3Config:
        base = dict(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                    topk_group=2)
        return DeepseekV3Config(**{**base, **kw})

    with pytest.raises(ValueError, match="divide"):
        DeepseekRouter(v3(n_group=3))
    with pytest.raises(ValueError, match="exceeds"):
        DeepseekRouter(v3(num_experts_per_tok=9))
    with pytest.raises(ValueError, match="two best"):
        DeepseekRouter(v3(n_group=16, topk_group=8))
    cfg = v3()
    cfg.scoring_func = "softmax"
    with pytest.raises(ValueError, match="sigmoid"):
        DeepseekRouter(cfg, version=3)
    cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"
    with pytest.raises(ValueError, match="greedy"):
        DeepseekRouter(cfg, version=2)
    with pytest.raises(ValueError, match="pass version"):
        DeepseekRouter(SimpleNamespace(hidden_size=H, n_routed_experts=16,
                                       num_experts_per_tok=2, model_type="mystery"))
