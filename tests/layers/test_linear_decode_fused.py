"""The fused decode kernels of linear attention (shoal/layers/ops/linear_decode_fused.py) under
TRITON_INTERPRET=1 against the layers' torch decode path: Kimi Delta Attention, Gated
DeltaNet with key heads shared by two value heads and with one value head a key head, Qwen3-Next's interleaved projections; float32 and bf16;
several steps in a row from non-zero states, a row moving to a new block, one in place, one
padding row (null block in, trash block out), states straddling a page's two planes. Then the
engine's greedy tokens with the fused path forced on equal transformers' (tiny Kimi-Linear,
Qwen3.5, Qwen3-Next)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from linear_layer_setup import randomize_linear_layer, tiny_linear_config  # noqa: E402

from shoal.attention.linear_state import StateMetadata, StatePages  # noqa: E402
from shoal.layers import linear_attention  # noqa: E402
from shoal.layers.gated_delta_net import GatedDeltaNet  # noqa: E402
from shoal.layers.kimi_delta_attention import KimiDeltaAttention  # noqa: E402
from shoal.layers.ops import cpu_linear_state, linear_decode_fused  # noqa: E402
from shoal.layers.ops.linear_state_decode import PageWords  # noqa: E402

BS, PLANES, HK_PAGE, D_PAGE = 16, 2, 2, 16  # a page of 2 x 512 float32 words
NULL, TRASH = 0, 7
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

KINDS = {  # (layer class, key heads, value heads, interleaved): heads of 16
    "kda": (KimiDeltaAttention, 2, 2, False),
    "gdn": (GatedDeltaNet, 1, 2, False),
    "gdn-one-value-head-a-key-head": (GatedDeltaNet, 2, 2, False),
    "gdn-interleaved": (GatedDeltaNet, 1, 2, True),
}


def _layer(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    cls, nk, nv, interleaved = KINDS[kind]
    cfg = tiny_linear_config(nk, nv, nv)
    layer = (KimiDeltaAttention(cfg, dtype) if cls is KimiDeltaAttention
             else GatedDeltaNet(cfg, dtype, interleaved=interleaved))
    gen = torch.Generator().manual_seed(3)
    randomize_linear_layer(layer, gen, 0.5, norm_near_one=True)
    layer = layer.to(DEVICE)
    if kind.startswith("gdn-"):  # (no shipped layer has a conv bias: both kernels take one)
        layer.conv_bias = torch.randn(layer.conv_dim, generator=gen).to(dtype).to(DEVICE)
    return layer


_REAL_DECODE_STEP = linear_decode_fused.decode_step


def _step(layer, cache: torch.Tensor, hidden: torch.Tensor, md: StateMetadata, fused: bool,
          monkeypatch, early: bool = True) -> torch.Tensor:
    """The layer's forward over `cache`, through the fused kernels or the torch path (early:
    the states read before the kernels' wait, as the layer asks without a fold)."""
    monkeypatch.setattr(linear_attention, "triton_decode", lambda x: fused)
    monkeypatch.setattr(cpu_linear_state, "usable", lambda x: False)
    calls = []
    real = _REAL_DECODE_STEP

    def counted(*a, **kw):
        calls.append(1)
        assert kw["early_states"] is True  # (the layer's EARLY_READS)
        return real(*a, **{**kw, "early_states": early})
    monkeypatch.setattr(linear_decode_fused, "decode_step", counted)
    layer.bind_pages(cache, BS)
    with torch.no_grad():
        out = layer(hidden, md)
    assert len(calls) == int(fused)
    return out


@pytest.mark.parametrize("split, early", [(1, True), (2, True), (1, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fused_decode_matches_the_torch_path(kind: str, dtype: torch.dtype, split: int,
                                             early: bool, monkeypatch):
    """split 2: each value head's state in two column slices, the head's last program
    norming the whole output (SHOAL_LINEAR_DECODE_SPLIT; heads of 16: slices of 8). early
    False: the states read after the kernels' wait, as after a speculative step's fold (the
    same result here, where PDL is off: both orders' code runs, for the sm_90 compile
    check)."""
    monkeypatch.setenv("SHOAL_LINEAR_DECODE_SPLIT", str(split))
    monkeypatch.setattr(linear_decode_fused, "split_for", lambda rows, heads, dv, device:
                        split)
    layer = _layer(kind, dtype)
    cache = torch.zeros(PLANES, 8 * BS, HK_PAGE, D_PAGE, device=DEVICE)
    layer.bind_pages(cache, BS)
    pages = layer.pages
    assert pages is not None
    heads, dk, dv = pages.state_shape
    # one head's state straddles the page's two planes, the other's lies in one
    ends = [pages.conv_words + h * dk * dv for h in range(heads + 1)]
    per_plane = pages.words.shape[2]
    assert sorted(a // per_plane == (b - 1) // per_plane
                  for a, b in zip(ends, ends[1:])) == [False, True]
    gen = torch.Generator().manual_seed(4)
    first = torch.tensor([1, 3, 4], device=DEVICE)
    conv0 = torch.randn(3, layer.conv_dim, layer.conv_kernel - 1, generator=gen).to(dtype)
    pages.write(first, conv0.float().to(DEVICE),
                (torch.randn(3, heads, dk, dv, generator=gen) * 0.5).to(DEVICE))
    ref_cache, got_cache = cache.clone(), cache.clone()
    # rows: 0 moves on to a new block each step, 1 stays in its block, 2 moves once, and a
    # padding row reads the null block and writes the trash block
    reads = [[1, 3, 4, NULL], [2, 3, 5, NULL], [6, 3, 5, NULL]]
    writes = [[2, 3, 5, TRASH], [6, 3, 5, TRASH], [1, 3, 5, TRASH]]
    # bf16: the output rounds to bf16 (an ulp may flip), the float32 states agree closely
    # (in the interpreter, whose exp is numpy's as torch's on the CPU, to float32 rounding)
    out_tol, state_tol = ((1e-5, 1e-5) if dtype == torch.float32
                          else (3e-2, 5e-3) if DEVICE == "cuda" else (1e-2, 1e-5))
    for read, write in zip(reads, writes):
        md = StateMetadata(4, torch.tensor(read, device=DEVICE),
                           torch.tensor(write, device=DEVICE), [], BS)
        hidden = torch.randn(4, 32, generator=gen).to(dtype).to(DEVICE)
        want = _step(layer, ref_cache, hidden, md, False, monkeypatch)
        got = _step(layer, got_cache, hidden, md, True, monkeypatch, early)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=out_tol, rtol=out_tol)
        for c in (ref_cache, got_cache):
            layer.bind_pages(c, BS)
            assert layer.pages is not None
            assert not any(t.any() for t in layer.pages.read(torch.tensor([NULL], device=DEVICE)))
        got_conv, got_state = StatePages(got_cache, BS, pages.conv_shape,
                                         pages.state_shape).read(md.decode_write)
        ref_conv, ref_state = StatePages(ref_cache, BS, pages.conv_shape,
                                         pages.state_shape).read(md.decode_write)
        assert torch.equal(got_conv, ref_conv)  # the window moves exactly
        torch.testing.assert_close(got_state, ref_state, atol=state_tol, rtol=state_tol)
    # nothing else in the pages moved: the blocks no row wrote keep what they held
    untouched = [b for b in range(8) if b not in {w for ws in writes for w in ws}]
    for b in untouched:
        torch.testing.assert_close(got_cache.view(PLANES, 8, -1)[:, b],
                                   ref_cache.view(PLANES, 8, -1)[:, b], atol=0, rtol=0)


def test_unsupported_head_sizes_keep_the_other_path(monkeypatch):
    cfg = SimpleNamespace(hidden_size=32, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
                          linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=24, linear_value_head_dim=24)
    layer = GatedDeltaNet(cfg, torch.float32, interleaved=False).to(DEVICE)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, rest = layer.conv_input(torch.randn(2, 32, device=DEVICE))
    cache = torch.zeros(PLANES, 8 * BS, HK_PAGE, 4 * D_PAGE, device=DEVICE)
    md = StateMetadata(2, torch.tensor([1, 2], device=DEVICE), torch.tensor([1, 2], device=DEVICE),
                       [], BS)
    monkeypatch.setattr(linear_attention, "triton_decode", lambda x: True)
    layer.bind_pages(cache, BS)
    with torch.no_grad():
        assert layer._fused_decodes(x, rest, md) is None
        out = layer(torch.randn(2, 32, device=DEVICE), md)
    assert out.shape == (2, 32) and out.isfinite().all()


SHIPPED = ("kimi-linear-48b-a3b", "qwen3.5-35b-a3b", "qwen3.5-27b",
           "qwen3-next-80b-a3b-24layers")


def shipped_layer(name: str, dtype: torch.dtype, device: str | torch.device, blocks: int
                  ) -> tuple[torch.nn.Module, torch.Tensor, int]:
    """A linear layer at a shipped shape (shoal/model_configs/<name>), unbound, and a cache
    of `blocks` blocks laid out as the engine lays its pages: Kimi's latent rows (one plane of
    kv_lora_rank + qk_rope_head_dim values a token), Qwen's K and V planes of its KV heads;
    the block size the model picks. Returns (layer, cache, block size)."""
    from transformers import AutoConfig

    from shoal.models.kimi_linear import KimiLinearForCausalLM
    from shoal.models.qwen3_next import hybrid_block_size

    root = Path(__file__).resolve().parents[2] / "shoal" / "model_configs" / name
    raw = json.loads((root / "config.json").read_text())
    cfg = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                     if k not in ("model_type", "architectures")})
    with torch.device(device):
        if raw["model_type"] == "kimi_linear":
            layer = KimiDeltaAttention(cfg, dtype)
            bs = KimiLinearForCausalLM.block_size_for(cfg, dtype.itemsize, 1)
            cache = torch.zeros(1, blocks * bs, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                dtype=dtype)
        else:
            layer = GatedDeltaNet(cfg, dtype, interleaved=raw["model_type"] == "qwen3_next")
            bs = hybrid_block_size(cfg, dtype.itemsize, 1)
            cache = torch.zeros(2, blocks * bs, cfg.num_key_value_heads, cfg.head_dim,
                                dtype=dtype)
    return layer, cache, bs


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_shapes_take_the_fused_kernels(name: str):
    """(meta tensors: shapes and strides only) every shipped hybrid's pages and projections
    are ones the fused kernels take, so its decode steps do not fall back."""
    layer, cache, bs = shipped_layer(name, torch.bfloat16, "meta", blocks=4)
    layer.bind_pages(cache, bs)
    assert layer.pages is not None
    x, rest = layer.conv_input(torch.empty(3, _hidden(layer), dtype=torch.bfloat16,
                                           device="meta"))
    words = layer.pages.words
    pages = PageWords(words, words.shape[2], words.stride(0), words.stride(1))
    key_heads = layer.conv_parts[0] // layer.key_dim
    assert linear_decode_fused.fits(x, layer.decode_gates(rest), layer.conv_weight, pages,
                                    key_heads, layer.state_heads, layer.key_dim,
                                    layer.value_dim)


def _hidden(layer: torch.nn.Module) -> int:
    proj = layer.qkvb_proj if isinstance(layer, KimiDeltaAttention) else layer.in_proj_qkvz
    return proj.input_size


ENGINE_KINDS = ("kimi_linear", "qwen3_5_text", "qwen3_next")


@pytest.mark.parametrize("model_type", ENGINE_KINDS)
def test_engine_with_the_fused_decode_gives_transformers_tokens(model_type: str, tmp_path,
                                                                monkeypatch):
    """Every decode-only step through the fused kernels (the CUDA path forced onto the CPU
    tensors: Triton's interpreter), the greedy tokens and logprobs transformers' own."""
    from models.test_kimi_linear import write_kimi_checkpoint
    from models.test_qwen3_next import KINDS as QWEN_KINDS
    from oracle import hf_greedy, write_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from shoal import LLM, SamplingParams

    if model_type == "kimi_linear":
        path = write_kimi_checkpoint(tmp_path / model_type, seed=1)
    else:
        path = write_tiny_checkpoint(tmp_path / model_type, model_type, seed=1,
                                     **QWEN_KINDS[model_type])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    monkeypatch.setattr(linear_attention, "triton_decode", lambda x: True)
    calls = []
    real = linear_decode_fused.decode_step

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(linear_decode_fused, "decode_step", counted)
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=32, max_model_len=256,
              enforce_eager=True)
    prompts = [[5 + (7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((9, 23))]
    steps = 5
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    assert 2 in calls  # decode steps of both requests ran the fused kernels
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, steps)
        got = o.outputs[0]
        assert got.token_ids == ref
        for step, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)



def test_split_for(monkeypatch):
    """SHOAL_LINEAR_DECODE_SPLIT: 1 keeps one program a head; a count is rounded down to a
    power of two, never below 16 columns a slice; 0 doubles up to 4 while the programs are
    fewer than the multiprocessors (the CPU counts 4); many rows x heads never split."""
    cpu = torch.device("cpu")
    split_for = linear_decode_fused.split_for
    assert split_for(1, 32, 128, cpu) == 1  # the default
    monkeypatch.setenv("SHOAL_LINEAR_DECODE_SPLIT", "3")
    assert split_for(1, 32, 128, cpu) == 2
    monkeypatch.setenv("SHOAL_LINEAR_DECODE_SPLIT", "8")
    assert (split_for(1, 32, 128, cpu), split_for(1, 32, 32, cpu)) == (8, 2)
    assert split_for(1, 32, 16, cpu) == 1
    assert split_for(32, linear_decode_fused.SPLIT_ROWS_HEADS // 32, 128, cpu) == 1
    monkeypatch.setenv("SHOAL_LINEAR_DECODE_SPLIT", "0")
    assert (split_for(1, 1, 128, cpu), split_for(1, 2, 128, cpu), split_for(1, 4, 128, cpu)) \
        == (4, 2, 1)


def test_a_split_that_does_not_cut_the_head_into_power_of_two_slices_is_refused(monkeypatch):
    layer = _layer("gdn", torch.float32)
    cache = torch.zeros(PLANES, 8 * BS, HK_PAGE, D_PAGE, device=DEVICE)
    md = StateMetadata(1, torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE),
                       [], BS)
    monkeypatch.setattr(linear_decode_fused, "split_for", lambda *a: 3)
    with pytest.raises(ValueError, match="power-of-two"):
        _step(layer, cache, torch.randn(1, 32).to(DEVICE), md, True, monkeypatch)


@pytest.mark.parametrize("fold", [False, True])
def test_the_states_are_read_early_after_a_fold_too(fold: bool, monkeypatch):
    """A speculative step's fold writes the states just before the decode kernels, through
    torch ops (pages.write), which are not launched with PDL: the kernels after them start
    only once they have finished, so every decode step reads its states before the kernels'
    wait (early_states True; layers/linear_attention.py EARLY_READS), after a fold too."""
    layer = _layer("gdn", torch.float32)
    cache = torch.zeros(PLANES, 8 * BS, HK_PAGE, D_PAGE, device=DEVICE)
    layer.bind_pages(cache, BS)
    folded = []
    monkeypatch.setattr(type(layer), "_fold_into_pages",
                        lambda self, f, like: folded.append(f))
    monkeypatch.setattr(linear_attention, "triton_decode", lambda x: True)
    seen = []

    def recorded(*a, **kw):
        seen.append(kw["early_states"])
        return _REAL_DECODE_STEP(*a, **kw)
    monkeypatch.setattr(linear_decode_fused, "decode_step", recorded)
    marker = object()  # (the fold itself is stubbed: only its presence matters here)
    md = StateMetadata(2, torch.tensor([1, 2], device=DEVICE), torch.tensor([1, 3], device=DEVICE),
                       [], BS, fold=marker if fold else None)  # type: ignore[arg-type]
    with torch.no_grad():
        layer(torch.randn(2, 32).to(DEVICE), md)
    assert folded == ([marker] if fold else [])
    assert seen == [True]

