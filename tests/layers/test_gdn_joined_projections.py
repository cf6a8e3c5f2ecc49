"""The in-projections of the linear-attention layers run as one GEMM (SharedInputLinear):
Gated DeltaNet's in_proj_qkvz and in_proj_ba in both layouts (Qwen3-Next's interleaved rows,
Qwen3.5's segments), Kimi Delta Attention's qkvb_proj and fg_a_proj. One dense matmul where
there were two; the layer's conv inputs, output and states those of the layer run apart to a
rounding (float32 and bf16; a CPU GEMM may block another N otherwise); each tensor-parallel rank's joined shards what its rows of the
whole layer give; a packed or LoRA-adapted projection runs apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from linear_layer_setup import randomize_linear_layer, tiny_linear_config

from shoal.attention.linear_state import build_state_metadata
from shoal.layers import gated_delta_net, kimi_delta_attention, linear
from shoal.layers.gated_delta_net import GatedDeltaNet
from shoal.layers.kimi_delta_attention import KimiDeltaAttention
from shoal.layers.linear import load_tensor
from shoal.layers.ops import dense_linear
from shoal.layers.shared_input_linear import settle_all

HIDDEN, BS = 32, 16
KINDS = ("gdn-interleaved", "gdn-segmented", "kda")
# the dense matmuls of conv_input: joined, apart (KDA adds its two up-projections)
MATMULS = {"gdn-interleaved": (1, 2), "gdn-segmented": (1, 2), "kda": (3, 4)}


def _cfg() -> SimpleNamespace:
    # two key heads of two value heads each (Qwen), two heads (Kimi): halves per rank at tp 2
    return tiny_linear_config(2, 4, 2, hidden=HIDDEN)


def _build(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    if kind == "kda":
        return KimiDeltaAttention(_cfg(), dtype)
    return GatedDeltaNet(_cfg(), dtype, interleaved=kind == "gdn-interleaved")


def _joined_and_apart(kind: str, dtype: torch.dtype
                      ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two layers of the same weights: the first runs its projections joined, the second
    apart (its second projection's weight given a storage of its own)."""
    joined, apart = _build(kind, dtype), _build(kind, dtype)
    randomize_linear_layer(joined, torch.Generator().manual_seed(0), 0.4)
    apart.load_state_dict(joined.state_dict())  # (copy_ in place: apart is joined still)
    second = apart.in_proj.second
    second.weight.data = second.weight.data.clone()
    assert joined.in_proj.joined_weight() is not None
    assert apart.in_proj.joined_weight() is None
    return joined, apart


def _count_matmuls(monkeypatch) -> list[tuple[int, ...]]:
    """The weight shapes dense_linear.linear runs, in order (every dense layer's matmul and
    the joined one go through it)."""
    shapes: list[tuple[int, ...]] = []
    real = dense_linear.linear

    def counted(x, weight, *args, **kw):
        shapes.append(tuple(weight.shape))
        return real(x, weight, *args, **kw)
    monkeypatch.setattr(dense_linear, "linear", counted)
    return shapes


@pytest.mark.parametrize("kind", KINDS)
def test_the_in_projections_take_one_matmul(kind: str, monkeypatch):
    joined, apart = _joined_and_apart(kind, torch.float32)
    shapes = _count_matmuls(monkeypatch)
    hidden = torch.randn(1, HIDDEN)
    with torch.no_grad():
        joined.conv_input(hidden)
        n_joined = len(shapes)
        apart.conv_input(hidden)
    assert (n_joined, len(shapes) - n_joined) == MATMULS[kind]
    first, second = joined.in_proj.first.weight, joined.in_proj.second.weight
    assert shapes[0] == (first.shape[0] + second.shape[0], HIDDEN)
    # the parameters are the layers' own, views of the one matrix the matmul reads
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


# The joined matmul against each projection's own: the same sums, but a CPU GEMM may block
# K differently for another N (an AVX-512 + AMX host, 2026-12-06: KDA's f/g down-projection
# in float32 differed in the last bit, where an AVX2 host gave equal values), so equal to
# float32 rounding, and bf16 to one rounding of its own (a near tie may round either way).
ROUNDING = {torch.float32: dict(rtol=1e-5, atol=1e-6),
            torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3)}
# a whole step after those inputs: the recurrences carry a rounding along
STEP_ROUNDING = {torch.float32: dict(rtol=1e-5, atol=1e-5),
                 torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_joined_layer_equals_the_layer_apart(kind: str, dtype: torch.dtype):
    """conv_input at a decode step and a prefill's rows, then a whole step (two decodes and
    a prefill chunk, the CPU path) from the same pages: outputs and states equal to a
    rounding (ROUNDING), and bit for bit in at least one of the conv_input calls, so the
    joined path is the same arithmetic and not merely close."""
    joined, apart = _joined_and_apart(kind, dtype)
    gen = torch.Generator().manual_seed(1)
    exact = 0
    with torch.no_grad():
        for rows in (1, 3, 20):
            hidden = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
            (x1, rest1), (x2, rest2) = joined.conv_input(hidden), apart.conv_input(hidden)
            assert len(rest1) == len(rest2)
            for a, b in zip((x1, *rest1), (x2, *rest2)):
                assert a.dtype == b.dtype and a.shape == b.shape
                torch.testing.assert_close(a, b, **ROUNDING[dtype])
                exact += int(torch.equal(a, b))
        caches = [torch.zeros(2, 8 * BS, 2, 64) for _ in range(2)]
        md = build_state_metadata(query_lens=[1, 1, 6], context_lens=[3, 9, 0],
                                  block_tables=[[1], [2], [3, 4]], block_size=BS,
                                  num_decodes=2, device=torch.device("cpu"), null_block=0)
        hidden = torch.randn(8, HIDDEN, generator=gen).to(dtype)
        outs = []
        for layer, cache in zip((joined, apart), caches):
            layer.bind_pages(cache, BS)
            outs.append(layer(hidden, md))
    assert exact > 0, "no output of the joined projection equals the one apart"
    assert outs[0].isfinite().all()
    torch.testing.assert_close(outs[0], outs[1], **STEP_ROUNDING[dtype])
    torch.testing.assert_close(caches[0], caches[1], **STEP_ROUNDING[torch.float32])


def _rank_layer(kind: str, rank: int, whole: torch.nn.Module, monkeypatch) -> torch.nn.Module:
    """Rank `rank` of two: built as the engine builds it, its weights loaded from the whole
    layer's parameters (the checkpoint's tensors) through their weight loaders."""
    with monkeypatch.context() as m, torch.no_grad():
        for module in (gated_delta_net, kimi_delta_attention, linear):
            m.setattr(module, "get_tp_world_size", lambda: 2, raising=False)
            m.setattr(module, "get_tp_rank", lambda: rank, raising=False)
        layer = _build(kind, torch.float32)
        params = dict(layer.named_parameters())
        for name, p in whole.named_parameters():
            load_tensor(params[name], p.detach().clone())
    return layer


def _halves(t: torch.Tensor, parts: list[int], rank: int) -> torch.Tensor:
    """Rank `rank` of two's columns of t [T, sum(parts)]: its half of every part."""
    return torch.cat([p.chunk(2, dim=-1)[rank] for p in t.split(parts, dim=-1)], dim=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_joins_its_own_shards(kind: str, monkeypatch):
    """At tensor-parallel size 2 each rank's joined projections give its share of the whole
    layer's conv input and gates: the shards its loaders wrote are the joined matrix."""
    whole, _ = _joined_and_apart(kind, torch.float32)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x, rest = whole.conv_input(hidden)
        for rank in (0, 1):
            layer = _rank_layer(kind, rank, whole, monkeypatch)
            assert layer.in_proj.joined_weight() is not None
            got_x, got_rest = layer.conv_input(hidden)
            torch.testing.assert_close(got_x, _halves(x, list(whole.conv_parts), rank),
                                       rtol=0, atol=1e-6)
            for got, want in zip(got_rest, rest):  # per-head tensors: this rank's heads
                torch.testing.assert_close(got, want.chunk(2, dim=1)[rank], rtol=0, atol=1e-6)


@pytest.mark.parametrize("change", ["packed", "lora"])
@pytest.mark.parametrize("kind", ["gdn-interleaved", "gdn-segmented"])
def test_a_packed_or_adapted_projection_runs_apart(kind: str, change: str, monkeypatch):
    """An FP8/INT4 packed in_proj_qkvz (its weight replaced, a `quant` set) or a LoRA delta
    on it: both projections run as their layers, in_proj_ba gets its own storage after
    load (settle_all), and the outputs are those of the layers apart."""
    joined, apart = _joined_and_apart(kind, torch.float32)
    qkvz, ba = joined.in_proj_qkvz, joined.in_proj_ba
    dense = qkvz.weight.detach().clone()
    calls: list[int] = []
    if change == "packed":  # (as fast_path._install: the packed matmul; an empty weight)
        qkvz.quant = lambda x: torch.nn.functional.linear(x, dense)
        qkvz.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    else:
        class Delta:
            def apply(self, x, y):
                calls.append(1)
        qkvz.lora = Delta()
    assert joined.in_proj.joined_weight() is None
    assert settle_all(joined) == 1
    if change == "packed":
        assert ba.weight.untyped_storage().nbytes() == ba.weight.numel() * 4
    shapes = _count_matmuls(monkeypatch)
    hidden = torch.randn(2, HIDDEN)
    with torch.no_grad():
        (x1, rest1), (x2, rest2) = joined.conv_input(hidden), apart.conv_input(hidden)
    assert [s[0] for s in shapes].count(ba.weight.shape[0]) == 2  # ba apart in both
    # (the stand-in packed matmul is F.linear, not the dense layers' kernel: rounding apart)
    torch.testing.assert_close(x1, x2)
    for a, b in zip(rest1, rest2):
        torch.testing.assert_close(a, b)
    assert calls == ([1] if change == "lora" else [])


SHIPPED = ("qwen3.5-35b-a3b", "qwen3.5-27b", "qwen3-next-80b-a3b-24layers",
           "kimi-linear-48b-a3b-16layers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's choice per shape")
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_shapes_on_cuda_give_the_layers_apart_outputs(name: str):
    """bf16 at batch 1 and 4 on the GPU: cuBLAS may pick another kernel for the joined shape
    than for either projection, so bit equality is not promised there; the joined outputs
    must agree to a bf16 rounding and the count of differing values is printed (-s)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    root = Path(__file__).resolve().parents[2] / "shoal" / "model_configs" / name
    raw = json.loads((root / "config.json").read_text())
    raw = raw.get("text_config", raw)
    cfg = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                     if k not in ("model_type", "architectures")})
    layers = []
    with torch.device("cuda"):
        for _ in range(2):
            layers.append(KimiDeltaAttention(cfg, torch.bfloat16) if raw["model_type"] == "kimi_linear"
                          else GatedDeltaNet(cfg, torch.bfloat16,
                                             interleaved=raw["model_type"] == "qwen3_next"))
    joined, apart = layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in joined.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.02)
        apart.load_state_dict(joined.state_dict())
        second = apart.in_proj.second
        second.weight.data = second.weight.data.clone()
        assert joined.in_proj.joined_weight() is not None
        assert apart.in_proj.joined_weight() is None
        for rows in (1, 4):
            hidden = torch.randn(rows, cfg.hidden_size, generator=gen, device="cuda",
                                 dtype=torch.bfloat16)
            (x1, rest1), (x2, rest2) = joined.conv_input(hidden), apart.conv_input(hidden)
            for a, b in zip((x1, *rest1), (x2, *rest2)):
                print(f"{name} rows {rows}: {(a != b).sum().item()} of {a.numel()} differ")
                torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("nk, r", [(1, 1), (2, 2), (3, 4)])
def test_segment_order_puts_qwen3_next_outputs_in_qwen35_order(nk: int, r: int):
    """gated_delta_net.segment_order: Qwen3-Next's interleaved in_proj_qkvz | in_proj_ba
    outputs gathered into q | k | v | z | b | a, each part what splitting every key head's
    group gives (the order the rest of the layer reads)."""
    dk, dv, t = 3, 2, 2
    qkvz = torch.randn(t, nk * (2 * dk + 2 * r * dv))
    ba = torch.randn(t, nk * 2 * r)
    q, k, v, z = qkvz.view(t, nk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
    b, a = ba.view(t, nk, 2 * r).split([r, r], dim=-1)
    want = torch.cat([p.reshape(t, -1) for p in (q, k, v, z, b, a)], dim=-1)
    order = gated_delta_net.segment_order(nk, r, dk, dv)
    assert sorted(order.tolist()) == list(range(want.shape[1]))  # a permutation
    assert torch.equal(torch.cat([qkvz, ba], dim=-1).index_select(-1, order), want)
