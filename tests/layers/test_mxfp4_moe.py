"""MXFP4 experts kept packed (shoal/layers/moe/triton_experts_mxfp4.py, mxfp4_experts.py) on the
CPU through Triton's interpreter (conftest.py), on tiny shapes: the grouped GEMMs against the
dequantized weights (with gpt-oss's biases and clamped SwiGLU); a FusedMoE holding packed
MXFP4 experts against the dense layer of the dequantized weights; launch shapes that do not
depend on the routing (CUDA graphs); gpt-oss's loading of MXFP4 projections packed (a
tensor-parallel rank's rows, the refusal of a rank's share off the 32-value blocks); and a
tiny random gpt-oss MXFP4 checkpoint through the engine with packing let onto the CPU: experts
kept packed, the greedy tokens of transformers on the dequantized weights. bfloat16 runs on a
GPU only: the interpreter's tl.dot gets bfloat16 wrong (float16 is the half-precision case
here)."""

from __future__ import annotations

import functools
import json
import logging
import os
import random

import pytest
import torch

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

from mxfp4_cases import CLAMPED, ExpertsShape  # noqa: E402

import shoal.layers.moe.layer as moe_layer  # noqa: E402
import shoal.layers.moe.triton_experts_mxfp4 as mxfp4_moe  # noqa: E402
import shoal.models.gpt_oss as gpt_oss  # noqa: E402
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.moe.mxfp4_experts import (  # noqa: E402
    Mxfp4Experts,
    dequantize_mxfp4_experts,
    mxfp4_weights,
    packed_experts_problem,
)
from shoal.layers.moe.triton_experts_mxfp4 import (  # noqa: E402
    experts_mxfp4_reference,
    experts_triton_mxfp4,
)
from shoal.layers.quantization.mxfp4 import dequantize_mxfp4  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if DEV.type == "cuda" and torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("the MXFP4 kernel needs compute capability 8.0", allow_module_level=True)
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter's tl.dot gets bfloat16 wrong (triton-lang/triton#11584)"))
# H = 128 inputs: two K steps of 64; I = 96: gate_up's 192 outputs end in a partial tile and
# down's 96 inputs in a half K step.
E, TOP_K, H, INTER = 4, 2, 128, 96


def random_mxfp4(e: int, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Checkpoint-layout blocks [e, n, k / 32, 16] (every e2m1 code) and scales [e, n, k / 32]
    of 2^-6 .. 2^-3 (weights up to 0.75; ~0.15 typical)."""
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(121, 125, (e, n, k // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


SHAPE = ExpertsShape(E, TOP_K, H, INTER, DEV)  # (tests/mxfp4_cases.py)
biases = SHAPE.biases


def packed_experts(seed: int) -> Mxfp4Experts:
    q = SHAPE.packed_experts(seed)  # (scales 2^-6 .. 2^-3: weights up to 0.75)
    assert q.w13.blocks.shape == (E, 2 * INTER, H // 2) and q.w2.scales.shape == (E, H, INTER // 32)
    return q


def routed(t: int, seed: int, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x [t, H] and a softmax top-k routing (or `ids` with random weights), on the CPU."""
    return SHAPE.routed(t, seed, ids=ids, device=torch.device("cpu"))


def on_dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in tensors]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), (err, want.abs().max().item())


# ---- the kernel against the dequantized weights ----------------------------------------------

KERNEL_CASES = {  # dtype, biases and gpt-oss's clamped SwiGLU
    "fp32": (torch.float32, False),
    "fp32-gpt-oss": (torch.float32, True),
    "fp16-gpt-oss": (torch.float16, True),
    "bf16-gpt-oss": (torch.bfloat16, True),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_mxfp4_grouped_gemm_matches_the_dequantized_weights(case: str) -> None:
    """float32: the PyTorch product of the dequantized weights (mxfp4.py's reader, checked
    against transformers' in tests/models/test_gpt_oss.py), to 1e-5 of the largest output
    (only the summation order differs). Half precision: the twin rounds the weights and the
    intermediate rows to x's dtype as the kernel does; a sum rounding the other way moves an
    output by one unit in the last place (2^-11 fp16, 2^-8 bf16)."""
    dtype, gpt_oss_mlp = KERNEL_CASES[case]
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("the interpreter's tl.dot gets bfloat16 wrong (triton-lang/triton#11584)")
    q = packed_experts(seed=1)
    x, weights, ids = routed(5, seed=2)
    extra = dict(biases(3, dtype), activation=CLAMPED) if gpt_oss_mlp else {}
    x, weights, ids = on_dev(x.to(dtype), weights.to(dtype), ids)
    got = experts_triton_mxfp4(x, q, weights, ids, **extra, path="grouped")
    assert got.dtype == dtype
    want = experts_mxfp4_reference(x, q, weights, ids, **extra)
    tol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    _close(got, want, tol)
    if dtype == torch.float32:  # the twin itself: the dense PyTorch experts of those weights
        from shoal.layers.moe.torch_experts import experts_torch

        dense = [dequantize_mxfp4_experts(w) for w in (q.w13, q.w2)]
        _close(got, experts_torch(x, *dense, weights, ids, **extra))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_fused_moe_with_mxfp4_experts_is_the_dense_layer(dtype) -> None:
    """gpt-oss's expert layer (biases, clamped SwiGLU) holding packed experts against the same
    layer holding their dequantized weights in the same dtype: float32 agrees to the summation
    order; in half precision both round the weights the same way (exactly: e2m1 times a power
    of two) and differ in where they round the rows (see test_int4_moe.py's twin of this
    test): eight units in the last place bound the norm of the difference."""
    q = packed_experts(seed=4)
    kw = dict(params_dtype=dtype, has_bias=True, activation=CLAMPED)
    dense = FusedMoE(E, H, INTER, **kw).to(DEV)
    dense.w13_weight.data = dequantize_mxfp4_experts(q.w13, dtype).to(DEV)
    dense.w2_weight.data = dequantize_mxfp4_experts(q.w2, dtype).to(DEV)
    layer = FusedMoE(E, H, INTER, **kw).to(DEV)
    for name, t in biases(5, dtype).items():
        getattr(dense, name).data = t
        getattr(layer, name).data = t.clone()
    layer.install_mxfp4(q)
    assert layer.quant is q and set(dict(layer.named_parameters())) == {"w13_bias", "w2_bias"}
    assert not hasattr(layer, "w13_weight") and layer.w13_blocks.dtype == torch.uint8
    assert set(dict(layer.named_buffers())) == {f"{w}_{n}" for w in ("w13", "w2")
                                                for n in ("blocks", "scales")}
    # half a byte a weight, plus a one-byte scale a block of 32
    assert q.nbytes == 3 * E * H * INTER * (1 / 2 + 1 / 32)
    x, weights, ids = routed(6, seed=6)
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
    with pytest.raises(ValueError, match="do not fit"):
        FusedMoE(E, H, 2 * INTER).to(DEV).install_mxfp4(packed_experts(seed=4))


def test_other_ranks_experts_contribute_nothing() -> None:
    """Expert parallelism: ids == E (another rank's expert) run as expert 0 with weight 0."""
    layer = FusedMoE(E, H, INTER).to(DEV)
    layer.install_mxfp4(packed_experts(seed=7))
    x, weights, ids = on_dev(*routed(3, seed=8))
    foreign = ids.clone()
    foreign[:, 1] = E
    got = layer._experts(x, weights, foreign, True, None, True)
    mine = torch.where(foreign < E, weights, torch.zeros_like(weights))
    _close(got, experts_mxfp4_reference(x, layer.quant, mine, foreign % E))


def test_launch_shapes_do_not_depend_on_the_routing(monkeypatch) -> None:
    """What a CUDA graph needs: the same T, k and E launch the same grids on the same buffer
    shapes whatever the routing (spread over the experts, or all on two)."""
    launches: list[tuple] = []
    kernel = mxfp4_moe._mxfp4_grouped_gemm_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, [tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                        for a in args], sorted(kw.items())))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(mxfp4_moe, "_mxfp4_grouped_gemm_kernel", Recorder())
    q = packed_experts(seed=9)
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        x, weights, ids = on_dev(*routed(3, seed=10, ids=ids))
        _close(experts_triton_mxfp4(x, q, weights, ids, path="grouped"),
               experts_mxfp4_reference(x, q, weights, ids))
    assert len(launches) == 4 and launches[:2] == launches[2:]


def test_mxfp4_weights_refuses_what_the_kernel_cannot_take() -> None:
    g = torch.Generator().manual_seed(11)
    blocks, scales = random_mxfp4(2, 8, 64, g)
    with pytest.raises(ValueError, match=r"need \[E, N, G, 16\]"):
        mxfp4_weights(blocks, scales[..., :1])
    scales[1, 3, 0] = 255
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_weights(blocks, scales)
    with pytest.raises(ValueError, match="bytes"):
        mxfp4_weights(blocks.float() + 0.5, scales)


# ---- gpt-oss's loading -----------------------------------------------------------------------

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=6, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            swiglu_limit=1.5,  # a limit the random activations reach, so the clamps matter
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64})


def _config(**over):
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt_oss", **{**TINY, **over},
                                architectures=["GptOssForCausalLM"])


def _expert_tensors(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Layer 0's experts as released: gate_up [E, 2I (gate, up interleaved), H] and down
    [E, H, I] in MXFP4, float32 as the loader streams them, and their biases."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    p = "model.layers.0.mlp.experts."
    out = {}
    for proj, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
        blocks, scales = random_mxfp4(e, n, k, g)
        out[f"{p}{proj}_blocks"], out[f"{p}{proj}_scales"] = blocks.float(), scales.float()
        out[f"{p}{proj}_bias"] = torch.randn(e, n, generator=g)
    return out


@pytest.mark.parametrize("inter", [64, 32])
def test_gpt_oss_loads_a_ranks_mxfp4_rows_packed_or_refuses(inter, monkeypatch, caplog) -> None:
    """Rank 1 of two tensor-parallel ranks: its gate rows (the even rows of the stored
    gate_up), then its up rows (the odd ones), and its 32 down inputs stay packed and
    dequantize to what the dense load puts in the layer; with 16 down inputs a rank (off the
    blocks) the experts load dense, and one log line says why."""
    monkeypatch.setattr(moe_layer, "get_tp_world_size", lambda: 2)
    monkeypatch.setattr(moe_layer, "get_tp_rank", lambda: 1)
    cfg = _config(intermediate_size=inter, num_hidden_layers=1)
    tensors = _expert_tensors(cfg, seed=12)
    dense = gpt_oss.GptOssForCausalLM(cfg, torch.float32)
    dense.load_weights(iter(tensors.items()))  # on the CPU: unpacked at load, as before
    want = dense.model.layers[0].mlp.experts
    assert want.quant is None and want.w13_weight.shape == (4, inter, 64)
    monkeypatch.setattr(gpt_oss, "packed_experts_problem",
                        functools.partial(packed_experts_problem, allow_cpu=True))
    with DEV:  # the packed path's device: CUDA, or the CPU under the interpreter
        model = gpt_oss.GptOssForCausalLM(cfg, torch.float32)
    with caplog.at_level(logging.INFO, "shoal.models.gpt_oss"):
        loaded = model.load_weights(iter(tensors.items()))
    moe = model.model.layers[0].mlp.experts
    assert {n for n, _ in model.named_parameters() if ".experts." in n} <= loaded
    torch.testing.assert_close(moe.w13_bias.cpu(), want.w13_bias, rtol=0, atol=0)
    if inter == 32:
        assert moe.quant is None and "kept dense, not MXFP4: a rank's share of the expert " \
            "inputs (16 of 32) is not whole blocks of 32" in caplog.text
        assert torch.equal(moe.w13_weight.cpu(), want.w13_weight)
        assert torch.equal(moe.w2_weight.cpu(), want.w2_weight)
        return
    assert isinstance(moe.quant, Mxfp4Experts) and "mxfp4 experts" in caplog.text
    assert moe.w13_blocks.shape == (4, inter, 32) and moe.w2_scales.shape == (4, 64, 1)
    assert torch.equal(dequantize_mxfp4_experts(moe.quant.w13).cpu(), want.w13_weight)
    assert torch.equal(dequantize_mxfp4_experts(moe.quant.w2).cpu(), want.w2_weight)


# ---- a checkpoint through the engine ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mxfp4(tmp_path_factory):
    """(MXFP4 checkpoint folder, transformers' model of its dequantized weights): random
    bytes for the experts' blocks, scales of 2^-6 .. 2^-3."""
    from gpt_oss_oracle import follow_config_swiglu
    from oracle import randomize_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    torch.manual_seed(13)
    hf = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).eval()
    follow_config_swiglu(hf, hf.config)
    randomize_weights(hf)
    g = torch.Generator().manual_seed(14)
    packed = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("_proj_bias", "router.bias", "sinks")):
                p.normal_(0, 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, k, n = p.shape  # transformers' [E, in, out]; stored [E, out, in]
                blocks, scales = random_mxfp4(e, n, k, g)
                p.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
                packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    state = {n: t.contiguous() for n, t in hf.state_dict().items()
             if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, str(folder / "model.safetensors"))
    config = {**hf.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, hf


ENGINE_DTYPES = [torch.float32, BF16]


@pytest.mark.parametrize("dtype", ENGINE_DTYPES)
def test_gpt_oss_mxfp4_checkpoint_keeps_experts_packed(tiny_mxfp4, dtype, monkeypatch,
                                                       caplog) -> None:
    """Both layers' experts stay packed; greedy decoding gives the tokens of transformers on
    the dequantized weights: in float32 all of them, each chosen token's logprob to 1e-4
    (only the summation order differs); in bfloat16 (a GPU) up to a near tie of the float32
    oracle's (tests/reduced_precision.py)."""
    from oracle import hf_greedy
    from reduced_precision import assert_greedy_matches_up_to_a_near_tie

    from shoal import LLM, SamplingParams

    folder, hf = tiny_mxfp4
    monkeypatch.setattr(gpt_oss, "packed_experts_problem",
                        functools.partial(packed_experts_problem, allow_cpu=True))
    with caplog.at_level(logging.INFO, logger="shoal.models.gpt_oss"):
        llm = LLM(model=str(folder), dtype=str(dtype).removeprefix("torch."), block_size=4,
                  num_gpu_blocks_override=64, max_model_len=64, max_num_batched_tokens=16)
    assert "mxfp4 experts (Triton, e2m1 decoded in registers) x2" in caplog.text
    moes = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all(isinstance(m.quant, Mxfp4Experts) for m in moes)
    assert moes[0].w13_blocks.shape == (4, 64, 32) and moes[0].w2_blocks.shape == (4, 64, 16)
    rng = random.Random(15)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 20))] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, 6)
        got = o.outputs[0]
        if dtype != torch.float32:
            assert_greedy_matches_up_to_a_near_tie(got.token_ids, ref, ref_logits)
            continue
        assert got.token_ids == ref
        for step, (tok, lg) in enumerate(zip(ref, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)
