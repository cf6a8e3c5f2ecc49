"""Shared experts inside the bf16 decode experts' launches (shoal/layers/moe/shared_experts.py,
half_decode_experts.py) on the CPU through Triton's interpreter (conftest.py): the fused
kernels against experts_torch plus a torch SwiGLU MLP and against the unfused decode path
(one and two chunks of the routed I, biased routed experts, split and unsplit down); the
launches (the shared chunks' programs on the same two kernels, grids that do not depend on
the routing); experts_triton's grouped path adding shared.run; FusedMoE falling back where
the kernels cannot read the weights; a DeepseekMoE block reading in-place weight updates;
and a tiny random DeepSeek-V2 model (two shared experts) whose greedy tokens through the
fused kernels equal the unfused layer's and transformers'. The GPU test times a DeepseekMoE
block at DeepSeek-V2-Lite's shapes fused and unfused and counts its kernels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

from launch_recorder import record_launches  # noqa: E402

import shoal.layers.moe.half_decode_experts as decode  # noqa: E402
import shoal.layers.moe.triton_experts as grouped_moe  # noqa: E402
from shoal.layers.moe.half_decode_experts import HalfDecodeTiles, experts_half_decode  # noqa: E402
from shoal.layers.moe.shared_experts import SharedExperts, shared_experts_of  # noqa: E402
from shoal.layers.moe.torch_experts import experts_torch  # noqa: E402
from shoal.layers.moe.triton_experts import experts_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
E, H, INTER = 4, 80, 48  # (test_half_decode_experts.py's: part-filled K steps and row tiles)
TILES = (HalfDecodeTiles(32, 32, 32, 2, num_warps=1), HalfDecodeTiles(32, 32, 32, 1, num_warps=1))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def weights(seed: int, chunks: int, dtype: torch.dtype, bias: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    s = chunks * INTER
    out = dict(w13=torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5,
               w2=torch.randn(E, H, INTER, generator=g) / INTER ** 0.5,
               gate_up=torch.randn(2 * s, H, generator=g) / H ** 0.5,
               down=torch.randn(H, s, generator=g) / s ** 0.5,
               w13_bias=torch.randn(E, 2 * INTER, generator=g) * 0.3 if bias else None,
               w2_bias=torch.randn(E, H, generator=g) * 0.3 if bias else None)
    return {k: None if v is None else v.to(DEV, dtype) for k, v in out.items()}


def routed(t: int, k: int, seed: int, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    return x.to(DEV, dtype), (torch.rand(t, k, generator=g) + 0.1).to(DEV, dtype), ids.to(DEV)


class CountedMLP:
    """The shared MLP in torch (gate rows then up rows, SiLU-and-mul, down), counting calls:
    the unfused path's launches."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down, self.calls = gate_up, down, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)

    def shared(self) -> SharedExperts:
        return SharedExperts(self, self.gate_up, self.down)


CASES = {  # tokens, slots, shared chunks, routed biases
    "t1-k1-c1": (1, 1, 1, False),
    "t2-k2-c2-bias": (2, 2, 2, True),
    "t3-k3-c1-bias": (3, 3, 1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_torch_and_the_unfused_decode_path(case: str) -> None:
    """float32, each tile (down split in two, unsplit): experts_torch + the torch MLP and the
    decode path without shared + the MLP, to 1e-5 of the largest output (summation order
    only); the shared MLP's own forward never runs."""
    t, k, chunks, bias = CASES[case]
    w = weights(len(case), chunks, torch.float32, bias)
    x, topk_w, ids = routed(t, k, seed=t + 7 * k, dtype=torch.float32)
    mlp = CountedMLP(w["gate_up"], w["down"])
    extra = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"])
    want = experts_torch(x, w["w13"], w["w2"], topk_w, ids, **extra) + mlp(x)
    unfused = experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode", **extra) + mlp(x)
    mlp.calls = 0
    for tiles in TILES:
        got = experts_half_decode(x, w["w13"], w["w2"], topk_w, ids, tiles, shared=mlp.shared(),
                                  **extra)
        for ref in (want, unfused):
            err = (got - ref).abs().max().item()
            assert err <= 1e-5 * ref.abs().max().item(), (tiles.name, err)
    assert mlp.calls == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_against_the_unfused_path(dtype: torch.dtype) -> None:
    """fp16 / bf16: the fused output rounds once where the unfused rounds the routed sum and
    the shared MLP's output before adding them: within a few units in the last place of the
    unfused (interpreter bf16 casts truncate: twice the allowance)."""
    w = weights(3, 2, dtype)
    x, topk_w, ids = routed(2, 2, seed=5, dtype=dtype)
    mlp = CountedMLP(w["gate_up"], w["down"])
    got = experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode", shared=mlp.shared())
    assert mlp.calls == 0
    unfused = experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode") + mlp(x)
    ulp = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    assert rel(got, unfused) < 8 * ulp * (2 if INTERPRET and dtype == torch.bfloat16 else 1)


def _decode_first(monkeypatch) -> None:
    """experts_triton's default runs a decode tile (untimed on the CPU it does anyway; on a
    GPU the tuner would pick by time)."""
    monkeypatch.setattr(grouped_moe, "run_fastest", lambda key, names, run, device, agree:
                        run(next(n for n in names if n != "grouped")))


def _recording(monkeypatch, launches: list) -> None:
    record_launches(monkeypatch, launches, [
        (decode, "_gate_up_kernel"), (decode, "_down_kernel"), (decode, "sum_splits_kernel"),
        (grouped_moe, "_grouped_gemm_kernel")])


def test_launches_the_decode_kernels_only_with_shared_programs(monkeypatch) -> None:
    """fp16 at T = 3, k = 2, two chunks: experts_triton's default (untimed on the CPU: the
    decode path; on a GPU forced past the tuner) runs the decode kernels alone, gate_up over T * (k + 2) pairs and an act
    buffer of as many rows, whatever the routing; the shared MLP is not called. The grouped
    path (path="grouped", or more than MAX_TOKENS rows) adds shared.run once."""
    launches: list = []
    _recording(monkeypatch, launches)
    _decode_first(monkeypatch)
    w = weights(4, 2, torch.float16)
    mlp = CountedMLP(w["gate_up"], w["down"])
    x, topk_w, _ = routed(3, 2, seed=6, dtype=torch.float16)
    per_routing = []
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), shared=mlp.shared())
        per_routing.append(list(launches))
        launches.clear()
    assert per_routing[0] == per_routing[1]
    names = [n for n, *_ in per_routing[0]]
    tiles = decode.decode_tiles(3, 2 + 2, H, INTER, DEV)[0]
    split = decode.k_per_split(INTER, tiles.block_k, tiles.split)[1]
    assert names == ["_gate_up_kernel", "_down_kernel"] + ["sum_splits_kernel"] * (split > 1)
    gate_up, down = per_routing[0][0], per_routing[0][1]
    assert gate_up[1][0] == 3 * (2 + 2) and gate_up[2][6] == (3 * (2 + 2), INTER)  # act
    assert down[1][0] == 3 and down[2][0] == (3 * (2 + 2), INTER)
    assert mlp.calls == 0
    out = experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), path="grouped",
                         shared=mlp.shared())
    assert [n for n, *_ in launches] == ["_grouped_gemm_kernel"] * 2 and mlp.calls == 1
    mlp.calls = 0
    fused = experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), path="decode",
                           shared=mlp.shared())
    assert rel(fused, out) < 8 * 2.0 ** -11


def test_shared_that_does_not_fit_is_refused_or_run_apart() -> None:
    """experts_triton's decode path refuses shared weights the kernels cannot read (S not a
    multiple of I, another dtype, no dense weights), naming them; SharedExperts.chunks says
    0 for them, which FusedMoE reads to add shared.run instead."""
    w = weights(8, 1, torch.float32)
    x, topk_w, ids = routed(1, 2, seed=9, dtype=torch.float32)
    odd = SharedExperts(lambda v: v, w["gate_up"][:2 * (INTER - 8)], w["down"][:, :INTER - 8]
                        .contiguous())
    for bad in (odd, SharedExperts(lambda v: v), SharedExperts(
            lambda v: v, w["gate_up"].half(), w["down"].half())):
        assert bad.chunks(x, INTER) == 0
        with pytest.raises(ValueError, match="shared experts: need dense gate_up"):
            experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode", shared=bad)
    assert SharedExperts(lambda v: v, w["gate_up"], w["down"]).chunks(x, INTER) == 1


# ---- a DeepseekMoE block and a tiny DeepSeek-V2 model -----------------------------------------

def _on_triton(monkeypatch) -> None:
    """FusedMoE's Triton branch for any tensor (on the CPU: the interpreter) and float32
    decode rows the decode path, as bf16 rows on a GPU do. The tests' tensors must then be
    on DEV: a GPU host runs no interpreter, and compiled Triton cannot read CPU tensors."""
    import shoal.layers.moe.layer as moe_layer

    monkeypatch.setattr(moe_layer, "use_triton", lambda x, enabled: enabled)
    monkeypatch.setattr(grouped_moe, "HALF_DTYPES", (*grouped_moe.HALF_DTYPES, torch.float32))
    _decode_first(monkeypatch)


def _gate_up_rows(launches: list, slots: int) -> list[int]:
    """The x rows (T) of each recorded _gate_up_kernel launch, after checking its grid: T *
    slots programs (slots: k plus the shared chunks, one a chunk), whatever the step."""
    out = []
    for name, grid, args in launches:
        if name == "_gate_up_kernel":
            t = args[0][0]  # x [T, H]
            assert grid[0] == t * slots, (f"gate_up at {t} rows ran {grid[0]} programs a block "
                                          f"of outputs, not {t} x {slots} slots")
            out.append(t)
    return out


def _tiny_v2_config(**kw):
    from deepseek_tiny import V2
    from transformers import AutoConfig

    return AutoConfig.for_model("deepseek_v2", **dict(V2, n_shared_experts=2, **kw))


def test_block_reads_in_place_weight_updates_and_falls_back(monkeypatch) -> None:
    """A DeepseekMoE block at 2 decode rows: fused (shared MLP not called) equals the
    unfused layer; after the shared weights are rewritten in place through their weight
    loaders (what update_weights does) the fused output follows them (nothing was copied);
    with a LoRA hook on the shared down projection the block runs the MLP apart."""
    from shoal.models.deepseek_v2 import DeepseekMoE

    _on_triton(monkeypatch)
    with torch.device(DEV):
        block = DeepseekMoE(_tiny_v2_config(), torch.float32)
    g = torch.Generator().manual_seed(11)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    calls = []
    block.shared_experts.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, block.experts.hidden_size, generator=g).to(DEV)

    def unfused() -> torch.Tensor:
        weights, ids = block.gate(x)
        return block.experts(x, weights, ids) + block.shared_experts(x)

    for when in ("before", "after"):  # an update of the shared weights
        got = block(x)
        assert not calls, f"{when} the update: the fused block called the shared MLP"
        want = unfused()
        calls.clear()
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), (
            f"{when} the update: fused block off the unfused by {err:.3g} (largest output "
            f"{want.abs().max().item():.3g}){' : stale shared weights?' * (when == 'after')}")
        mlp = block.shared_experts
        for proj in (mlp.gate_up_proj, mlp.down_proj):
            before = proj.weight.data_ptr()
            new = (torch.randn(proj.weight.shape, generator=g) * 0.3).to(DEV)
            if proj is mlp.gate_up_proj:  # the checkpoint's gate_proj / up_proj halves
                for shard, half in enumerate(new.chunk(2)):
                    proj.weight.weight_loader(proj.weight, half, shard)
            else:
                proj.weight.weight_loader(proj.weight, new)
            assert proj.weight.data_ptr() == before and torch.equal(proj.weight, new), (
                "the weight loader did not write the shared weight in place")

    class NoDelta:  # a LoRA hook whose adapters add nothing
        def apply(self, x, y) -> None:
            pass

    block.shared_experts.down_proj.lora = NoDelta()
    assert shared_experts_of(block.shared_experts).gate_up is None, (
        "a LoRA-hooked shared MLP must give the kernels no dense weights")
    got = block(x)
    assert len(calls) == 1, f"with a LoRA hook the shared MLP ran {len(calls)} times, not once"
    err = (got - unfused()).abs().max().item()
    assert err <= 1e-5 * got.abs().max().item(), f"LoRA fallback off the unfused by {err:.3g}"


def test_tiny_deepseek_v2_tokens_fused_equal_unfused_and_transformers(monkeypatch, tmp_path
                                                                      ) -> None:
    """Greedy float32 through the engine, every MoE layer on the Triton kernels: the fused
    decode steps (no shared MLP call at a decode row; gate_up programs for the two shared
    chunks) give transformers' tokens and the unfused layer's tokens and logprobs. Every
    gate_up launch has T x (k + chunks) programs; on a GPU that includes the start-up passes
    (the profile run and the warmup: dummy steps of 1..8 rows), so the requests' own
    launches, decode steps of one row, are those after the engine is built."""
    from deepseek_tiny import V2, check_against_hf, write_deepseek

    import shoal.models.deepseek_v2 as ds
    from shoal import LLM, SamplingParams

    _on_triton(monkeypatch)
    path, hf = write_deepseek(tmp_path, "deepseek_v2", seed=3, **dict(V2, n_shared_experts=2))
    prompts = [[5, 77, 300, 12, 9, 61, 4, 250, 33, 18, 7]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    launches: list = []
    _recording(monkeypatch, launches)

    def generate() -> tuple:
        llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks_override=32,
                  max_model_len=64, enforce_eager=True)
        started = len(launches)  # (a GPU's start-up passes launched the kernels too)
        shared_rows: list[int] = []
        for m in llm.llm_engine.core.runner.model.modules():
            if isinstance(m, ds.DeepseekMoE):
                m.shared_experts.register_forward_hook(
                    lambda m, args, out: shared_rows.append(args[0].shape[0]))
        outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
                for p in prompts]
        return outs, shared_rows, launches[started:]

    fused, rows, steps = generate()
    assert rows and all(r > decode.MAX_TOKENS for r in rows), (
        f"the shared MLP ran apart at {rows} rows: only the prompts' (grouped, > "
        f"{decode.MAX_TOKENS}) should")
    _gate_up_rows(launches, 2 + 2)  # k = 2, 2 chunks (start-up passes included)
    step_rows = _gate_up_rows(steps, 2 + 2)
    assert step_rows and set(step_rows) == {1}, (
        f"the requests' gate_up launches had {step_rows} rows: one a decode step expected")
    check_against_hf(fused, prompts, hf, 5)
    monkeypatch.setattr(ds, "shared_experts_of", lambda mlp: SharedExperts(mlp))
    launches.clear()
    unfused, rows, steps = generate()
    _gate_up_rows(launches, 2)  # the routed slots only
    assert _gate_up_rows(steps, 2), "the unfused decode steps never ran the decode kernels"
    for a, b in zip(fused, unfused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (
            f"fused tokens {a.outputs[0].token_ids} != unfused {b.outputs[0].token_ids}")
        for i, (got, want) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
            tok = next(iter(want))
            assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-5), (
                f"step {i}: fused logprob {got[tok].logprob} vs unfused {want[tok].logprob}")


# ---- the GPU: a DeepSeek-V2-Lite MoE block, fused and unfused ---------------------------------

V2_LITE_MOE = dict(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                   num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy", n_group=1,
                   topk_group=1, routed_scaling_factor=1.0)


def _device_ops(fn) -> list[str]:
    """The names of the CUDA kernels (and copies) one call of fn runs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_v2_lite_block_fused_against_unfused(monkeypatch) -> None:
    """DeepseekMoE at DeepSeek-V2-Lite's shapes (64 experts of I = 1408, k = 6, 2 shared
    experts, H = 2048), bf16, T = 1 and 4, the tuner's picks: the fused block against the
    unfused one (4 units in the last place, relative norm) and a float32 reference (8); each
    block's device ops in one eager call (torch.profiler: at T = 1 the fused one at least 4
    fewer, the shared MLP's gate_up, activation, down and add) and its time in a CUDA graph
    of 20 calls, printed (run with -s)."""
    from gpu_timing import graph_of_calls, time_ms
    from transformers import AutoConfig

    import shoal.models.deepseek_v2 as ds
    from shoal.layers.quantization import launch_tuner

    cfg = AutoConfig.for_model("deepseek_v2", **V2_LITE_MOE)
    with torch.device(DEV):
        block = ds.DeepseekMoE(cfg, torch.bfloat16)
    g = torch.Generator(DEV).manual_seed(21)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=DEV) / p.shape[-1] ** 0.5)
    mlp = block.shared_experts
    fused_of = ds.shared_experts_of
    ulp = 2.0 ** -8
    for t in (1, 4):
        x = torch.randn(t, 2048, generator=g, device=DEV, dtype=torch.bfloat16)
        fused = block(x)
        monkeypatch.setattr(ds, "shared_experts_of", lambda m: SharedExperts(m))
        unfused = block(x)
        unfused_ops = _device_ops(lambda x=x: block(x))
        unfused_ms = time_ms(graph_of_calls(lambda x=x: block(x))[0]) / 20
        monkeypatch.setattr(ds, "shared_experts_of", fused_of)
        fused_ops = _device_ops(lambda x=x: block(x))
        fused_ms = time_ms(graph_of_calls(lambda x=x: block(x))[0]) / 20
        weights, ids = block.gate(x)
        e = block.experts
        ref = experts_torch(x.float(), e.w13_weight.float(), e.w2_weight.float(),
                            weights.float(), ids) + F.linear(
            F.silu(F.linear(x.float(), mlp.gate_up_proj.weight.float()).chunk(2, -1)[0])
            * F.linear(x.float(), mlp.gate_up_proj.weight.float()).chunk(2, -1)[1],
            mlp.down_proj.weight.float())
        assert rel(fused, unfused) < 4 * ulp and rel(fused, ref) < 8 * ulp
        picks = {k[5:7] + (k[-2],): v.choice for k, v in launch_tuner.TUNED.items()
                 if k[0] == "half experts" and k[5] == t}
        print(f"\nV2-Lite MoE block T={t}: unfused {unfused_ms * 1e3:.1f} us, "
              f"{len(unfused_ops)} device ops; fused {fused_ms * 1e3:.1f} us, "
              f"{len(fused_ops)} device ops; tuner picks (T, dtype, shared chunks): {picks}")
        print("  unfused ops:", unfused_ops)
        print("  fused ops:  ", fused_ops)
        if t == 1:  # (the decode tiles win at batch 1 on an H100: session 13's profile)
            assert len(fused_ops) <= len(unfused_ops) - 4
