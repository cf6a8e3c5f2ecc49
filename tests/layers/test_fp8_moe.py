"""FP8 experts (shoal/layers/moe/triton_experts_fp8.py) on the CPU through Triton's
interpreter (conftest.py), on tiny shapes: the grouped FP8 GEMMs against their plain PyTorch
twin, which rounds the activations the same way and dequantizes the weights (tight
tolerance); a FusedMoE holding FP8 experts against the dense layer of the dequantized weights
(within FP8's rounding); launch shapes that do not depend on the routing (CUDA graphs); the
fast path's loading of FP8 expert shards (tensor-parallel slices, refusals); and a tiny
FP8-block Qwen3-MoE checkpoint through the engine with the fast path let onto the CPU: experts
kept in FP8, the tokens of its dequantized twin. With a GPU the kernels run compiled (FP8
needs compute capability 8.9); the load tests are the CPU's (the fast path forced onto it)."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

import shoal.layers.moe.layer as moe_layer  # noqa: E402
import shoal.layers.moe.triton_experts_fp8 as fp8_moe  # noqa: E402
from shoal.layers.moe.activation import SILU  # noqa: E402
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.moe.router import select_experts  # noqa: E402
from shoal.layers.moe.triton_experts_fp8 import (  # noqa: E402
    FP8Experts,
    dequantize_experts,
    experts_fp8_reference,
    experts_triton_fp8,
    fp8_rounded,
    make_fp8_experts,
)
from shoal.quantization.packed import dequantize_packed, quantize_fp8  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEV.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 tensor cores need compute capability 8.9", allow_module_level=True)
CPU_ONLY = pytest.mark.skipif(DEV.type == "cuda", reason="the fast path forced onto the CPU")
E, TOP_K, H, INTER = 4, 2, 256, 256
BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of a value.
E4M3_REL = 2.0 ** -4


def routed(t: int, seed: int, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x [t, H], w13 [E, 2I, H], w2 [E, H, I] and a softmax top-k routing (or `ids` with
    random weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER ** 0.5
    if ids is None:
        weights, ids = select_experts(torch.randn(t, E, generator=g) * 2, TOP_K, True)
    else:
        weights = torch.rand(ids.shape, generator=g) + 0.1
    return x, w13, w2, weights, ids


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None,
                static: bool = False) -> FP8Experts:
    """Each expert quantized per tile (block) or per row, stacked as the loader stacks
    them; static: activation scales of 0.02 (expert 2's 0.03: the largest is taken)."""
    def stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        ps = [quantize_fp8(one, block) for one in w]
        return (torch.stack([p.parts["weight"] for p in ps]),
                torch.stack([p.parts["scale"] for p in ps]), ps[0].group)

    inputs = (None, None)
    if static:
        scales = torch.full((E, 1, 1), 0.02)
        scales[2] = 0.03
        inputs = (scales.expand(E, 2 * INTER, 1), scales.expand(E, H, 1))
    q = make_fp8_experts(*stack(w13), *stack(w2), *inputs)
    return dataclasses.replace(q, **{f.name: getattr(q, f.name).to(DEV) for f in
                                     dataclasses.fields(q)
                                     if isinstance(getattr(q, f.name), torch.Tensor)})


def on_dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in tensors]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


# ---- the kernel against its PyTorch twin -----------------------------------------------------


@pytest.mark.parametrize("scheme", ["block", "channel", "static_bias"])
def test_fp8_grouped_gemm_matches_its_torch_twin(scheme: str) -> None:
    x, w13, w2, weights, ids = routed(5, seed=1)
    q = fp8_experts(w13, w2, BLOCK if scheme == "block" else None, static=scheme == "static_bias")
    if scheme == "block":  # one scale per 128 x 128 tile, as the checkpoint stores them
        assert (q.group, q.scale_rows13, q.scale_rows2) == (128, 128, 128)
        assert q.w13_scale.shape == (E, 2 * INTER // 128, H // 128)
        assert q.w2_scale.shape == (E, H // 128, INTER // 128)
        assert torch.equal(dequantize_experts(q.w13, q.w13_scale, 128, 128)[1].cpu(),
                           dequantize_packed(quantize_fp8(w13[1], BLOCK)))
    else:
        assert q.group is None and q.w13_scale.shape == (E, 2 * INTER, 1)
        if scheme == "static_bias":
            assert q.input_scale13.item() == pytest.approx(0.03)
    g = torch.Generator().manual_seed(2)
    bias = {} if scheme != "static_bias" else dict(
        w13_bias=torch.randn(E, 2 * INTER, generator=g) * 0.1,
        w2_bias=torch.randn(E, H, generator=g) * 0.1)
    bias = {k: v.to(DEV) for k, v in bias.items()}
    x, weights, ids = on_dev(x, weights, ids)
    got = experts_triton_fp8(x, q, weights, ids, **bias)
    _close(got, experts_fp8_reference(x, q, weights, ids, **bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_with_fp8_experts_is_the_dense_layer_within_fp8_rounding(dtype) -> None:
    """The bound: the weights are the same (dequantized) values, so the difference is the
    activations' rounding to e4m3, at most 2^-4 of each value and about 2^-4 / sqrt(6) ~ 2.6%
    in RMS for values spread over a binade. The output carries three independent such
    roundings (x into gate and into up, then SiLU(gate) * up into down): about sqrt(3) x
    2.6% ~ 4.4% of its norm, under 2^-4 = 6.25%. A wrong scale or expert is off by ~100%."""
    x, w13, w2, weights, ids = routed(6, seed=2)
    q = fp8_experts(w13, w2, BLOCK)
    dense = FusedMoE(E, H, INTER).to(DEV)
    dense.w13_weight.data = dequantize_experts(q.w13, q.w13_scale, 128, 128)
    dense.w2_weight.data = dequantize_experts(q.w2, q.w2_scale, 128, 128)
    layer = FusedMoE(E, H, INTER, params_dtype=dtype).to(DEV)
    layer.install_fp8(q)
    x, weights, ids = on_dev(x, weights, ids)
    assert layer.quant is q and layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
    assert not dict(layer.named_parameters())  # buffers: sleep keeps them, updates refused
    assert layer.w13_weight_scale.shape == (E, 4, 2) and layer.w2_weight_scale.shape == (E, 2, 2)
    want = dense(x, weights, ids)
    got = layer(x.to(dtype), weights.to(dtype), ids)
    assert got.dtype == dtype
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < E4M3_REL, rel


def test_other_ranks_experts_contribute_nothing() -> None:
    """Expert parallelism: ids == E (another rank's expert) run as expert 0 with weight 0."""
    x, w13, w2, weights, ids = routed(3, seed=4)
    layer = FusedMoE(E, H, INTER).to(DEV)
    layer.install_fp8(fp8_experts(w13, w2, BLOCK))
    x, weights, ids = on_dev(x, weights, ids)
    foreign = ids.clone()
    foreign[:, 1] = E
    got = layer._experts(x, weights, foreign, True, None, True)
    mine = torch.where(foreign < E, weights, torch.zeros_like(weights))
    _close(got, experts_fp8_reference(x, layer.quant, mine, foreign % E))


def test_launch_shapes_do_not_depend_on_the_routing(monkeypatch) -> None:
    """What a CUDA graph needs: the same T, k and E launch the same grids on the same buffer
    shapes whatever the routing (spread over the experts, or all on two)."""
    launches: list[tuple] = []
    kernel = fp8_moe._fp8_grouped_gemm_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, [tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                        for a in args], sorted(kw.items())))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(fp8_moe, "_fp8_grouped_gemm_kernel", Recorder())
    _, w13, w2, _, _ = routed(1, seed=5)
    q = fp8_experts(w13, w2, BLOCK)
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        x, _, _, weights, _ = routed(3, seed=6, ids=ids)
        x, weights, ids = on_dev(x, weights, ids)
        _close(experts_triton_fp8(x, q, weights, ids), experts_fp8_reference(x, q, weights, ids))
    assert len(launches) == 4 and launches[:2] == launches[2:]


def test_make_fp8_experts_refuses_what_the_kernel_cannot_take() -> None:
    w13 = torch.zeros(2, 64, 64, dtype=FP8)
    w2 = torch.zeros(2, 64, 32, dtype=FP8)
    with pytest.raises(ValueError, match="power of two"):
        make_fp8_experts(w13, torch.ones(2, 64, 3), 24, w2, torch.ones(2, 64, 2), 24)
    with pytest.raises(ValueError, match="not both per block"):
        make_fp8_experts(w13, torch.ones(2, 64, 2), 32, w2, torch.ones(2, 64, 2), 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        make_fp8_experts(w13.float(), torch.ones(2, 64, 1), 64, w2, torch.ones(2, 64, 1), 32)


# ---- loading through the fast path -----------------------------------------------------------

OFF_GROUPS = ("a rank's share of the expert inputs is not whole scale groups, or the "
              "experts' layouts differ")
# (moe_intermediate_size, fp8 block / None: per channel, rank of 2 tensor-parallel
# ranks or None, why it stays dense or None: kept FP8)
LOAD_CASES = {
    "fp8-block": (64, (32, 32), None, None),
    "fp8-block-tp-rank1": (64, (32, 32), 1, None),
    "fp8-channel": (64, None, None, None),
    "fp8-block-tp-off-the-groups": (96, (32, 32), 1, OFF_GROUPS),  # 48 inputs a rank
}


@CPU_ONLY
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_fast_path_loads_expert_shards_packed_or_refuses(case, monkeypatch, caplog) -> None:
    """Each expert's gate / up / down stand-ins through FusedMoE's own loader: the layer's
    rows (this rank's under tensor parallelism) in FP8 equal the checkpoint's dequantized
    weights; a rank's slice off the scale groups is dequantized, logged (INT4 experts:
    test_int4_moe.py)."""
    from quantization.quant_checkpoints import fp8_block, fp8_rows

    from shoal.quantization.config import parse_quantization_config
    from shoal.quantization.fast_path import FastPath
    from shoal.quantization.formats import linear_format

    inter, block, rank, refused = LOAD_CASES[case]
    if rank is not None:  # rank 1 of 2 tensor-parallel ranks
        monkeypatch.setattr(moe_layer, "get_tp_world_size", lambda: 2)
        monkeypatch.setattr(moe_layer, "get_tp_rank", lambda: rank)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block:
        config["weight_block_size"] = list(block)
    quantize = (lambda w: fp8_block(w, block)) if block else fp8_rows
    qconfig = parse_quantization_config(config)
    path = FastPath.plan(qconfig, torch.float32, "cpu", allow_cpu=True)
    holder = torch.nn.Module()
    holder.moe = moe = FusedMoE(2, 64, inter)
    g = torch.Generator().manual_seed(7)
    refs = {}
    with path.loading(holder), caplog.at_level(logging.INFO, "shoal.quantization.fast_path"):
        for e in range(2):
            for shard, shape in (("w1", (inter, 64)), ("w3", (inter, 64)), ("w2", (64, inter))):
                q = quantize(torch.randn(*shape, generator=g))
                refs[e, shard] = q.reference
                param = moe.w2_weight if shard == "w2" else moe.w13_weight
                param.weight_loader(param, path._pack(linear_format(qconfig), "m", q.stored),
                                    e, shard)
        counts = path.finish(holder)
    cols = slice(None) if rank is None else slice(rank * inter // 2, (rank + 1) * inter // 2)
    w13 = torch.stack([torch.cat([refs[e, "w1"][cols], refs[e, "w3"][cols]]) for e in range(2)])
    w2 = torch.stack([refs[e, "w2"][:, cols] for e in range(2)])
    if refused is None:
        assert isinstance(moe.quant, FP8Experts) and moe.w13_weight.dtype == FP8
        assert counts == {moe.quant.name: 1}
        q = moe.quant
        got13 = dequantize_experts(q.w13, q.w13_scale, q.scale_rows13, q.group)
        got2 = dequantize_experts(q.w2, q.w2_scale, q.scale_rows2, q.group)
    else:
        assert moe.quant is None and moe.w13_weight.dtype == torch.float32
        assert counts == {f"dense experts ({refused})": 1}
        assert f"MoE experts of 1 layer(s) (e.g. moe) kept dense, not FP8: {refused}" \
            in caplog.text
        got13, got2 = moe.w13_weight, moe.w2_weight
    assert torch.equal(got13, w13) and torch.equal(got2, w2)


@CPU_ONLY
@pytest.mark.parametrize("online", [True, False], ids=["online-fp8", "dummy-fp8-block"])
def test_dense_experts_are_quantized_at_finish(online: bool) -> None:
    """Online FP8 (per channel) and dummy weights of an FP8-block config (benchmarks): the
    dense experts become FP8 experts whose weights are their per-row / per-tile rounding."""
    from shoal.quantization.config import QuantizationConfig
    from shoal.quantization.fast_path import FastPath

    qconfig = QuantizationConfig("fp8", online=True) if online else QuantizationConfig(
        "fp8", weight_block_size=(32, 32))
    holder = torch.nn.Module()
    holder.moe = moe = FusedMoE(2, 64, 64)
    torch.manual_seed(8)
    dense = [torch.randn_like(p) for p in (moe.w13_weight, moe.w2_weight)]
    moe.w13_weight.data, moe.w2_weight.data = (d.clone() for d in dense)
    path = FastPath.plan(qconfig, torch.float32, "cpu", dummy=not online, allow_cpu=True)
    with path.loading(holder):
        pass
    counts = path.finish(holder)
    q = moe.quant
    assert isinstance(q, FP8Experts) and counts == {q.name: 1}
    assert q.group == (None if online else 32)
    for w, s, rows, want in ((q.w13, q.w13_scale, q.scale_rows13, dense[0]),
                             (q.w2, q.w2_scale, q.scale_rows2, dense[1])):
        block = None if online else (32, 32)
        rounded = torch.stack([dequantize_packed(quantize_fp8(e, block)) for e in want])
        assert torch.equal(dequantize_experts(w, s, rows, q.group), rounded)


# ---- a checkpoint through the engine ---------------------------------------------------------

QWEN3_MOE = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=E,
                 num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, mlp_only_layers=[1],
                 norm_topk_prob=True)
# Both runs round the same activations to FP8 from float32 values that agree to ~1e-6: a value
# rounding the other way at a grid boundary is rare and moves a logprob by ~1e-3 at most.
NEAR_TIE = 1e-2


def _greedy(llm) -> list:
    from shoal import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 12))] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _round_activations_like_fp8(moe: FusedMoE) -> None:
    """The dense twin's experts see the FP8 path's activations: x and SiLU(gate) * up
    rounded to e4m3 per token and group of 128, as experts_triton_fp8 quantizes them."""
    forward = moe.forward
    moe.activation = lambda gate_up: fp8_rounded(SILU(gate_up), BLOCK[1])
    moe.forward = lambda x, w, ids: forward(fp8_rounded(x, BLOCK[1]), w, ids)


@CPU_ONLY
def test_fp8_block_qwen3_moe_keeps_experts_in_fp8_and_matches_its_twin(
        tmp_path, monkeypatch, caplog) -> None:
    from oracle import write_tiny_checkpoint
    from quantization.quant_checkpoints import fp8_block, quantize_folder

    from shoal import LLM
    from shoal.quantization.fast_path import FastPath

    src = write_tiny_checkpoint(tmp_path / "src", "qwen3_moe", seed=5, **QWEN3_MOE)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}
    quant, dense = quantize_folder(src, tmp_path, lambda w: fp8_block(w, BLOCK), config,
                                   select=lambda m: ".mlp.experts." in m)
    plan = FastPath.plan.__func__
    monkeypatch.setattr(FastPath, "plan", classmethod(
        lambda cls, q, dtype, device, dummy=False, allow_cpu=False:
        plan(cls, q, dtype, device, dummy, True)))
    kwargs = dict(dtype="float32", block_size=16, num_gpu_blocks_override=32, max_model_len=64)
    with caplog.at_level(logging.INFO, logger="shoal.quantization.fast_path"):
        llm = LLM(model=str(quant), **kwargs)
    assert "fp8 experts block 128x128 (Triton) x1" in caplog.text
    moes = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 1 and isinstance(moes[0].quant, FP8Experts)
    assert moes[0].w13_weight.dtype == FP8 and moes[0].w13_weight_scale.shape == (E, 4, 2)
    got = _greedy(llm)
    monkeypatch.undo()
    twin = LLM(model=str(dense), **kwargs)
    for m in twin.llm_engine.core.runner.model.modules():
        if isinstance(m, FusedMoE):
            _round_activations_like_fp8(m)
    for g, r in zip(got, _greedy(twin)):
        for pos, (gt, rt) in enumerate(zip(g.token_ids, r.token_ids)):
            top = r.logprobs[pos]
            if gt != rt:
                gap = top[rt].logprob - top[gt].logprob if gt in top else float("inf")
                assert gap < NEAR_TIE, f"token {pos}: {gt} vs {rt}, not a near tie ({gap})"
                break
            assert abs(g.logprobs[pos][gt].logprob - top[rt].logprob) < NEAR_TIE
