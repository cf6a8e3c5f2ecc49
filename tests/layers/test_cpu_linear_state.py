"""The C++ decode step of linear attention on the CPU (shoal/csrc/linear_state_cpu.cpp) against
the layers' torch decode path: Gated DeltaNet (key heads shared by value heads, per-head
decay) and KDA (per-channel decay, sqrt-and-divide q/k norm), float32 and bfloat16, states
read from one block and written to another inside the pages of the KV pool (a state
straddling two planes), then the engine's greedy tokens with and without the kernel. Builds
the extension if the Makefile's set-up has not; skips only without a toolchain."""

from __future__ import annotations

import pytest
import torch
from linear_layer_setup import randomize_linear_layer, tiny_linear_config
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams, cpu_kernels
from shoal.attention.linear_state import StateMetadata, StatePages
from shoal.layers.gated_delta_net import GatedDeltaNet
from shoal.layers.kimi_delta_attention import KimiDeltaAttention
from shoal.layers.ops import cpu_linear_state

BS, PLANES, HK_PAGE, D_PAGE = 16, 2, 2, 32  # a page of 2 x 1024 float32 words


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    missing = cpu_kernels.missing_toolchain()
    if missing:
        pytest.skip(f"cannot build the C++ CPU kernels here: {missing}")
    cpu_kernels.build()  # a compile error fails the tests: the toolchain is there
    cpu_kernels.layer_ops_enabled.cache_clear()
    assert cpu_linear_state.usable(torch.zeros(1))


def _layer(kind: str, dtype: torch.dtype) -> GatedDeltaNet | KimiDeltaAttention:
    cfg = tiny_linear_config(2, 4, 4)
    layer = (GatedDeltaNet(cfg, dtype, interleaved=False) if kind == "gdn"
             else KimiDeltaAttention(cfg, dtype))
    randomize_linear_layer(layer, torch.Generator().manual_seed(3), 0.3)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_step_matches_the_torch_path(kind: str, dtype: torch.dtype, monkeypatch):
    layer = _layer(kind, dtype)
    cache = torch.zeros(PLANES, 8 * BS, HK_PAGE, D_PAGE)
    layer.bind_pages(cache, BS)
    assert layer.pages is not None and len(layer.pages.runs) == 2  # states straddle the planes
    gen = torch.Generator().manual_seed(4)
    read, write = torch.tensor([1, 3, 4]), torch.tensor([2, 3, 5])  # row 0 moves to a new block
    heads, dk, dv = layer.pages.state_shape
    conv0 = torch.randn(3, layer.conv_dim, layer.conv_kernel - 1, generator=gen).to(dtype)
    layer.pages.write(read, conv0.float(), torch.randn(3, heads, dk, dv, generator=gen) * 0.5)
    x, rest = layer.conv_input(torch.randn(3, 32, generator=gen).to(dtype))
    md = StateMetadata(3, read, write, [], BS)

    layer.pages.write(write[:1], *layer.pages.read(read[:1]))  # block 2: stale contents
    before = cache.clone()

    def step(kernel: bool) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(cpu_linear_state, "usable", lambda x: kernel)
        cache.copy_(before)
        o = layer._decodes(x, rest, md)
        return o, *layer.pages.read(write)

    o_ref, conv_ref, state_ref = step(False)
    o, conv, state = step(True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: y's rounding can flip by one ulp
    torch.testing.assert_close(o, o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(state, state_ref, atol=tol, rtol=tol)
    assert torch.equal(conv, conv_ref)  # the window moves exactly
    # no word outside the written states changes (block 1 keeps its snapshot)
    written = torch.zeros_like(cache)
    mask = StatePages(written, BS, layer.pages.conv_shape, layer.pages.state_shape)
    mask.write(write, torch.ones_like(conv), torch.ones_like(state))
    assert torch.equal(cache[written == 0], before[written == 0])


def test_engine_tokens_equal_with_and_without_the_kernel(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(
        tmp_path, "qwen3_5_text", seed=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=32, max_model_len=256,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    calls = []
    step = cpu_linear_state.decode_step

    def counted(*a, **kw):
        calls.append(1)
        return step(*a, **kw)
    monkeypatch.setattr(cpu_linear_state, "decode_step", counted)
    with_kernel = llm.generate(prompts, params, use_tqdm=False)
    assert calls  # the decodes ran through it
    monkeypatch.setattr(cpu_linear_state, "usable", lambda x: False)
    without = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(with_kernel, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_lp_a, step_lp_b, tok in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                             a.outputs[0].token_ids):
            assert step_lp_a[tok].logprob == pytest.approx(step_lp_b[tok].logprob, abs=1e-4)
