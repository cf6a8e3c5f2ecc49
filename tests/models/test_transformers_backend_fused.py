"""The Transformers backend's fused modules (packed_linear.py, fused_modules.py, rotary.py):
a Llama decode step runs fewer ops per decoder layer than transformers' own modules do;
weight updates and sleep reach the packed projections; only modules whose forward is the
standard formula are swapped; packed members and the short rotary fall back outside their
case."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shoal import LLM, SamplingParams
from shoal.layers.norm import RMSNorm
from shoal.models.transformers_backend import model as backend_model
from shoal.models.transformers_backend.fused_modules import (
    FusedModules,
    fuse_gated_mlps,
    swap_rms_norms,
)
from shoal.models.transformers_backend.packed_linear import (
    PackedMemberLinear,
    linear_inputs,
    pack_shared_input_linears,
)
from shoal.models.transformers_backend.rotary import ShortRope, _same_as_rotate_half

ENGINE = dict(model_impl="transformers", max_model_len=64, block_size=4,
              num_gpu_blocks_override=64, enforce_eager=True)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [300, 9]]
# ops that launch nothing (views, no-op casts) or only allocate
_FREE = {"view", "_unsafe_view", "transpose", "unsqueeze", "squeeze", "slice", "split", "t",
         "expand", "as_strided", "detach", "alias", "permute", "select", "split_with_sizes",
         "unbind", "narrow", "reshape", "lift_fresh", "empty", "empty_like"}


class _LayerOps(TorchDispatchMode):
    """Counts the ops that run while `on` (set by hooks around one decoder layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.ops = False, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).split(".")[-1]
        free = name in _FREE or (name in ("to", "contiguous") and out is args[0])
        if self.on and not free:
            self.ops[name] += 1
        return out


def _decode_layer_ops(path, dtype: str) -> Counter:
    """The ops of decoder layer 1 in the first one-token (decode) step."""
    llm = LLM(model=str(path), dtype=dtype, **ENGINE)
    try:
        model = llm.llm_engine.core.runner.model
        layer = model.hf_model.model.layers[1]
        mode, counts = _LayerOps(), []
        forward = model.forward

        def counted(input_ids, positions, md):
            if input_ids.numel() != 1 or counts:
                return forward(input_ids, positions, md)
            with mode:
                out = forward(input_ids, positions, md)
            counts.append(mode.ops)
            return out

        def on(*_):
            mode.on = True

        def off(*_):
            mode.on = False
        layer.register_forward_pre_hook(on)
        layer.register_forward_hook(off)
        model.forward = counted
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        return counts[0]
    finally:
        llm.shutdown()


def _unfused(monkeypatch) -> None:
    monkeypatch.setattr(backend_model, "fuse_modules", lambda hf, inputs: FusedModules())
    monkeypatch.setattr(backend_model, "shorten_rotary", lambda modules, like: [])
    for module in list(sys.modules.values()):  # a fused build installed them
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if isinstance(fn, ShortRope):
            monkeypatch.setattr(module, "apply_rotary_pos_emb", fn.original)


def test_a_llama_decode_step_runs_fewer_ops_per_layer(tmp_path, monkeypatch) -> None:
    path = write_tiny_checkpoint(tmp_path, "llama", seed=3)
    after = _decode_layer_ops(path, "bfloat16")
    with monkeypatch.context() as m:
        _unfused(m)
        before = _decode_layer_ops(path, "bfloat16")
    print(f"\nops per decoder layer: transformers' modules {sum(before.values())} "
          f"{dict(before)}\nfused {sum(after.values())} {dict(after)}")
    assert before["linear"] == 7 and after["linear"] == 4  # q/k/v and gate/up packed
    assert before["rsqrt"] == 2 and after["rsqrt"] == 0 and after["rms_norm"] == 2
    assert after["silu_and_mul"] == 1 and after["silu"] == 0
    assert before["neg"] == 2 and after["neg"] == 0 and after["cat"] == 0  # rotate-half
    assert sum(after.values()) <= sum(before.values()) - 20


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_weight_updates_and_sleep_reach_the_packed_projections(tmp_path, monkeypatch) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", "qwen2", seed=0)  # (q/k/v biases packed too)
    b = write_tiny_checkpoint(tmp_path / "b", "qwen2", seed=1)
    with monkeypatch.context() as m:  # transformers' own modules: the reference tokens
        _unfused(m)
        want = {}
        for name, path in (("a", a), ("b", b)):
            llm = LLM(model=str(path), dtype="float32", **ENGINE)
            want[name] = _tokens(llm)
            llm.shutdown()
    assert want["a"] != want["b"]
    llm = LLM(model=str(a), dtype="float32", **ENGINE)
    try:
        model = llm.llm_engine.core.runner.model
        assert ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                "model.layers.0.self_attn.v_proj"] in model.fused.packed
        assert "model.layers.0.mlp" in model.fused.mlps
        assert _tokens(llm) == want["a"]
        llm.update_weights(load_file(str(b / "model.safetensors")))
        assert _tokens(llm) == want["b"]
        llm.sleep(level=1)
        llm.wake_up()
        assert _tokens(llm) == want["b"]
        llm.update_weights_from_path(str(a))
        assert _tokens(llm) == want["a"]
    finally:
        llm.shutdown()


# ---- the pieces ---------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm, self.mlp = norm, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


class _GatedMLP(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
        self.down_proj, self.act_fn = nn.Linear(16, 8, bias=False), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _built(norm: nn.Module, act: nn.Module) -> tuple[nn.Module, list]:
    """A block with zero weights (as the builder leaves them), packed from a probe pass."""
    block = _Block(norm, _GatedMLP(act))
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
        with linear_inputs(block) as seen:
            block(torch.randn(1, 2, 8))
            packed = pack_shared_input_linears(block, seen)
    return block, packed


def test_only_standard_forms_are_swapped() -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    llama, packed = _built(modeling_llama.LlamaRMSNorm(8, eps=1e-5), nn.SiLU())
    assert packed == [["mlp.gate_proj", "mlp.up_proj"]]
    assert swap_rms_norms(llama) == ["norm"] and isinstance(llama.norm, RMSNorm)
    assert llama.norm.eps == 1e-5 and fuse_gated_mlps(llama) == ["mlp"]
    assert all(not p.any() for p in llama.parameters())  # the probe weights are gone
    gemma, _ = _built(GemmaRMSNorm(8, eps=1e-5), nn.GELU())  # x * (1 + w); GELU
    assert swap_rms_norms(gemma) == [] and fuse_gated_mlps(gemma) == []
    # loaded weights: the fused block computes what transformers' modules compute
    ref = _Block(modeling_llama.LlamaRMSNorm(8, eps=1e-5), _GatedMLP(nn.SiLU()))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
        for name, p in llama.named_parameters():
            p.copy_(ref.get_parameter(name))
    x = torch.randn(1, 3, 8)
    torch.testing.assert_close(llama(x), ref(x))


def test_packed_members_fall_back_outside_their_case() -> None:
    block, _ = _built(nn.Identity(), nn.SiLU())
    gate, up = block.mlp.gate_proj, block.mlp.up_proj
    assert isinstance(gate, PackedMemberLinear)
    with torch.no_grad():
        gate.weight.normal_()
        up.weight.normal_()  # (in place: the packed tensor)
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    torch.testing.assert_close(gate(x), x @ gate.weight.T)
    torch.testing.assert_close(up(y), y @ up.weight.T)  # another input: its own GEMM
    assert up.still_packed()
    up.weight.data = up.weight.data.clone()  # re-pointed: no longer the packed tensor's
    assert not up.still_packed()
    with torch.no_grad():
        up.weight.mul_(2)
    torch.testing.assert_close(up(x), x @ up.weight.T)


def test_short_rotary_only_inside_shoal_and_for_rotate_half() -> None:
    original = modeling_llama.apply_rotary_pos_emb
    original = original.original if isinstance(original, ShortRope) else original
    like = torch.zeros(1)
    assert _same_as_rotate_half(original, like)

    def interleaved(q, k, cos, sin):  # GPT-J's pairing: not rotate-half
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]
    assert not _same_as_rotate_half(interleaved, like)
    short = ShortRope(original)
    q, k, cos, sin = (torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16),
                      torch.randn(1, 3, 16), torch.randn(1, 3, 16))
    for got, want in zip(short(q, k, cos, sin), original(q, k, cos, sin)):
        assert torch.equal(got, want)  # outside a shoal forward: the original itself


@pytest.mark.parametrize("arch", ["gemma", "phi", "qwen3"])
def test_other_norms_and_partial_rotary_still_match(arch, tmp_path, monkeypatch) -> None:
    """Gemma (1 + w norms), Phi (partial rotary, LayerNorm), Qwen3 (q/k norms): the fused
    backend's tokens are the unfused backend's."""
    path = write_tiny_checkpoint(tmp_path, arch, seed=2)
    llm = LLM(model=str(path), dtype="float32", **ENGINE)
    got = _tokens(llm)
    llm.shutdown()
    with monkeypatch.context() as m:
        _unfused(m)
        llm = LLM(model=str(path), dtype="float32", **ENGINE)
        want = _tokens(llm)
        llm.shutdown()
    assert got == want


# ---- exactness of the swaps ---------------------------------------------------------------

class _Holder(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


def _zeroed(norm: nn.Module, dtype: torch.dtype) -> _Holder:
    """A norm as the builder leaves it: in `dtype`, weight zeros."""
    holder = _Holder(norm).to(dtype)
    with torch.no_grad():
        holder.norm.weight.zero_()
    return holder


def test_olmo2_norm_is_refused_in_bfloat16() -> None:
    """OLMo 2 rounds w * x_normed once; shoal rounds x_normed first: within 3e-2, not equal."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    for dtype in (torch.bfloat16, torch.float32):  # (a float32 model is probed in bf16 too)
        holder = _zeroed(Olmo2RMSNorm(64, eps=1e-6), dtype)
        assert swap_rms_norms(holder, [dtype]) == []
        assert isinstance(holder.norm, Olmo2RMSNorm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_llama_family_norms_are_swapped_and_exact_in_half_dtypes(arch) -> None:
    import importlib
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    cls = getattr(module, {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm",
                           "mistral": "MistralRMSNorm"}[arch])
    for dtype in (torch.bfloat16, torch.float16):
        holder = _zeroed(cls(64, eps=1e-6), dtype)
        assert swap_rms_norms(holder, [dtype]) == ["norm"]
        assert isinstance(holder.norm, RMSNorm)
        ref = cls(64, eps=1e-6).to(dtype)
        with torch.no_grad():
            holder.norm.weight.copy_(torch.rand(64) + 0.5)
            ref.weight.copy_(holder.norm.weight)
            for x in (torch.randn(7, 64), torch.randn(1, 7, 64), torch.randn(1, 2, 7, 64)):
                x = (x * 3).to(dtype)
                assert torch.equal(holder.norm(x), ref(x))
                assert holder.norm(x).dtype == ref(x).dtype == dtype


class _CastBackNorm(nn.Module):
    """Llama's norm, then its output cast back to the input's dtype: with bf16 weights the
    same as Llama's; with float32 weights bf16 where shoal's RMSNorm returns float32."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h.to(x.dtype)).to(x.dtype)


def test_float32_norm_weights_with_bf16_activations_need_the_same_output_dtype() -> None:
    cast_back = _zeroed(_CastBackNorm(64), torch.bfloat16)
    assert swap_rms_norms(cast_back, [torch.bfloat16]) == ["norm"]  # bf16 weights: Llama's
    cast_back = _zeroed(_CastBackNorm(64), torch.float32)
    assert swap_rms_norms(cast_back, [torch.bfloat16]) == []  # bf16 out, shoal's float32
    # Llama's norm returns float32 for float32 weights, as shoal's does (its torch path:
    # the CPU kernel takes one dtype)
    llama = _zeroed(modeling_llama.LlamaRMSNorm(64, eps=1e-6), torch.float32)
    assert swap_rms_norms(llama, [torch.bfloat16]) == ["norm"]
    ref = modeling_llama.LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        llama.norm.weight.copy_(torch.rand(64) + 0.5)
        ref.weight.copy_(llama.norm.weight)
        x = torch.randn(1, 7, 64).bfloat16()
        assert llama.norm(x).dtype == ref(x).dtype == torch.float32
        assert torch.equal(llama.norm(x), ref(x))


def test_short_rotary_takes_a_tensor_argument_for_no_unsqueeze_dim(monkeypatch) -> None:
    """position_ids passed positionally (one element at decode): the original runs."""
    import shoal.models.transformers_backend.rotary as rotary
    monkeypatch.setattr(rotary, "in_shoal_forward", lambda: True)
    calls = []
    original = modeling_llama.apply_rotary_pos_emb
    original = original.original if isinstance(original, ShortRope) else original

    def spy(*args, **kwargs):
        calls.append(args[4:])
        return original(*args[:4])
    short = ShortRope(spy)
    q, k, cos, sin = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16),
                      torch.randn(1, 1, 16), torch.randn(1, 1, 16))
    short(q, k, cos, sin, 1)
    short(q, k, cos, sin, unsqueeze_dim=1)
    assert calls == []  # the short path
    short(q, k, cos, sin, torch.tensor([1]))
    short(q, k, cos, sin, True)
    short(q, k, cos, sin, unsqueeze_dim=torch.tensor(1))
    assert len(calls) == 3


def test_gated_mlp_falls_back_when_only_up_proj_is_re_pointed() -> None:
    block, _ = _built(nn.Identity(), nn.SiLU())
    assert fuse_gated_mlps(block) == ["mlp"]
    mlp = block.mlp
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
        mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone()  # gate's still packed
        mlp.up_proj.weight.mul_(2)
    assert mlp.gate_proj.still_packed() and not mlp.up_proj.still_packed()
    x = torch.randn(1, 3, 8)
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    want = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton RMSNorm runs on CUDA")
def test_norm_swaps_on_cuda_go_through_triton() -> None:
    """On CUDA the probe compares against the Triton kernel: Llama's bf16 norm must still be
    swapped (at most 1% of elements one ulp apart), OLMo 2's refused, float32
    weights under bf16 activations refused (Triton writes bf16, Llama returns float32)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    h = 4096
    llama = _zeroed(modeling_llama.LlamaRMSNorm(h, eps=1e-5), torch.bfloat16).cuda()
    assert swap_rms_norms(llama, [torch.bfloat16]) == ["norm"]
    ref = modeling_llama.LlamaRMSNorm(h, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        llama.norm.weight.copy_(torch.rand(h, device="cuda") + 0.5)
        ref.weight.copy_(llama.norm.weight)
        x = (torch.randn(256, h, device="cuda") * 3).bfloat16()
        got, want = llama.norm(x), ref(x)
    differ = (got != want).float().mean().item()  # (the sum of squares' order may differ)
    assert differ <= 0.01, f"{differ:.2e} differ"
    torch.testing.assert_close(got, want, rtol=8e-3, atol=0)
    olmo = _zeroed(Olmo2RMSNorm(h, eps=1e-5), torch.bfloat16).cuda()
    assert swap_rms_norms(olmo, [torch.bfloat16]) == []
    fp32 = _zeroed(modeling_llama.LlamaRMSNorm(h, eps=1e-5), torch.float32).cuda()
    assert swap_rms_norms(fp32, [torch.bfloat16]) == []
