"""Qwen3-Next's / Qwen3.5-MoE's gated shared expert (the MLP's output times sigmoid(x . g) a
token) inside the bf16 decode experts' two launches (half_decode_experts.py, shared_experts.py)
on the CPU through Triton's interpreter (conftest.py): the fused kernels against experts_torch
plus the torch gated MLP and against the unfused decode path (one and two chunks, biased
routed experts, split and unsplit down, fp32 and fp16 / bf16); the launches (T gate programs
on gate_up, no separate MLP or gate call, grids that follow the shapes only); gates the
kernels cannot read falling back; a SharedExpertMoE block; and tiny random Qwen3-Next and
Qwen3.5-MoE models whose greedy tokens through the fused kernels equal the unfused layer's
and transformers'. The GPU test times Qwen3-Next-80B's MoE block fused and unfused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

from test_shared_decode_experts import (  # noqa: E402
    DEV,
    INTER,
    INTERPRET,
    TILES,
    H,
    _decode_first,
    _gate_up_rows,
    _on_triton,
    _recording,
    rel,
    routed,
    weights,
)

import shoal.layers.moe.half_decode_experts as decode  # noqa: E402
from shoal.layers.moe.half_decode_experts import experts_half_decode  # noqa: E402
from shoal.layers.moe.shared_experts import SharedExperts, gated_shared_expert_of  # noqa: E402
from shoal.layers.moe.torch_experts import experts_torch  # noqa: E402
from shoal.layers.moe.triton_experts import experts_triton  # noqa: E402


class GatedMLP:
    """The gated shared expert in torch: sigmoid(x . gate) * down(silu(gate rows) * up rows),
    counting calls (the unfused path's launches)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor) -> None:
        self.gate_up, self.down, self.gate, self.calls = gate_up, down, gate, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        g, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return torch.sigmoid(F.linear(x, self.gate)) * F.linear(F.silu(g) * up, self.down)

    def shared(self) -> SharedExperts:
        return SharedExperts(self, self.gate_up, self.down, self.gate)


def gated(seed: int, chunks: int, dtype: torch.dtype, bias: bool = False
          ) -> tuple[dict, GatedMLP]:
    w = weights(seed, chunks, dtype, bias)
    g = torch.Generator().manual_seed(seed + 100)
    # logits of a few units: sigmoids well inside (0, 1), both sides of 1/2
    gate = (torch.randn(1, H, generator=g) * 2 / H ** 0.5).to(DEV, dtype)
    return w, GatedMLP(w["gate_up"], w["down"], gate)


def unfused_of(mlp, gate) -> SharedExperts:
    """gated_shared_expert_of without dense weights: FusedMoE runs the MLP and gate apart."""
    return SharedExperts(lambda x: torch.sigmoid(gate(x)) * mlp(x))


CASES = {  # tokens, slots, shared chunks, routed biases
    "t1-k1-c1": (1, 1, 1, False),
    "t2-k2-c2-bias": (2, 2, 2, True),
    "t4-k3-c1": (4, 3, 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gated_fused_matches_torch_and_the_unfused_decode_path(case: str) -> None:
    """float32, each tile (down split in two, unsplit): experts_torch + the gated torch MLP
    and the decode path without shared + that MLP, to 1e-5 of the largest output (summation
    order only); the gate matters (the ungated fused output is far off) and the MLP's own
    forward never runs."""
    t, k, chunks, bias = CASES[case]
    w, mlp = gated(len(case) + t, chunks, torch.float32, bias)
    x, topk_w, ids = routed(t, k, seed=3 * t + k, dtype=torch.float32)
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
    ungated = experts_half_decode(x, w["w13"], w["w2"], topk_w, ids, TILES[0], **extra,
                                  shared=SharedExperts(mlp, w["gate_up"], w["down"]))
    assert rel(ungated, want) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_half_precision_against_the_unfused_path(dtype: torch.dtype) -> None:
    """fp16 / bf16 at T = 3, two chunks: the fused output rounds once (the gate in float32
    from the logit rounded to x's dtype) where the unfused rounds the routed sum, the gate,
    the MLP's output and their product before adding: within a few units in the last place
    of the unfused and of a float32 reference (interpreter bf16 casts truncate: twice)."""
    w, mlp = gated(7, 2, dtype)
    x, topk_w, ids = routed(3, 2, seed=8, dtype=dtype)
    got = experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode", shared=mlp.shared())
    assert mlp.calls == 0
    unfused = experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode") + mlp(x)
    f32 = GatedMLP(*(v.float() for v in (mlp.gate_up, mlp.down, mlp.gate)))
    ref = experts_torch(x.float(), w["w13"].float(), w["w2"].float(), topk_w.float(),
                        ids) + f32(x.float())
    ulp = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    slack = 2 if INTERPRET and dtype == torch.bfloat16 else 1
    assert rel(got, unfused) < 8 * ulp * slack
    assert rel(got, ref) < 8 * ulp * slack


def test_gated_launches_add_one_gate_program_a_token_and_no_mlp_call(monkeypatch) -> None:
    """fp16 at T = 3, k = 2, one chunk: experts_triton's default runs the decode kernels alone
    (the gated MLP and its gate not called), gate_up over T * (k + 1 + 1) pairs (T gate
    programs after the shared chunk's) with act of T * (k + 1) rows and a [T] float32
    shared-weight buffer that down reads, whatever the routing; ungated, T programs fewer
    and a 1-element placeholder. The grouped path adds the MLP (its gate inside) once."""
    launches: list = []
    _recording(monkeypatch, launches)
    _decode_first(monkeypatch)
    w, mlp = gated(4, 1, torch.float16)
    x, topk_w, _ = routed(3, 2, seed=6, dtype=torch.float16)
    per_routing = []
    for ids in (torch.tensor([[0, 1], [2, 3], [3, 1]]), torch.tensor([[0, 1]] * 3)):
        experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), shared=mlp.shared())
        per_routing.append(list(launches))
        launches.clear()
    assert per_routing[0] == per_routing[1] and mlp.calls == 0
    tiles = decode.decode_tiles(3, 2 + 1, H, INTER, DEV)[0]
    split = decode.k_per_split(INTER, tiles.block_k, tiles.split)[1]
    names = [n for n, *_ in per_routing[0]]
    assert names == ["_gate_up_kernel", "_down_kernel"] + ["sum_splits_kernel"] * (split > 1)
    (_, up_grid, up_args), (_, down_grid, down_args) = per_routing[0][:2]
    assert up_grid[0] == 3 * (2 + 1 + 1) and up_args[5] == (1, H)  # the gate row
    assert up_args[6] == (3 * (2 + 1), INTER) and up_args[7] == (3,)  # act, shared weights
    assert down_grid[0] == 3 and down_args[6] == (3,)
    plain = SharedExperts(mlp, w["gate_up"], w["down"])
    experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), shared=plain)
    assert launches[0][1][0] == 3 * (2 + 1) and launches[0][2][7] == (1,)
    launches.clear()
    grouped = experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), path="grouped",
                             shared=mlp.shared())
    assert [n for n, *_ in launches] == ["_grouped_gemm_kernel"] * 2 and mlp.calls == 1
    fused = experts_triton(x, w["w13"], w["w2"], topk_w, ids.to(DEV), path="decode",
                           shared=mlp.shared())
    assert rel(fused, grouped) < 8 * 2.0 ** -11


def test_gates_the_kernels_cannot_read_are_refused_or_run_apart() -> None:
    """A gate of another shape or dtype makes SharedExperts.chunks 0 (experts_triton's decode
    path refuses it, naming the gate); gated_shared_expert_of gives no dense weights (run
    alone) when the gate linear has a bias, and its run is the gated MLP."""
    w, mlp = gated(9, 1, torch.float32)
    x, topk_w, ids = routed(1, 2, seed=9, dtype=torch.float32)
    for gate in (mlp.gate.half(), mlp.gate[:, :H - 8].contiguous(), mlp.gate.repeat(2, 1)):
        bad = SharedExperts(mlp, w["gate_up"], w["down"], gate)
        assert bad.chunks(x, INTER) == 0
        with pytest.raises(ValueError, match="gated, gate"):
            experts_triton(x, w["w13"], w["w2"], topk_w, ids, path="decode", shared=bad)

    class Lin:
        def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
            self.weight, self.bias = weight, bias

        def __call__(self, v: torch.Tensor) -> torch.Tensor:
            return F.linear(v, self.weight, self.bias)

    class MLP:
        gate_up_proj, down_proj = Lin(w["gate_up"]), Lin(w["down"])

        def __call__(self, v: torch.Tensor) -> torch.Tensor:
            g, up = self.gate_up_proj(v).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * up)

    good = gated_shared_expert_of(MLP(), Lin(mlp.gate))
    assert good.gate is mlp.gate and good.chunks(x, INTER) == 1
    assert torch.allclose(good.run(x), mlp(x), rtol=1e-6, atol=1e-6)
    bias = torch.ones(1, device=DEV)
    biased = gated_shared_expert_of(MLP(), Lin(mlp.gate, bias))
    assert biased.gate_up is None and biased.chunks(x, INTER) == 0
    want = torch.sigmoid(F.linear(x, mlp.gate, bias)) * MLP()(x)
    assert torch.allclose(biased.run(x), want, rtol=1e-6, atol=1e-6)


# ---- a SharedExpertMoE block and tiny random Qwen3-Next / Qwen3.5-MoE models -----------------

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=64, hidden_size=64, norm_topk_prob=True)


def test_block_runs_no_shared_mlp_or_gate_at_decode_rows(monkeypatch) -> None:
    """A SharedExpertMoE at 2 decode rows on the Triton kernels: the shared expert, its two
    projections and its gate are not called (their launches gone), gate_up runs the gate
    programs, and the output equals the old unfused block (experts + sigmoid(gate) * MLP) to
    1e-5; at 9 rows (grouped) they run once each."""
    from transformers import AutoConfig

    from shoal.models.qwen3_next import SharedExpertMoE

    _on_triton(monkeypatch)
    launches: list = []
    _recording(monkeypatch, launches)
    with torch.device(DEV):  # (no interpreter on a GPU host: compiled Triton needs CUDA)
        block = SharedExpertMoE(AutoConfig.for_model("qwen3_next", **MOE), torch.float32, True)
    g = torch.Generator().manual_seed(12)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    calls: list = []
    for m in (block.shared_expert, block.shared_expert.gate_up_proj,
              block.shared_expert.down_proj, block.shared_expert_gate):
        m.register_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    for rows in (2, 9):
        x = torch.randn(rows, 64, generator=g).to(DEV)
        got = block(x)
        if rows == 2:
            assert not calls
            # k = 2, 2 chunks, 1 gate program a token (grid[1]: the tile's output blocks)
            assert _gate_up_rows(launches, 2 + 2 + 1) == [2]
        else:
            assert sorted(calls) == sorted(["LlamaMLP", "MergedColumnParallelLinear",
                                            "RowParallelLinear", "ReplicatedLinear"])
        calls.clear()
        launches.clear()
        weights, ids = block.gate(x)
        want = block.experts(x, weights, ids) + torch.sigmoid(
            block.shared_expert_gate(x)) * block.shared_expert(x)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        calls.clear()


LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
TINY = {"qwen3_next": {**LINEAR, **MOE},
        "qwen3_5_moe_text": {**LINEAR, **MOE, "shared_expert_intermediate_size": 32}}


@pytest.mark.parametrize("kind", sorted(TINY))
def test_tiny_hybrid_moe_tokens_fused_equal_unfused_and_transformers(monkeypatch, tmp_path,
                                                                     kind: str) -> None:
    """Greedy float32 through the engine, every MoE layer on the Triton kernels: the fused
    decode steps (gate_up with the shared chunks' and the gate programs; no shared expert or
    gate call at a decode row) give transformers' tokens and the unfused layer's tokens and
    logprobs (Qwen3-Next with two chunks, Qwen3.5-MoE with one)."""
    from oracle import hf_greedy, write_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    import shoal.models.qwen3_next as qn
    from shoal import LLM, SamplingParams

    _on_triton(monkeypatch)
    path = write_tiny_checkpoint(tmp_path / kind, kind, seed=4, **TINY[kind])
    chunks = TINY[kind]["shared_expert_intermediate_size"] // 32
    prompt = [5, 77, 300, 12, 9, 61, 4, 250, 33, 18, 7]
    steps = 4
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    launches: list = []
    _recording(monkeypatch, launches)

    def generate() -> tuple:
        llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=16,
                  max_model_len=64, enforce_eager=True)
        started = len(launches)  # (on a GPU the start-up passes' 1..8-row steps launch too)
        rows: list[int] = []
        for m in llm.llm_engine.core.runner.model.modules():
            if isinstance(m, qn.SharedExpertMoE):
                for sub in (m.shared_expert, m.shared_expert_gate):
                    sub.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        return out.outputs[0], rows, launches[started:]

    fused, rows, step_launches = generate()
    assert rows and all(r > decode.MAX_TOKENS for r in rows)  # the prompt's (grouped) only
    _gate_up_rows(launches, 2 + chunks + 1)  # (start-up passes included)
    assert set(_gate_up_rows(step_launches, 2 + chunks + 1)) == {1}  # the decode steps
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert fused.token_ids == hf_greedy(hf, prompt, steps)[0]
    monkeypatch.setattr(qn, "gated_shared_expert_of", unfused_of)
    launches.clear()
    unfused, rows, step_launches = generate()
    _gate_up_rows(launches, 2)
    assert _gate_up_rows(step_launches, 2)
    assert unfused.token_ids == fused.token_ids
    for got, want in zip(fused.logprobs, unfused.logprobs):
        tok = next(iter(want))
        assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-5)


# ---- the GPU: Qwen3-Next-80B-A3B's MoE block, fused and unfused -------------------------------

QWEN3_NEXT_MOE = dict(hidden_size=2048, num_experts=512, num_experts_per_tok=10,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512,
                      norm_topk_prob=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_qwen3_next_block_fused_against_unfused(monkeypatch) -> None:
    """SharedExpertMoE at Qwen3-Next-80B-A3B's shapes (512 experts of I = 512, k = 10, one
    gated shared expert of 512, H = 2048), bf16, T = 1 and 4, the tuner's picks: the fused
    block against the unfused one (4 units in the last place, relative norm) and a float32
    reference (8); each block's device ops in one eager call (at T = 1 the fused one at least
    5 fewer: the shared MLP's gate_up, activation and down, the gate GEMV, the sigmoid, the
    multiply and the add, less nothing new) and its time in a CUDA graph of 20 calls,
    printed (run with -s)."""
    from gpu_timing import graph_of_calls, time_ms
    from test_shared_decode_experts import _device_ops
    from transformers import AutoConfig

    import shoal.models.qwen3_next as qn
    from shoal.layers.quantization import launch_tuner

    cfg = AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_MOE)
    with torch.device(DEV):
        block = qn.SharedExpertMoE(cfg, torch.bfloat16, True)
    g = torch.Generator(DEV).manual_seed(23)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=DEV) / p.shape[-1] ** 0.5)
    mlp, gate = block.shared_expert, block.shared_expert_gate
    fused_of = qn.gated_shared_expert_of
    ulp = 2.0 ** -8
    for t in (1, 4):
        x = torch.randn(t, 2048, generator=g, device=DEV, dtype=torch.bfloat16)
        fused = block(x)
        monkeypatch.setattr(qn, "gated_shared_expert_of", unfused_of)
        unfused = block(x)
        unfused_ops = _device_ops(lambda x=x: block(x))
        unfused_ms = time_ms(graph_of_calls(lambda x=x: block(x))[0]) / 20
        monkeypatch.setattr(qn, "gated_shared_expert_of", fused_of)
        fused_ops = _device_ops(lambda x=x: block(x))
        fused_ms = time_ms(graph_of_calls(lambda x=x: block(x))[0]) / 20
        weights, ids = block.gate(x)
        e = block.experts
        xf = x.float()
        gu = F.linear(xf, mlp.gate_up_proj.weight.float()).chunk(2, -1)
        ref = experts_torch(xf, e.w13_weight.float(), e.w2_weight.float(), weights.float(),
                            ids) + torch.sigmoid(F.linear(xf, gate.weight.float())) * F.linear(
            F.silu(gu[0]) * gu[1], mlp.down_proj.weight.float())
        assert rel(fused, unfused) < 4 * ulp and rel(fused, ref) < 8 * ulp
        picks = {k[5:7] + (k[-3], k[-2]): v.choice for k, v in launch_tuner.TUNED.items()
                 if k[0] == "half experts" and k[5] == t}
        print(f"\nQwen3-Next MoE block T={t}: unfused {unfused_ms * 1e3:.1f} us, "
              f"{len(unfused_ops)} device ops; fused {fused_ms * 1e3:.1f} us, "
              f"{len(fused_ops)} device ops; tuner picks (T, dtype, gated, chunks): {picks}")
        print("  unfused ops:", unfused_ops)
        print("  fused ops:  ", fused_ops)
        if t == 1 and "grouped" not in {v for v in picks.values()}:
            assert len(fused_ops) <= len(unfused_ops) - 5
