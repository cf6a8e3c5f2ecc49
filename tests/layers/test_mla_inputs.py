"""The latent-attention inputs in one Triton launch (layers/ops/mla_inputs.py) against the
modules' unfused ops (interpreter on the CPU, compiled on a GPU), and a tiny DeepSeek-V2 and
V3 through the engine with the fused path forced on: transformers' greedy tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepseek_tiny import V2, V3, check_against_hf, write_deepseek

from shoal import LLM, SamplingParams
from shoal.layers.ops.mla_inputs import mla_inputs
from shoal.models import deepseek_v2
from shoal.models.deepseek_v2 import DeepseekMLA

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def _mla(heads: int, lat: int, rope: int) -> DeepseekMLA:
    cfg = SimpleNamespace(num_attention_heads=heads, qk_nope_head_dim=8, qk_rope_head_dim=rope,
                          v_head_dim=8, kv_lora_rank=lat, q_lora_rank=None, hidden_size=32,
                          rms_norm_eps=1e-6, max_position_embeddings=256,
                          rope_parameters=YARN, model_type="deepseek_v2")
    mla = DeepseekMLA(cfg, torch.float32, use_triton_ops=False)
    mla.kv_a_layernorm.weight.data.uniform_(0.5, 1.5)
    return mla


def _operands(mla: DeepseekMLA, tokens: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, lat, rope = mla.num_heads, mla.kv_lora_rank, mla.rope
    q_lat = torch.randn(h, tokens, lat, generator=g).to(dtype)
    q = torch.randn(tokens, h, 8 + rope, generator=g).to(dtype)  # nope 8, then rope
    kv_a = (torch.randn(tokens, lat + rope, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 200, (tokens,), generator=g)
    return q_lat, q[..., 8:], kv_a, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,lat,rope,tokens", [(4, 32, 16, 1), (3, 24, 8, 5)])
def test_the_kernel_gives_the_unfused_inputs(dtype, heads, lat, rope, tokens) -> None:
    """lat 24 exercises the masked lanes of the norm's power-of-two block."""
    mla = _mla(heads, lat, rope)
    mla.kv_a_layernorm.to(dtype)  # (the rotary table stays float32, as the loader keeps it)
    q_lat, q_pe, kv_a, positions = _operands(mla, tokens, dtype, seed=tokens)
    # (clones: the unfused rotary turns contiguous slices in place)
    want_q, want_lat = mla.attention_inputs(q_lat, q_pe.clone(), kv_a.clone(), positions)
    table = mla.rope_table()
    assert table is not None and table is not False
    got_q, got_lat = mla_inputs(q_lat.to(DEV), q_pe.to(DEV), kv_a.to(DEV), positions.to(DEV),
                                table.to(DEV), mla.kv_a_layernorm.weight.to(DEV), 1e-6)
    tol = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}  # one bf16 ulp
    torch.testing.assert_close(got_q.cpu(), want_q, **tol)
    torch.testing.assert_close(got_lat.cpu(), want_lat, **tol)
    # the latent-space part is a copy, exact at any dtype
    assert torch.equal(got_q[..., :lat].cpu(), q_lat.transpose(0, 1))


def test_without_a_table_the_rotary_parts_are_copied() -> None:
    mla = _mla(2, 16, 8)
    q_lat, q_pe, kv_a, positions = _operands(mla, 3, torch.float32, seed=7)
    got_q, got_lat = mla_inputs(q_lat.to(DEV), q_pe.to(DEV), kv_a.to(DEV), positions.to(DEV),
                                None, mla.kv_a_layernorm.weight.to(DEV), 1e-6)
    assert torch.equal(got_q[..., 16:].cpu(), q_pe)
    assert torch.equal(got_lat[:, 16:].cpu(), kv_a[:, 16:])
    torch.testing.assert_close(got_lat[:, :16].cpu(), mla.kv_a_layernorm(kv_a[:, :16]))


def test_bad_shapes_are_refused() -> None:
    w = torch.ones(16)
    with pytest.raises(ValueError, match="q_pe"):
        mla_inputs(torch.zeros(2, 3, 16), torch.zeros(3, 4, 8), torch.zeros(3, 24),
                   torch.zeros(3, dtype=torch.long), None, w, 1e-6)
    with pytest.raises(ValueError, match="kv_a"):
        mla_inputs(torch.zeros(2, 3, 16), torch.zeros(3, 2, 8), torch.zeros(3, 20),
                   torch.zeros(3, dtype=torch.long), None, w, 1e-6)
    with pytest.raises(ValueError, match="rope_table"):
        mla_inputs(torch.zeros(2, 3, 16), torch.zeros(3, 2, 8), torch.zeros(3, 24),
                   torch.zeros(3, dtype=torch.long), torch.zeros(10, 6), w, 1e-6)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_the_engine_with_the_fused_inputs_gives_transformers_tokens(model_type, tmp_path,
                                                                     monkeypatch) -> None:
    """The fused path forced on (on the CPU: in the interpreter) for every MLA layer, through
    chunked prefill and decode."""
    calls = []

    def force_for_mla(x, enabled):
        calls.append(1)
        return True

    monkeypatch.setattr(deepseek_v2, "use_triton", force_for_mla)
    kw = V2 if model_type == "deepseek_v2" else V3
    path, hf = write_deepseek(tmp_path, model_type, seed=3, **kw)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=64, max_model_len=128)
    prompts = [[5, 9, 33, 120, 7, 8, 300, 41, 12, 77, 3, 99, 250, 18, 6, 61, 44, 200, 10],
               [17, 4, 88]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 6)
    assert calls, "the MLA layers never asked for the fused inputs"
