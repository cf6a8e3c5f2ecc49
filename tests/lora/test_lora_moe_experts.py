"""LoRA on the routed experts of Qwen3-MoE, with PEFT as the oracle: the layouts PEFT writes
(its target_parameters over transformers 5's stacked expert tensors, and the per-expert
modules of adapters trained before transformers 5, which PEFT converts when it loads them)
mixed with the base model in one batch; adapters refused by name; and the expert paths
(PyTorch and the Triton kernels, interpreted on the CPU) against a float64 reference."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from oracle import check_against_hf, write_tiny_checkpoint
from peft_adapters import ATTN, peft_model, write_adapter

from shoal import LLM, SamplingParams
from shoal.engine.core import EngineCore
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.torch_experts import experts_dense
from shoal.lora.expert_layers import ExpertLoRA
from shoal.lora.layers import LoRAStep
from shoal.lora.request import LoRARequest

STEPS = 6
PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9],
           [100, 200, 300, 400, 500, 60, 70], [33, 44, 55, 66, 77]]
# hidden 64, 2 * moe_intermediate 48: no stacked tensor's shape fits the other projection;
# layer 1 is a dense MLP between the MoE layers
QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=True,
                 head_dim=16)
HIDDEN, INTER, EXPERTS = 64, 24, 8
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)


@pytest.fixture(autouse=True)
def no_step_failures(monkeypatch):
    """A failed step is retried one request at a time, which could hide a LoRA error."""
    seen: list[Exception] = []
    recover = EngineCore._recover
    monkeypatch.setattr(EngineCore, "_recover", lambda self, e: (seen.append(e),
                                                                 recover(self, e))[1])
    yield
    assert not seen, f"engine steps failed: {seen}"


def write_per_expert(base: Path, path: Path, *, seed: int, r: int = 4, alpha: float = 8,
                     layers: tuple[int, ...] = (0, 2), experts: range = range(EXPERTS),
                     shapes: dict[str, tuple[int, int]] | None = None) -> Path:
    """An adapter as PEFT saved it before transformers 5 stacked the experts (one
    `...experts.E.gate_proj` module per expert and projection): PEFT 0.21 cannot write it on
    transformers 5, so it is written here, and PEFT's loader converts it for the oracle."""
    from safetensors.torch import save_file

    shapes = shapes or {"gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
                        "down_proj": (INTER, HIDDEN)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for e in experts:
            for proj, (n_in, n_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * 0.3
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
              "target_modules": sorted(shapes), "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The base, three expert adapters and an engine with two device slots and two host
    slots for them."""
    folder = tmp_path_factory.mktemp("lora-moe-experts")
    base = write_tiny_checkpoint(folder / "base", "qwen3_moe", seed=4, **QWEN3_MOE)
    adapters = {
        # PEFT turns gate/up/down_proj targets into target_parameters on transformers 5:
        # gate_up_proj of rank 2r (nested under down_proj's wrapper), attention beside them
        "stacked": write_adapter(base, folder / "stacked", seed=51, r=4, alpha=8,
                                 targets=[*ATTN, "gate_proj", "up_proj", "down_proj"]),
        # one stacked parameter (no nesting), rank 8 = max_lora_rank, rsLoRA scale
        "down": write_adapter(base, folder / "down", seed=52, r=8, alpha=16, use_rslora=True,
                              targets=["q_proj", "v_proj"],
                              target_parameters=["mlp.experts.down_proj"]),
        "per-expert": write_per_expert(base, folder / "per-expert", seed=53),
    }
    llm = LLM(model=str(base), enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_batched_tokens=16, lora_target_modules=["all-linear", "experts"],
              **ENGINE)
    yield base, adapters, llm
    llm.shutdown()


@functools.cache
def oracle(base: Path, adapter: Path | None):
    return peft_model(base, adapter)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


def test_expert_adapters_and_the_base_in_one_batch(moe, monkeypatch):
    """Each output's tokens and logprobs are its own adapter's under PEFT. Steps of 16 tokens
    mix prefill chunks and decodes of two adapters and the base; the third adapter waits for
    a slot, which it then takes over (the slot's expert tensors rewritten, the least recently
    used adapter dropped from host memory)."""
    base, adapters, llm = moe
    names = ["stacked", "per-expert", None, "down", "stacked"]
    ids = {"stacked": 1, "per-expert": 2, "down": 3}
    requests = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    runner = llm.llm_engine.core.runner
    slots = getattr(runner, "driver", runner).lora
    per_step: list[int] = []
    set_step = slots.set_step
    monkeypatch.setattr(slots, "set_step", lambda loras, num: (
        per_step.append(len({x.lora_int_id for x in loras if x})), set_step(loras, num)))
    loads = slots.loads
    outs = llm.generate(PROMPTS, greedy(), lora_request=requests, use_tqdm=False)
    assert slots.loads - loads >= 3 and len(slots.host) <= 2
    assert max(per_step) == 2
    for out, prompt, name in zip(outs, PROMPTS, names, strict=True):
        hf = oracle(base, None if name is None else adapters[name])
        try:
            check_against_hf([out], [prompt], hf, STEPS)
        except AssertionError as e:
            raise AssertionError(f"{name or 'the base'}: {out.outputs[0].token_ids}") from e


def _router(base: Path, path: Path) -> Path:
    return write_adapter(base, path, seed=61, r=4, targets=["q_proj"],
                         target_parameters=["mlp.gate.weight"])


BAD = {
    "router": (_router, r"MoE router \(model\.layers\.0\.mlp\.gate\)"),
    "expert out of range": (lambda b, p: write_per_expert(b, p, seed=62, experts=range(7, 9)),
                            r"expert 8 \(model\.layers\.0\.mlp\.experts\.8\.\w+_proj\), out "
                            r"of range"),
    "wrong shape": (lambda b, p: write_per_expert(b, p, seed=63, shapes={"down_proj": (32, 64)}),
                    r"model\.layers\.0\.mlp\.experts\.0\.down_proj is 32 -> 64 .* 24 -> 64"),
    "rank over the limit": (lambda b, p: write_per_expert(b, p, seed=64, r=16),
                            r"rank 16 on model\.layers\.0\.mlp\.experts\.0\.\w+_proj"),
    "dense layer": (lambda b, p: write_per_expert(b, p, seed=65, layers=(1,)),
                    r"no MoE layer 'model\.layers\.1\.mlp\.experts'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_expert_adapter_is_refused_by_name(case, moe, tmp_path):
    base, adapters, llm = moe
    make, message = BAD[case]
    bad = LoRARequest("bad", 9, str(make(base, tmp_path / "bad")))
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:1], greedy(), lora_request=bad, use_tqdm=False)


# ---- the expert paths against a float64 reference --------------------------------------------
NE, NH, NI = 4, 32, 16  # experts, hidden, intermediate


def _adapters(g: torch.Generator) -> tuple[dict, dict]:
    """Slot 0's adapter: stacked over every expert (gate_up rank 6, down rank 3, under slots of
    max rank 4); slot 1's: per-expert modules of experts 1 and 3 (rank 2)."""
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    stacked = {"m.experts.gate_up_proj": (rnd(NE * 6, NH), rnd(2 * NI, NE * 6)),
               "m.experts.down_proj": (rnd(NE * 3, NI), rnd(NH, NE * 3))}
    per_expert = {f"m.experts.{x}.{p}": (rnd(2, n_in), rnd(n_out, 2)) for x in (1, 3)
                  for p, (n_in, n_out) in {"gate_proj": (NH, NI), "up_proj": (NH, NI),
                                           "down_proj": (NI, NH)}.items()}
    return stacked, per_expert


def _deltas(stacked: dict, per_expert: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Slot -> each expert's dW13 [E, 2I, H] and dW2 [E, H, I], as PEFT defines them."""
    def unstack(name: str, rank: int) -> torch.Tensor:
        a, b = stacked[f"m.experts.{name}"]
        return torch.einsum("ore,eri->eoi", b.view(b.shape[0], rank, NE),
                            a.view(NE, rank, a.shape[1]))

    p13, p2 = torch.zeros(NE, 2 * NI, NH), torch.zeros(NE, NH, NI)
    for x in (1, 3):
        (ga, gb), (ua, ub), (da, db) = (per_expert[f"m.experts.{x}.{p}"]
                                        for p in ("gate_proj", "up_proj", "down_proj"))
        p13[x], p2[x] = torch.cat([gb @ ga, ub @ ua]), db @ da
    return {0: (unstack("gate_up_proj", 6), unstack("down_proj", 3)), 1: (p13, p2)}


def _layer(g: torch.Generator, step: LoRAStep, adapters: tuple[dict, dict],
           weights: FusedMoE | None = None) -> FusedMoE:
    """A FusedMoE of NE experts (random weights, or those of `weights` loaded through the
    checkpoint loader) with the adapters in slots 0 and 1."""
    layer = FusedMoE(NE, NH, NI, use_triton_ops=step.use_triton)
    if weights is None:
        layer.w13_weight.data = torch.randn(NE, 2 * NI, NH, generator=g) / NH ** 0.5
        layer.w2_weight.data = torch.randn(NE, NH, NI, generator=g) / NI ** 0.5
    else:
        for e in range(NE):
            gate, up = weights.w13_weight[e].chunk(2)
            for param, t, shard in ((layer.w13_weight, gate, "w1"),
                                    (layer.w13_weight, up, "w3"),
                                    (layer.w2_weight, weights.w2_weight[e], "w2")):
                layer.weight_loader(param, t, e, shard)
    layer.lora = ExpertLoRA("m.experts", layer, step, 2, 4, torch.float32, torch.device("cpu"))
    for slot, adapter in enumerate(adapters):
        layer.lora.write_slot(slot, adapter)
    return layer


def _reference(layer, x, weights, ids, token_slots, deltas) -> torch.Tensor:
    """Token by token in float64, each token's adapter merged into its experts' weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            w13, w2 = layer.w13_weight[e].double(), layer.w2_weight[e].double()
            if token_slots[t] >= 0:
                d13, d2 = deltas[token_slots[t]]
                w13, w2 = w13 + d13[e].double(), w2 + d2[e].double()
            gate, up = (w13 @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2 @ (F.silu(gate) * up))
    return out


# tokens of both adapters and the base, routed to experts with and without per-expert adapters
IDS = torch.tensor([[1, 3], [0, 2], [3, 1], [1, 0], [2, 3], [3, 0]])
TOKEN_SLOTS = [0, 0, 1, -1, 1, 0]


def _step(use_triton: bool, g: torch.Generator):
    step = LoRAStep(8, torch.device("cpu"), use_triton=use_triton)
    step.set(TOKEN_SLOTS)
    return step, torch.randn(6, NH, generator=g), torch.rand(6, 2, generator=g) + 0.1


@pytest.mark.parametrize("path", ["torch", "dense", "triton"])
def test_expert_lora_paths_against_the_reference(path, monkeypatch):
    """The PyTorch path, the dense one (every expert on every token: CUDA-graph capture
    without the Triton kernel), and the Triton one (the grouped-GEMM and LoRA kernels, forced
    on CPU tensors: interpreted)."""
    triton = path == "triton"
    if triton:
        pytest.importorskip("triton")
        import shoal.layers.moe.layer as moe_layer
        import shoal.lora.ops as lora_ops

        monkeypatch.setattr(moe_layer, "use_triton", lambda x, enabled: enabled)
        monkeypatch.setattr(lora_ops, "_triton_for", lambda x, enabled: enabled)
    g = torch.Generator().manual_seed(7)
    adapters = _adapters(g)
    step, x, weights = _step(triton, g)
    layer = _layer(g, step, adapters)
    want = _reference(layer, x, weights, IDS, TOKEN_SLOTS, _deltas(*adapters))
    got = (experts_dense(x, layer.w13_weight, layer.w2_weight, weights, IDS, lora=layer.lora)
           if path == "dense" else layer(x, weights, IDS))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # the adapters matter: the base model's output is far from it
    base = _reference(layer, x, weights, IDS, [-1] * 6, {})
    assert (base - want).abs().max() > 0.1


@pytest.mark.parametrize("split", ["tensor", "expert"])
def test_expert_lora_split_over_two_ranks(split, monkeypatch):
    """Tensor parallelism (each rank a slice of every expert's intermediate rows) and expert
    parallelism (each rank two whole experts): each rank's slots hold its part of the
    adapters, and the ranks' partial outputs sum (the all-reduce) to the whole layer's."""
    import shoal.layers.moe.layer as moe_layer

    g = torch.Generator().manual_seed(8)
    adapters = _adapters(g)
    step, x, weights = _step(False, g)
    whole = _layer(g, step, adapters)
    want = whole(x, weights, IDS)
    kind = "tp" if split == "tensor" else "ep"
    monkeypatch.setattr(moe_layer, f"get_{kind}_world_size", lambda: 2)
    monkeypatch.setattr(moe_layer, "ep_dispatch_group", lambda: None)
    parts = []
    for rank in range(2):
        monkeypatch.setattr(moe_layer, f"get_{kind}_rank", lambda rank=rank: rank)
        layer = _layer(g, step, adapters, weights=whole)
        # really split: half the experts, or half of each expert's rows
        assert layer.lora.b13.shape[1] * layer.lora.b13.shape[2] == NE * 2 * NI // 2
        parts.append(layer(x, weights, IDS))
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)
