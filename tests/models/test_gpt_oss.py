"""gpt-oss against transformers 5 on a tiny random checkpoint (4 layers alternating a 6-token
sliding window with full attention, attention sinks, 4 experts top-2 with biases and the
clamped SwiGLU, YaRN), saved both in transformers' dequantized layout and packed in MXFP4 as
the released checkpoints are, through the whole engine on the CPU; plus MXFP4 unpacking
against transformers' own, one MoE block against transformers', the KV cache groups, the
Triton backend (sinks in its kernels, rotary fused into the cache write; the interpreter on
the CPU), the shipped 20B config and a two-rank tensor-parallel split."""

from __future__ import annotations

import os

import torch

# triton.jit reads TRITON_INTERPRET when a kernel is defined: set it before the engine
# imports the kernel modules (it does so lazily, when the Triton backend is chosen).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from gloo_harness import load_tp_model, prompt_logits, run_on_two_ranks  # noqa: E402
from gpt_oss_oracle import follow_config_swiglu  # noqa: E402
from oracle import hf_greedy, randomize_weights  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.core.kv_cache_spec import group_layers  # noqa: E402
from shoal.layers.quantization.mxfp4 import dequantize_mxfp4  # noqa: E402
from shoal.loader import load_model  # noqa: E402
from shoal.models.gpt_oss import GptOssForCausalLM  # noqa: E402
from shoal.models.registry import resolve_model_class  # noqa: E402
from shoal.worker.kv_cache_tensors import layer_specs  # noqa: E402

WINDOW = 6
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            # a limit the random activations reach, so the clamps matter
            swiglu_limit=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64})
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def tiny_config():
    return AutoConfig.for_model("gpt_oss", **TINY, architectures=["GptOssForCausalLM"])


# ---- an MXFP4 packer (the checkpoints' format, written independently of shoal's reader) -----

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1 = torch.cat([_E2M1, -_E2M1])  # code 8 + c is -value(c)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] -> blocks [..., C / 32, 16] uint8 and scales [..., C / 32] uint8: each block
    of 32 scaled by the power of two that brings its largest magnitude to at most 6, values
    rounded to the nearest e2m1 code, the even element of a pair in the low nibble."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0))
    codes = (blocks / torch.exp2(exp)[..., None]).unsqueeze(-1).sub(_E2M1).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    """(dequantized checkpoint, MXFP4 checkpoint, transformers' model): the experts hold the
    values MXFP4 can represent, so both checkpoints are the same model."""
    root = tmp_path_factory.mktemp("gpt-oss")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).eval()
    follow_config_swiglu(hf, hf.config)
    randomize_weights(hf)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.5)  # some heads' sinks matter, some do not
            elif name.endswith(("_proj_bias", "router.bias")):
                p.normal_(0, 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = pack_mxfp4(p.transpose(1, 2))  # stored [E, out, in]
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            else:
                continue
    dense = root / "dense"
    hf.save_pretrained(dense, safe_serialization=True)
    mxfp4 = root / "mxfp4"
    mxfp4.mkdir()
    state = {n: t for n, t in hf.state_dict().items()
             if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, str(mxfp4 / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    (mxfp4 / "config.json").write_text(json.dumps({**config,
                                                   "quantization_config": MXFP4_CONFIG}))
    return dense, mxfp4, hf


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def _check_against_transformers(hf, prompts: list[list[int]], outs, n: int) -> None:
    for p, o in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, p, n)
        got = o.outputs[0]
        assert got.token_ids == ref
        for step, (tok, lg) in enumerate(zip(got.token_ids, ref_logits)):
            want = torch.log_softmax(lg, -1)[tok].item()
            assert got.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("layout", ["dense", "mxfp4"])
def test_greedy_matches_transformers(tiny, layout: str):
    """A prompt alone, then a batch of different lengths under a small token budget (chunked
    prefill, decodes beside prefill chunks, contexts past the window) that also repeats the
    first prompt's prefix (a prefix-cache hit)."""
    dense, mxfp4, hf = tiny
    llm = LLM(model=str(dense if layout == "dense" else mxfp4), dtype="float32",
              max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=256,
              max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    first = _prompts(1, seed=3)[0] + list(range(100, 120))
    alone = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    _check_against_transformers(hf, [first], alone, 10)
    batch = _prompts(4, seed=4) + [first[:24] + [7, 8, 9]]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    _check_against_transformers(hf, batch, outs, 10)
    assert outs[-1].num_cached_tokens >= 16  # the shared prefix came from the cache


def test_triton_backend_matches_the_torch_backend(tiny):
    """The GPU path: sinks in the Triton decode and prefill kernels, rotary fused into the
    cache write, both cache groups; eager steps (CUDA graphs: tests/worker)."""
    pytest.importorskip("triton")
    dense, _, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=128, max_model_len=128, enforce_eager=True)
    ref = LLM(model=str(dense), attention_backend="torch", **kw).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(model=str(dense), attention_backend="triton", **kw)
    assert llm.llm_engine.core.runner.backend.fuses_rope_and_cache_write
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step, tok in enumerate(a.outputs[0].token_ids):
            assert b.outputs[0].logprobs[step][tok].logprob == pytest.approx(
                a.outputs[0].logprobs[step][tok].logprob, abs=1e-4)


def test_mixed_sliding_and_full_layers_get_two_cache_groups():
    with torch.device("meta"):
        model = GptOssForCausalLM(tiny_config(), torch.float32)
    layers = model.attention_layers()
    assert [a.sliding_window for a in layers] == [WINDOW, None, WINDOW, None]
    groups = group_layers(layer_specs(layers, torch.float32))
    assert [(g.layers, g.sliding_window) for g in groups] == [((1, 3), None), ((0, 2), WINDOW)]


def test_mxfp4_unpacking_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 6, 4), dtype=torch.uint8, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 6]
        got = dequantize_mxfp4(blocks, scales, dtype)  # [3, 6, 128], the stored orientation
        assert got.dtype == dtype and torch.equal(got, want.transpose(1, 2))
    # The loader hands tensors over as float32: bytes survive the round trip.
    assert torch.equal(dequantize_mxfp4(blocks.float(), scales.float(), torch.float32),
                       dequantize_mxfp4(blocks, scales, torch.float32))
    # The test's packer: off by at most half the widest e2m1 gap (2) times the block's scale
    # (< amax / 3), and exact on values MXFP4 represents.
    w = torch.randn(5, 64, generator=gen)
    back = dequantize_mxfp4(*pack_mxfp4(w), torch.float32)
    amax = w.reshape(5, 2, 32).abs().amax(-1, keepdim=True)
    assert ((back - w).reshape(5, 2, 32).abs() <= amax / 3 + 1e-6).all()
    assert torch.equal(dequantize_mxfp4(*pack_mxfp4(back), torch.float32), back)
    with pytest.raises(ValueError, match="must be"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_moe_block_matches_transformers():
    """Router (top-k of biased logits, softmaxed), expert biases and the clamped SwiGLU."""
    cfg = tiny_config()
    torch.manual_seed(1)
    hf = follow_config_swiglu(GptOssMLP(cfg).eval(), cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GptOssForCausalLM(cfg, torch.float32)
    prefix = "model.layers.0.mlp."
    loaded = ours.load_weights((prefix + k, v) for k, v in hf.state_dict().items())
    assert loaded == {prefix + n for n in ("router.weight", "router.bias", "experts.w13_weight",
                                           "experts.w13_bias", "experts.w2_weight",
                                           "experts.w2_bias")}
    x = torch.randn(9, cfg.hidden_size) * 3
    with torch.no_grad():
        want = hf(x[None])[0][0]
        torch.testing.assert_close(ours.model.layers[0].mlp(x), want, atol=1e-5, rtol=1e-5)


def test_both_layouts_load_the_same_parameters(tiny):
    dense, mxfp4, _ = tiny
    models = []
    for folder in (dense, mxfp4):
        loaded = load_model(str(folder))
        model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32)
        assert model.load_weights(loaded.weights()) == {n for n, _ in model.named_parameters()}
        models.append(model)
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), n


def test_an_unpaired_mxfp4_tensor_is_an_error(tiny):
    _, mxfp4, _ = tiny
    loaded = load_model(str(mxfp4))
    model = GptOssForCausalLM(loaded.hf_config, torch.float32)
    weights = ((n, t) for n, t in loaded.weights() if not n.endswith("down_proj_scales"))
    with pytest.raises(ValueError, match="without their blocks or scales"):
        model.load_weights(weights)


def test_shipped_gpt_oss_20b_config():
    loaded = load_model("openai/gpt-oss-20b", load_format="dummy")
    cfg = loaded.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_local_experts,
            cfg.num_experts_per_tok, cfg.sliding_window) == (24, 2880, 32, 4, 128)
    cls = resolve_model_class(cfg)
    assert cls is GptOssForCausalLM
    with torch.device("meta"):
        model = cls(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embedding = model.model.embed_tokens.weight.numel()
    active = total - experts * (32 - 4) // 32 - embedding
    # OpenAI's model card: 20.9B in all, 3.6B active per token (the unembedding counted, the
    # embedding table, a lookup, not).
    assert total / 1e9 == pytest.approx(20.9, abs=0.1)
    assert active / 1e9 == pytest.approx(3.6, abs=0.1)
    windows = [a.sliding_window for a in model.attention_layers()]
    assert windows == [128, None] * 12


# ---- tensor parallel ---------------------------------------------------------------------


def _logits_and_sinks(path: str) -> tuple[torch.Tensor, int]:
    """The prompt's logits on whatever TP group is initialised, and this rank's sinks."""
    model = load_tp_model(path)
    return prompt_logits(model), model.model.layers[0].self_attn.sinks.shape[0]


def test_two_rank_split_matches_one_rank(tiny):
    """Heads (and their sinks) and every expert's intermediate dim split over two ranks; the
    down-projection biases are added once."""
    dense, _, _ = tiny
    expected, heads = _logits_and_sinks(str(dense))
    got, rank_heads = run_on_two_ranks(_logits_and_sinks, str(dense))
    assert rank_heads * 2 == heads
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
