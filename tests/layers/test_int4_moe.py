"""INT4 weight-only experts (shoal/layers/moe/triton_experts_int4.py) on the CPU through
Triton's interpreter (conftest.py), on tiny shapes: the grouped W4A16 GEMMs against the
dequantized weights (symmetric and asymmetric, groups of 32 and 128, per channel); a FusedMoE
holding packed INT4 experts against the dense layer of the dequantized weights; launch shapes
that do not depend on the routing (CUDA graphs); the fast path's loading of GPTQ, AWQ and
compressed-tensors expert shards (tensor-parallel slices, refusals); and a tiny GPTQ
Qwen3-MoE checkpoint through the engine with the fast path let onto the CPU: experts kept
packed, the tokens of its dequantized twin. bfloat16 runs on a GPU only: the interpreter's
tl.dot gets bfloat16 wrong (float16 is the half-precision case here)."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

import shoal.layers.moe.layer as moe_layer  # noqa: E402
import shoal.layers.moe.triton_experts_int4 as int4_moe  # noqa: E402
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.moe.router import select_experts  # noqa: E402
from shoal.layers.moe.triton_experts_int4 import (  # noqa: E402
    Int4Experts,
    Int4Weights,
    dequantize_int4_experts,
    experts_int4_reference,
    experts_triton_int4,
    int4_weights,
)
from shoal.quantization.packed import dequantize_packed, quantize_int4  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if DEV.type == "cuda" and torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("the W4A16 kernel needs compute capability 8.0", allow_module_level=True)
CPU_ONLY = pytest.mark.skipif(DEV.type == "cuda", reason="the fast path forced onto the CPU")
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter's tl.dot gets bfloat16 wrong (triton-lang/triton#11584)"))
# I = 160: gate_up's 320 outputs end in a partial tile, and down's 160 inputs in a partial
# group of 128.
E, TOP_K, H, INTER = 4, 2, 256, 160


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


def stack(w: torch.Tensor, group: int, sym: bool) -> Int4Weights:
    """Each expert rounded to INT4 (packed.quantize_int4), stacked as the loader stacks them,
    converted to the kernel's layout; checked to dequantize to the same weights."""
    ps = [quantize_int4(one, group, sym) for one in w]
    q = int4_weights(*(torch.stack([p.parts[n] for p in ps]) for n in ("codes", "scale", "zero")),
                     ps[0].group, ps[0].in_features)
    assert (q.zeros is None) == sym
    assert torch.equal(dequantize_int4_experts(q), torch.stack([dequantize_packed(p) for p in ps]))
    return Int4Weights(*(t.to(DEV) if isinstance(t, torch.Tensor) else t
                         for t in (q.codes, q.scales, q.zeros, q.group, q.in_features)))


def int4_experts(w13: torch.Tensor, w2: torch.Tensor, group: int, sym: bool) -> Int4Experts:
    return Int4Experts(stack(w13, group, sym), stack(w2, group, sym))


def on_dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in tensors]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), (err, want.abs().max().item())


# ---- the kernel against the dequantized weights ----------------------------------------------

KERNEL_CASES = {  # group (-1: per channel), symmetric, dtype, biases
    "g32-sym": (32, True, torch.float32, False),
    "g128-asym": (128, False, torch.float32, False),
    "channel-sym-bias": (-1, True, torch.float32, True),
    "g32-asym-fp16": (32, False, torch.float16, False),
    "g128-sym-bf16": (128, True, torch.bfloat16, True),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_int4_grouped_gemm_matches_the_dequantized_weights(case: str) -> None:
    """float32: the PyTorch product of the dequantized weights, to 1e-5 of the largest
    output (only the summation order differs). Half precision: the twin rounds the weights
    and the intermediate rows to x's dtype as the kernel does; a sum rounding the other way
    moves an output by one unit in the last place (2^-11 fp16, 2^-8 bf16)."""
    group, sym, dtype, biased = KERNEL_CASES[case]
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the interpreter's tl.dot gets bfloat16 wrong (triton-lang/triton#11584)")
    x, w13, w2, weights, ids = routed(5, seed=1)
    q = int4_experts(w13, w2, group, sym)
    assert q.w13.codes.shape == (E, H // 8, 2 * INTER) and q.w2.codes.shape == (E, INTER // 8, H)
    groups = 1 if group == -1 else -(-INTER // group)
    assert q.w2.scales.shape == (E, groups, H) and q.w2.scales.dtype == torch.float16
    g = torch.Generator().manual_seed(2)
    bias = {} if not biased else dict(
        w13_bias=torch.randn(E, 2 * INTER, generator=g).to(DEV, dtype) * 0.1,
        w2_bias=torch.randn(E, H, generator=g).to(DEV, dtype) * 0.1)
    x, weights, ids = on_dev(x.to(dtype), weights.to(dtype), ids)
    got = experts_triton_int4(x, q, weights, ids, **bias)
    assert got.dtype == dtype
    want = experts_int4_reference(x, q, weights, ids, **bias)
    _close(got, want, {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype])
    if dtype == torch.float32:  # the twin itself: the dense PyTorch experts of those weights
        from shoal.layers.moe.torch_experts import experts_torch

        dense = [dequantize_int4_experts(w) for w in (q.w13, q.w2)]
        _close(got, experts_torch(x, *dense, weights, ids, **bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_fused_moe_with_int4_experts_is_the_dense_layer(dtype) -> None:
    """The dense layer holds the dequantized weights in the same dtype, so float32 agrees to
    the summation order. In half precision both round the weights the same way; the paths
    differ in where they round the rows: the dense path rounds each expert's down output,
    its routing-weighted copy and each running sum over the k experts, the kernel the
    weighted output once; each rounding moves a value by at most half a unit in the last
    place (2^-9 of it in bfloat16, 2^-12 in float16), and a gate/up value rounding the other
    way moves what follows by one unit. Eight such units bound the norm of the difference;
    a wrong scale, zero point or group is off by more than 10%."""
    x, w13, w2, weights, ids = routed(6, seed=2)
    q = int4_experts(w13, w2, 32, sym=False)
    dense = FusedMoE(E, H, INTER, params_dtype=dtype).to(DEV)
    dense.w13_weight.data = dequantize_int4_experts(q.w13).to(DEV, dtype)
    dense.w2_weight.data = dequantize_int4_experts(q.w2).to(DEV, dtype)
    layer = FusedMoE(E, H, INTER, params_dtype=dtype).to(DEV)
    layer.install_int4(q)
    assert layer.quant is q and not dict(layer.named_parameters())  # buffers, as FP8's
    assert not hasattr(layer, "w13_weight") and layer.w13_qweight.dtype == torch.int32
    assert set(dict(layer.named_buffers())) == {f"{w}_{n}" for w in ("w13", "w2")
                                                for n in ("qweight", "scales", "qzeros")}
    # half a byte a weight, plus a float16 scale and a uint8 zero a group of 32
    assert q.nbytes == 3 * E * H * INTER * (1 / 2 + 3 / 32)
    x, weights, ids = on_dev(x.to(dtype), weights.to(dtype), ids)
    want = dense(x, weights, ids).float()
    got = layer(x, weights, ids)
    assert got.dtype == dtype
    if dtype == torch.float32:
        _close(got, want)
        return
    ulp = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}[dtype]
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 8 * ulp, rel


def test_other_ranks_experts_contribute_nothing() -> None:
    """Expert parallelism: ids == E (another rank's expert) run as expert 0 with weight 0."""
    x, w13, w2, weights, ids = routed(3, seed=4)
    layer = FusedMoE(E, H, INTER).to(DEV)
    layer.install_int4(int4_experts(w13, w2, 128, sym=True))
    x, weights, ids = on_dev(x, weights, ids)
    foreign = ids.clone()
    foreign[:, 1] = E
    got = layer._experts(x, weights, foreign, True, None, True)
    mine = torch.where(foreign < E, weights, torch.zeros_like(weights))
    _close(got, experts_int4_reference(x, layer.quant, mine, foreign % E))


def test_launch_shapes_do_not_depend_on_the_routing(monkeypatch) -> None:
    """What a CUDA graph needs: the same T, k and E launch the same grids on the same buffer
    shapes whatever the routing (spread over the experts, or all on two)."""
    launches: list[tuple] = []
    kernel = int4_moe._int4_grouped_gemm_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, [tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                        for a in args], sorted(kw.items())))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(int4_moe, "_int4_grouped_gemm_kernel", Recorder())
    _, w13, w2, _, _ = routed(1, seed=5)
    q = int4_experts(w13, w2, 32, sym=False)
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        x, _, _, weights, _ = routed(3, seed=6, ids=ids)
        x, weights, ids = on_dev(x, weights, ids)
        _close(experts_triton_int4(x, q, weights, ids), experts_int4_reference(x, q, weights, ids))
    assert len(launches) == 4 and launches[:2] == launches[2:]


def test_int4_weights_refuses_what_the_kernel_cannot_take() -> None:
    codes = torch.zeros(2, 64, 8, dtype=torch.int32)  # 64 inputs
    with pytest.raises(ValueError, match="multiple of 16"):
        int4_weights(codes, torch.ones(2, 64, 8), torch.full((2, 64, 8), 8), 8, 64)
    with pytest.raises(ValueError, match=r"need \[2, 64, 2\]"):
        int4_weights(codes, torch.ones(2, 64, 3), torch.full((2, 64, 3), 8), 32, 64)
    with pytest.raises(ValueError, match="int32"):
        int4_weights(codes.long(), torch.ones(2, 64, 2), torch.full((2, 64, 2), 8), 32, 64)


# ---- loading through the fast path -----------------------------------------------------------

OFF_GROUPS = ("a rank's share of the expert inputs is not whole scale groups, or the "
              "experts' layouts differ")
ACT_ORDER = "act-order int4 experts (inputs permuted per expert) have no kernel here"
_CT_G128 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
            "group_size": 128}
# (hidden, moe_intermediate_size, format, rank of 2 tensor-parallel ranks or None,
# the kernel's name, or why the experts stay dense)
LOAD_CASES = {
    "gptq-g32-sym": (64, 64, "gptq", None, "int4 experts g32 sym (Triton W4A16)"),
    "gptq-g32-sym-tp-rank1": (64, 64, "gptq", 1, "int4 experts g32 sym (Triton W4A16)"),
    "awq-g32": (64, 64, "awq", None, "int4 experts g32 asym (Triton W4A16)"),
    "ct-w4a16-g128-asym": (256, 128, "ct", None, "int4 experts g128 asym (Triton W4A16)"),
    "gptq-tp-off-the-groups": (64, 96, "gptq", 1, OFF_GROUPS),  # 48 inputs a rank
    "gptq-act-order": (64, 64, "gptq-act-order", None, ACT_ORDER),
}


def _quantizer(fmt: str) -> tuple[dict, object]:
    from quantization import quant_checkpoints as qc

    if fmt == "awq":
        return ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                 "version": "gemm"}, lambda w: qc.awq(w, 32))
    if fmt == "ct":
        scheme = qc.ct_scheme(_CT_G128)
        return ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "quantization_status": "compressed", "config_groups": {"group_0": scheme},
                 "ignore": ["lm_head"]}, lambda w: qc.ct_quantize(w, scheme, "pack-quantized"))
    act = fmt == "gptq-act-order"
    return ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act,
             "sym": True}, lambda w: qc.gptq(w, 4, 32, act_order=act))


@CPU_ONLY
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_fast_path_loads_int4_expert_shards_packed_or_refuses(case, monkeypatch, caplog) -> None:
    """Each expert's gate / up / down stand-ins through FusedMoE's own loader: the layer's
    rows (this rank's under tensor parallelism) in INT4 dequantize to the checkpoint's
    weights; a rank's slice off the groups and act-order GPTQ are dequantized, logged."""
    from shoal.quantization.config import parse_quantization_config
    from shoal.quantization.fast_path import FastPath
    from shoal.quantization.formats import linear_format

    hidden, inter, fmt, rank, want = LOAD_CASES[case]
    if rank is not None:  # rank 1 of 2 tensor-parallel ranks
        monkeypatch.setattr(moe_layer, "get_tp_world_size", lambda: 2)
        monkeypatch.setattr(moe_layer, "get_tp_rank", lambda: rank)
    config, quantize = _quantizer(fmt)
    qconfig = parse_quantization_config(config)
    path = FastPath.plan(qconfig, torch.float32, "cpu", allow_cpu=True)
    holder = torch.nn.Module()
    holder.moe = moe = FusedMoE(2, hidden, inter)
    g = torch.Generator().manual_seed(7)
    refs = {}
    with path.loading(holder), caplog.at_level(logging.INFO, "shoal.quantization.fast_path"):
        fmt_ = linear_format(qconfig)
        for e in range(2):
            for shard, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)),
                                 ("w2", (hidden, inter))):
                q = quantize(torch.randn(*shape, generator=g))
                refs[e, shard] = q.reference
                param = moe.w2_weight if shard == "w2" else moe.w13_weight
                param.weight_loader(param, path._pack(fmt_, "m", q.stored), e, shard)
        counts = path.finish(holder)
    cols = slice(None) if rank is None else slice(rank * inter // 2, (rank + 1) * inter // 2)
    w13 = torch.stack([torch.cat([refs[e, "w1"][cols], refs[e, "w3"][cols]]) for e in range(2)])
    w2 = torch.stack([refs[e, "w2"][:, cols] for e in range(2)])
    if want.startswith("int4 experts"):
        assert isinstance(moe.quant, Int4Experts) and counts == {want: 1}
        got13, got2 = (dequantize_int4_experts(w) for w in (moe.quant.w13, moe.quant.w2))
    else:
        assert moe.quant is None and moe.w13_weight.dtype == torch.float32
        assert counts == {f"dense experts ({want})": 1}
        assert f"MoE experts of 1 layer(s) (e.g. moe) kept dense, not INT4: {want}" \
            in caplog.text
        got13, got2 = moe.w13_weight, moe.w2_weight
    torch.testing.assert_close(got13, w13, rtol=0, atol=1e-6)
    torch.testing.assert_close(got2, w2, rtol=0, atol=1e-6)


@CPU_ONLY
def test_dummy_weights_of_a_gptq_config_quantize_the_dense_experts() -> None:
    """Benchmarks (load_format="dummy" with a 4-bit GPTQ config): the random dense experts
    become INT4 experts whose weights are their group-wise rounding."""
    from shoal.quantization.config import parse_quantization_config
    from shoal.quantization.fast_path import FastPath

    qconfig = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                         "desc_act": False, "sym": False})
    holder = torch.nn.Module()
    holder.moe = moe = FusedMoE(2, 64, 64)
    torch.manual_seed(8)
    dense = [torch.randn_like(p) for p in (moe.w13_weight, moe.w2_weight)]
    moe.w13_weight.data, moe.w2_weight.data = (d.clone() for d in dense)
    path = FastPath.plan(qconfig, torch.float32, "cpu", dummy=True, allow_cpu=True)
    counts = path.finish(holder)
    q = moe.quant
    assert isinstance(q, Int4Experts) and counts == {"int4 experts g32 asym (Triton W4A16)": 1}
    for w, want in ((q.w13, dense[0]), (q.w2, dense[1])):
        rounded = torch.stack([dequantize_packed(quantize_int4(e, 32, False)) for e in want])
        assert torch.equal(dequantize_int4_experts(w), rounded)


# ---- a checkpoint through the engine ---------------------------------------------------------

QWEN3_MOE = dict(num_hidden_layers=2, num_experts=E, num_experts_per_tok=TOP_K,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)


def _greedy(llm) -> list:
    from shoal import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 12))] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@CPU_ONLY
def test_gptq_qwen3_moe_keeps_experts_packed_and_matches_its_twin(
        tmp_path, monkeypatch, caplog) -> None:
    """The same dequantized weights on both sides, float32: the same greedy tokens and
    logprobs to 1e-4 (only the summation order differs)."""
    from oracle import write_tiny_checkpoint
    from quantization.quant_checkpoints import gptq, quantize_folder

    from shoal import LLM
    from shoal.quantization.fast_path import FastPath

    src = write_tiny_checkpoint(tmp_path / "src", "qwen3_moe", seed=5, **QWEN3_MOE)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
              "sym": True}
    quant, dense = quantize_folder(src, tmp_path, lambda w: gptq(w, 4, 32), config,
                                   select=lambda m: ".mlp.experts." in m)
    plan = FastPath.plan.__func__
    monkeypatch.setattr(FastPath, "plan", classmethod(
        lambda cls, q, dtype, device, dummy=False, allow_cpu=False:
        plan(cls, q, dtype, device, dummy, True)))
    kwargs = dict(dtype="float32", block_size=16, num_gpu_blocks_override=32, max_model_len=64)
    with caplog.at_level(logging.INFO, logger="shoal.quantization.fast_path"):
        llm = LLM(model=str(quant), **kwargs)
    assert "int4 experts g32 sym (Triton W4A16) x1" in caplog.text
    moes = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 1 and isinstance(moes[0].quant, Int4Experts)
    assert moes[0].w13_qweight.shape == (E, 64 // 8, 2 * 32)
    got = _greedy(llm)
    monkeypatch.undo()
    want = _greedy(LLM(model=str(dense), **kwargs))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for pos, token in enumerate(w.token_ids):
            assert abs(g.logprobs[pos][token].logprob - w.logprobs[pos][token].logprob) < 1e-4
