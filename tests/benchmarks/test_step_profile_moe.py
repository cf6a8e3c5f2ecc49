"""benchmarks/step_profile_gpu.py on MoE models: the floor by part counted from a built
model's parameters (moe_active_bytes) against the config's arithmetic, the module kinds of
DeepSeek's MLA and MoE blocks, and (gpu_script, make gpu-script-smoke) the script's
--smoke --smoke-model deepseek run on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def floors(prof):
    import step_floors  # (imported, from benchmarks/, by step_profile_gpu)
    return step_floors


def _deepseek(cfg: dict, device: str, dtype_name: str):
    import torch

    from shoal.models.deepseek_v2 import DeepseekV2ForCausalLM

    with torch.device(device):
        return DeepseekV2ForCausalLM(SimpleNamespace(**cfg), getattr(torch, dtype_name))


def _mla_attention_params(cfg: dict) -> int:
    """One layer's MLA weights: q (or q_a + its norm + q_b), kv_a + its norm, kv_b, o."""
    h, heads, lora = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qk, q_lora = nope + rope, cfg.get("q_lora_rank")
    q = q_lora * (h + 1 + heads * qk) if q_lora else h * heads * qk
    return q + h * (lora + rope) + lora + lora * heads * (nope + v) + heads * v * h


def _deepseek_parts(cfg: dict, elem: int, router_elem: int) -> dict[str, int]:
    """The config's arithmetic of each floor part (bytes a batch-1 token reads)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    dense = cfg["first_k_dense_replace"]
    moe = layers - dense
    expert = 3 * h * cfg["moe_intermediate_size"]
    return dict(attention=layers * _mla_attention_params(cfg) * elem,
                mlp=dense * 3 * h * cfg["intermediate_size"] * elem,
                active_experts=moe * cfg["num_experts_per_tok"] * expert * elem,
                shared_experts=moe * cfg["n_shared_experts"] * expert * elem,
                router=moe * cfg["n_routed_experts"] * h * router_elem,
                norms=(2 * layers + 1) * h * elem, embedding_row=h * elem,
                lm_head=cfg["vocab_size"] * h * elem)


def test_tiny_deepseek_floor_matches_the_config_and_deepseek_gpu(floors) -> None:
    from deepseek_gpu import SMOKE_CONFIG, count_active

    model = _deepseek(SMOKE_CONFIG, "cpu", "float32")
    got = floors.moe_active_bytes(model, SMOKE_CONFIG["num_experts_per_tok"])
    assert got["bytes_by_part"] == _deepseek_parts(SMOKE_CONFIG, 4, 4)
    assert got["bytes_per_token"] == sum(got["bytes_by_part"].values())
    # all float32 here: deepseek_gpu's active count with one embedding row is the same total
    counts = count_active(model, SMOKE_CONFIG["num_experts_per_tok"])
    assert got["bytes_per_token"] == counts["active_params_without_embedding"] * 4
    assert got["bytes_per_token_whole_embedding"] == counts["active_params"] * 4
    table = floors.floor_table(SMOKE_CONFIG, 4, 3.0e12, None, got)
    assert [p["part"] for p in table["parts"]] == list(got["bytes_by_part"])
    assert sum(p["bytes"] for p in table["parts"]) == table["bytes_per_token"]
    assert all(p["kinds"] for p in table["parts"])  # every part maps to measured kinds
    # a MoE config without a built model has no floor (and is not taken for a dense one)
    assert floors.floor_table(SMOKE_CONFIG, 4, 3.0e12, None)["parts"] == []


def test_v2_lite_floor_on_the_meta_device(floors) -> None:
    """The shipped V2-Lite shape in bf16 (float32 router gates), built without memory:
    4.91 GB a token with one embedding row; with the whole table, deepseek_gpu.py's
    5,322,300,416 B (which counts every parameter at 2 B) plus the gates' other 2 B."""
    cfg = json.loads((ROOT / "shoal/model_configs/deepseek-v2-lite/config.json").read_text())
    got = floors.moe_active_bytes(_deepseek(cfg, "meta", "bfloat16"), cfg["num_experts_per_tok"])
    assert got["bytes_by_part"] == _deepseek_parts(cfg, 2, 4)
    assert got["bytes_per_token"] == 4_909_689_856
    gates = (cfg["num_hidden_layers"] - 1) * cfg["n_routed_experts"] * cfg["hidden_size"]
    assert got["bytes_per_token_whole_embedding"] == 5_322_300_416 + gates * 2


def test_module_kinds_of_deepseek_blocks(prof) -> None:
    def module(cls: str):
        return type(cls, (), {})()

    cases = {
        ("model.layers.1.self_attn", "DeepseekMLA"): "attention_other",
        ("model.layers.1.self_attn", "DeepseekV32MLA"): "attention_other",
        ("model.layers.1.self_attn.q_a_proj", "ReplicatedLinear"): "attention_linears",
        ("model.layers.1.self_attn.kv_a_proj_with_mqa", "ReplicatedLinear"):
            "attention_linears",
        ("model.layers.1.self_attn.kv_a_layernorm", "RMSNorm"): "attention_other",
        ("model.layers.1.self_attn.attn", "LatentAttention"): "attention_kernel",
        ("model.layers.1.self_attn.rotary_emb", "RotaryEmbedding"): "rotary",
        ("model.layers.1.mlp", "DeepseekMoE"): "moe_other",
        ("model.layers.1.mlp", "Qwen3MoeSparseBlock"): "moe_other",
        ("model.layers.1.mlp.gate", "DeepseekRouter"): "router",
        ("model.layers.1.mlp.experts", "FusedMoE"): "experts",
        ("model.layers.1.mlp.shared_experts", "DeepseekMLP"): "shared_experts",
        ("model.layers.1.mlp.shared_experts.gate_up_proj", "MergedColumnParallelLinear"):
            "shared_experts",
        ("model.layers.1.mlp.shared_experts.act", "SiluAndMul"): "shared_experts",
        ("model.layers.1.mlp.shared_expert_gate", "ReplicatedLinear"): "shared_experts",
        ("model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear"): "mlp_linears",
        ("model.layers.0.input_layernorm", "RMSNorm"): "norms",
    }
    got = {key: prof.module_kind(key[0], module(key[1])) for key in cases}
    assert got == cases


@pytest.mark.gpu_script  # make gpu-script-smoke (an engine: not in make test)
def test_deepseek_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "stepprof.json"
    proc = subprocess.run([sys.executable, "benchmarks/step_profile_gpu.py", "--smoke",
                           "--smoke-model", "deepseek", "--steps", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["model_type"] == "deepseek_v2" and "error" not in rec
    kinds = rec["eager"]["by_kind"]
    for kind in ("attention_linears", "attention_kernel", "attention_other", "experts",
                 "router", "shared_experts", "mlp_linears", "norms", "lm_head"):
        assert kinds.get(kind, {}).get("kernels", 0) > 0, (kind, sorted(kinds))
    floor = rec["floor"]
    assert floor["floor_rule"].startswith("MoE")
    assert sum(p["bytes"] for p in floor["parts"]) == floor["bytes_per_token"]
    assert {p["part"] for p in floor["parts"]} == {
        "attention", "mlp", "active_experts", "shared_experts", "router", "norms",
        "embedding_row", "lm_head"}
    for p in floor["parts"]:  # every part's kinds ran kernels in the profiled steps
        assert p["eager_kernel_us"] > 0, p


def _toy_moe(floors):
    """A model of named modules as shoal builds them: one MoE layer of 8 experts, an attention
    projection, an embedding table and an LM head (float32: 4 bytes a weight)."""
    import torch
    from torch import nn

    class FusedMoE(nn.Module):  # (the step floors find experts by class name)
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = self.local_num_experts = 8
            self.w13_weight = nn.Parameter(torch.zeros(8, 64, 32))
            self.w2_weight = nn.Parameter(torch.zeros(8, 32, 32))

    class VocabParallelEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(1000, 32))

    model = nn.Module()
    model.embed_tokens = VocabParallelEmbedding()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].self_attn = nn.Module()
    model.layers[0].self_attn.qkv_proj = nn.Linear(32, 96, bias=False)
    model.layers[0].mlp = nn.Module()
    model.layers[0].mlp.experts = FusedMoE()
    model.lm_head = nn.Module()
    model.lm_head.weight = nn.Parameter(torch.zeros(1000, 32))
    return model


def test_floor_counts_packed_linear_weights(floors) -> None:
    """fast_path._install keeps an FP8/INT4 linear's weights on layer.quant and empties its
    weight: the floor counts the packed bytes."""
    import torch
    from torch import nn

    model = _toy_moe(floors)
    before = floors.moe_active_bytes(model, 2)["bytes_by_part"]
    assert before["attention"] == 32 * 96 * 4
    assert before["active_experts"] == (64 * 32 + 32 * 32) * 8 * 4 * 2 // 8

    class Packed:
        nbytes = 32 * 96 + 96 * 4  # FP8 codes and a float32 scale a row

    qkv = model.layers[0].self_attn.qkv_proj
    qkv.quant = Packed()
    qkv.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    after = floors.moe_active_bytes(model, 2)["bytes_by_part"]
    assert after["attention"] == Packed.nbytes
    assert after["active_experts"] == before["active_experts"]


def test_tied_table_counts_once_in_the_whole_embedding_figure(floors) -> None:
    model = _toy_moe(floors)
    untied = floors.moe_active_bytes(model, 2)
    table = 1000 * 32 * 4
    assert untied["bytes_by_part"]["embedding_row"] == 32 * 4
    assert untied["bytes_per_token_whole_embedding"] == \
        untied["bytes_per_token"] - 32 * 4 + table
    model.lm_head.weight = model.embed_tokens.weight  # tied
    tied = floors.moe_active_bytes(model, 2)
    assert tied["bytes_by_part"]["lm_head"] == table
    assert tied["bytes_per_token_whole_embedding"] == tied["bytes_per_token"] - 32 * 4
