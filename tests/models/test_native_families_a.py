"""shoal's own classes for Mixtral, Phi-3 (partial rotary, LongRoPE), Granite, GraniteMoe and
SmolLM3 against transformers on tiny random checkpoints (fp32), through the whole engine on
the CPU: a mixed batch prefilled in chunks beside decodes, then prompts that hit the first
batch's cached blocks; greedy tokens equal transformers' and their logprobs agree within
1e-4. Each config carries its family's own feature: MoE routing (renormalized top-2 of 4),
Phi-3's half-rotary heads with LongRoPE past original_max_position_embeddings, Granite's four
multipliers (and attention biases), SmolLM3's NoPE layer. The Transformers backend gives the
native Granite's tokens; LongRoPE's two factor sets are transformers' frequencies."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from oracle import check_against_hf, randomize_weights
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shoal import LLM, SamplingParams
from shoal.layers.rotary import RotaryEmbedding, rope_parameters
from shoal.loader.build import check_all_loaded
from shoal.models.registry import resolve_model_class

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
GRANITE = dict(embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1,
               logits_scaling=2.0, attention_bias=True)
ORIGINAL = 16  # Phi-3's original_max_position_embeddings: every test prompt is longer
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.2, 1.6, 2.0], "long_factor": [1.1, 2.5, 6.0, 14.0]}

# architecture -> (model_type, config fields)
FAMILIES = {
    "MixtralForCausalLM": ("mixtral", MOE),
    "Phi3ForCausalLM": ("phi3", dict(rope_parameters=LONGROPE,
                                     original_max_position_embeddings=ORIGINAL)),
    "GraniteForCausalLM": ("granite", GRANITE),
    "GraniteMoeForCausalLM": ("granitemoe", {**GRANITE, **MOE, "attention_bias": False}),
    "SmolLM3ForCausalLM": ("smollm3", dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1],
                                           tie_word_embeddings=True)),
}
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=256, max_model_len=128)
STEPS = 8


def _config(arch: str):
    model_type, fields = FAMILIES[arch]
    return AutoConfig.for_model(model_type, **{**COMMON, **fields}, architectures=[arch])


def _prompts(seed: int) -> list[list[int]]:
    """Four prompts of 17..40 tokens (past Phi-3's original context), then three that start
    with a cached prefix of the first ones."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 256) for _ in range(n)] for n in (17, 23, 31, 40)]
    again = [p[:n] + [rng.randrange(3, 256) for _ in range(4)]
             for p, n in zip(first[1:], (20, 24, 36))]
    return first + again


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """arch -> (checkpoint, transformers model, prompts, shoal's outputs), built once."""
    runs: dict[str, tuple] = {}

    def get(arch: str) -> tuple:
        if arch not in runs:
            path = tmp_path_factory.mktemp(arch)
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()
            randomize_weights(hf)
            hf.save_pretrained(path)
            llm = LLM(model=str(path), **ENGINE)
            assert type(llm.llm_engine.core.runner.model).__name__ == arch  # not the backend
            prompts = _prompts(seed=3)
            params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                                    logprobs=1)
            outs = []
            for batch in (prompts[:4], prompts[4:]):  # mixed and chunked; then prefix hits
                outs += llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                     use_tqdm=False)
            runs[arch] = path, hf, prompts, outs
        return runs[arch]

    return get


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_greedy_matches_transformers_with_chunks_and_prefix_hits(arch: str, run) -> None:
    _, hf, prompts, outs = run(arch)
    check_against_hf(outs, prompts, hf, STEPS)
    assert all(o.num_cached_tokens >= 16 for o in outs[4:]), [o.num_cached_tokens for o in outs]


def test_the_configs_carry_the_features() -> None:
    """What the comparisons rely on: a test that cannot see a feature cannot fail on it."""
    phi = _config("Phi3ForCausalLM")
    theta, scaling = rope_parameters(phi)
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == ORIGINAL < min(map(len, _prompts(3)))
    assert scaling["factor"] == phi.max_position_embeddings / ORIGINAL
    model = resolve_model_class(phi)(phi, torch.float32, use_triton_ops=False)
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.rot_dim == 8 < rope.head_dim and rope.attention_factor > 1
    smol = resolve_model_class(_config("SmolLM3ForCausalLM"))(
        _config("SmolLM3ForCausalLM"), torch.float32, use_triton_ops=False)
    assert [layer.self_attn.rotary_emb is not None for layer in smol.model.layers] == [
        True, False, True]
    granite = _config("GraniteForCausalLM")
    model = resolve_model_class(granite)(granite, torch.float32, use_triton_ops=False)
    attn = model.model.layers[0].self_attn
    assert attn.attn.scale == 0.1 != attn.head_dim ** -0.5
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "GraniteMoeForCausalLM"])
def test_both_checkpoint_layouts_load_the_same_weights(arch: str, run) -> None:
    """The checkpoint's names (per-expert w1/w2/w3, GraniteMoe's input/output_linear and
    router.layer) and transformers 5's in-memory ones (experts stacked) fill the same values."""
    path, hf, _, _ = run(arch)
    cfg = _config(arch)
    cls = resolve_model_class(cfg)
    from_memory = cls(cfg, torch.float32, use_triton_ops=False)
    check_all_loaded(from_memory, from_memory.load_weights(hf.state_dict().items()), arch)
    from safetensors.torch import load_file

    on_disk = load_file(Path(path) / "model.safetensors")
    assert set(on_disk) != set(hf.state_dict())  # two layouts indeed
    from_disk = cls(cfg, torch.float32, use_triton_ops=False)
    check_all_loaded(from_disk, from_disk.load_weights(on_disk.items()), arch)
    for (name, a), (_, b) in zip(from_memory.named_parameters(), from_disk.named_parameters()):
        assert torch.equal(a, b), name


def test_transformers_backend_gives_the_native_tokens(run) -> None:
    path, _, prompts, outs = run("GraniteForCausalLM")
    llm = LLM(model=str(path), model_impl="transformers", **ENGINE)
    assert type(llm.llm_engine.core.runner.model).__name__ == "TransformersForCausalLM"
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("context", [ORIGINAL, 128])
def test_longrope_tables_are_transformers_frequencies(context: int) -> None:
    """Within the original context the short factors rotate, past it the long ones
    (transformers' choice for a sequence of that length); both scaled by the attention
    factor sqrt(1 + ln(128 / 16) / ln(16))."""
    cfg = _config("Phi3ForCausalLM")
    theta, scaling = rope_parameters(cfg)
    rope = RotaryEmbedding(16, context, theta, scaling, rot_dim=8, use_triton_ops=False)
    inv, attention = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=context)
    assert attention == pytest.approx(math.sqrt(1 + math.log(8) / math.log(ORIGINAL)))
    assert rope.attention_factor == pytest.approx(attention)
    freqs = torch.outer(torch.arange(context, dtype=torch.float64), inv.double())
    want = torch.cat([freqs.cos(), freqs.sin()], -1) * attention
    torch.testing.assert_close(rope.cos_sin_cache.double(), want, atol=1e-6, rtol=0)


def test_longrope_factors_must_match_the_rotary_dims() -> None:
    cfg = _config("Phi3ForCausalLM")
    theta, scaling = rope_parameters(cfg)
    with pytest.raises(ValueError, match="longrope long_factor must be a list of 8 numbers"):
        RotaryEmbedding(32, 128, theta, scaling, rot_dim=16, use_triton_ops=False)
