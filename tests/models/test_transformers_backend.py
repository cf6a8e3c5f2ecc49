"""The Transformers modeling backend (shoal/models/transformers_backend) on the decoder
architectures of tests/transformers_archs.py, through the whole engine on the CPU: greedy
tokens equal transformers' own generate in mixed chunked batches and after prefix-cache hits;
where shoal has its own class, the backend and the class agree; what the backend cannot run
is refused at start-up with the reason; model_impl picks the path."""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from oracle import TINY_COMMON, write_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers_archs import ARCHS, Arch

from shoal import LLM, SamplingParams
from shoal.loader.build import check_all_loaded
from shoal.models.interface import CausalLM
from shoal.models.registry import resolve_model_class, uses_transformers_backend

NEW_TOKENS = 6
# a small budget: prompts prefill in chunks, beside other requests' decodes
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=256, max_model_len=128)


def _config(model_type: str, **fields):
    """The tiny config as its checkpoint names it (architectures: transformers' class)."""
    cfg = AutoConfig.for_model(model_type, **{**TINY_COMMON, **fields})
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return cfg


def _native(arch: Arch) -> bool:
    """shoal has its own class for the architecture (registry.py)."""
    return not uses_transformers_backend(_config(arch.model_type, **arch.fields))


def _param(arch: Arch):
    marks = [pytest.mark.xfail(reason=arch.xfail, strict=True)] if arch.xfail else []
    return pytest.param(arch, id=arch.name, marks=marks)


RUNS = [_param(a) for a in ARCHS if a.refused is None]
NATIVE_RUNS = [_param(a) for a in ARCHS if a.refused is None and _native(a)]
REFUSED = [_param(a) for a in ARCHS if a.refused is not None]


def test_the_list() -> None:
    """At least 30 decoder architectures run (VaultGemma among them), each name once."""
    assert len({a.name for a in ARCHS}) == len(ARCHS)
    assert len({a.model_type for a in ARCHS if a.passes}) >= 30
    assert {"vaultgemma-no-softcap", "vaultgemma"} <= {a.name for a in ARCHS}
    native = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[p.values[0].model_type] for p in NATIVE_RUNS}
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM"} <= native


@dataclass
class Run:
    """One architecture's checkpoint, prompts, and the backend's and transformers' tokens."""

    path: Path
    prompts: list[list[int]]
    backend: list[list[int]]
    reference: list[list[int]]
    cached_tokens: list[int]


def _prompts(seed: int) -> list[list[int]]:
    """Four prompts of 1..30 tokens, then each of the longer ones again with a new tail: the
    second batch starts from the first batch's cached blocks."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 23, 30)]
    again = [p[:n] + [rng.randrange(3, 500) for _ in range(5)]
             for p, n in zip(first[1:], (8, 20, 26))]
    return first + again


def _transformers_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: never stop early
    greedy = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), generation_config=greedy)[0, len(p):].tolist()
                for p in prompts]


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def backend_run(tmp_path_factory):
    """arch -> its Run (each architecture built and run once per module)."""
    runs: dict[str, Run] = {}

    def run(arch: Arch) -> Run:
        if arch.name not in runs:
            path = write_tiny_checkpoint(tmp_path_factory.mktemp(arch.name), arch.model_type,
                                         seed=1, **arch.fields)
            prompts = _prompts(seed=3)
            llm = LLM(model=str(path), model_impl="transformers", **ENGINE)
            first = _generate(llm, prompts[:4])  # one mixed, chunked batch
            again = _generate(llm, prompts[4:])  # prefix-cache hits on the first's blocks
            outs = first + again
            runs[arch.name] = Run(path, prompts, [o.outputs[0].token_ids for o in outs],
                                  _transformers_greedy(path, prompts),
                                  [o.num_cached_tokens for o in outs])
        return runs[arch.name]

    return run


@pytest.mark.parametrize("arch", RUNS)
def test_greedy_tokens_match_transformers(arch: Arch, backend_run) -> None:
    run = backend_run(arch)
    for prompt, got, want in zip(run.prompts, run.backend, run.reference):
        assert got == want, f"{arch.name}: prompt of {len(prompt)} tokens"
    assert all(n >= 8 for n in run.cached_tokens[4:]), run.cached_tokens  # hits happened


@pytest.mark.parametrize("arch", NATIVE_RUNS)
def test_backend_and_native_class_agree(arch: Arch, backend_run) -> None:
    if arch.native_xfail:
        pytest.xfail(arch.native_xfail)
    run = backend_run(arch)
    native = LLM(model=str(run.path), model_impl="shoal", **ENGINE)
    tokens = [o.outputs[0].token_ids for o in _generate(native, run.prompts)]
    assert tokens == run.backend


@pytest.mark.parametrize("arch", REFUSED)
def test_unsupported_models_are_refused_at_start_up(arch: Arch, tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path, arch.model_type, seed=1, **arch.fields)
    with pytest.raises(ValueError, match=arch.refused):
        LLM(model=str(path), model_impl="transformers", **ENGINE)


def test_speculative_verify_steps(tmp_path, monkeypatch) -> None:
    """Verify steps (several query tokens per running request, some drafts rejected) over
    sliding-window layers give transformers' tokens."""
    from oracle import draft_continuations

    path = write_tiny_checkpoint(tmp_path, "gemma3_text", seed=1, head_dim=16, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"])
    prompts = _prompts(seed=5)[:4]
    refs = _transformers_greedy(path, prompts)
    draft_continuations(monkeypatch, {tuple(p): r for p, r in zip(prompts, refs)})
    llm = LLM(model=str(path), model_impl="transformers",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == refs


def test_soft_capped_model_on_the_triton_backend(tmp_path) -> None:
    """Gemma 2's attention soft-cap reaches the Triton kernels through the backend (the
    interpreter on the CPU, so a tinier model than the others): prompts past the window in
    chunks beside decodes give transformers' tokens and logprobs, which a dropped cap would
    move."""
    from oracle import check_against_hf

    from shoal.models.transformers_backend.model import TransformersForCausalLM

    path = write_tiny_checkpoint(
        tmp_path, "gemma2", seed=1, vocab_size=128, hidden_size=32, intermediate_size=48,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        attn_logit_softcapping=2.0, max_position_embeddings=64, architectures=[
            "Gemma2ForCausalLM"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[(5 * i) % 120 + 3 for i in range(11)], [7, 9, 11]]
    with torch.no_grad():  # the cap moves these logits: running without it would fail
        ids = torch.tensor(prompts[:1])
        capped = torch.log_softmax(hf(ids).logits, -1)
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert (torch.log_softmax(hf(ids).logits, -1) - capped).abs().max() > 1e-2
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = 2.0
    llm = LLM(model=str(path), model_impl="transformers", device="cpu", dtype="float32",
              attention_backend="triton", max_num_batched_tokens=8, block_size=4,
              num_gpu_blocks_override=32, max_model_len=32, enforce_eager=True)
    runner = llm.llm_engine.core.runner
    assert isinstance(runner.model, TransformersForCausalLM) and runner.backend.name == "triton"
    assert [layer.softcap for layer in runner.model.attention_layers()] == [2.0, 2.0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 3)


def test_a_backend_without_soft_capping_is_refused_when_bound() -> None:
    """Off the CPU the capped model is built (no refusal by device any more); its layers
    refuse a backend that cannot cap (the runner binds it at start-up), saying so; uncapped
    ones take it."""
    from shoal.attention.torch_backend import TorchAttentionBackend
    from shoal.models.transformers_backend.attention import probe_attention
    from shoal.models.transformers_backend.model import TransformersForCausalLM, paged_layers

    class NoCap(TorchAttentionBackend):
        name = "nocap"
        supports_softcap = False

    cfg = _config("gemma2", head_dim=16, attn_logit_softcapping=2.0)
    capped = TransformersForCausalLM(cfg, torch.float32)
    with torch.no_grad():
        calls = probe_attention(lambda: capped._run(torch.zeros(2, dtype=torch.long),
                                                    torch.arange(2)))
    with torch.device("meta"):  # as on a GPU: layers are built where the model is
        assert [a.softcap for a in paged_layers(calls, cfg, "Gemma2")] == [2.0, 2.0]
    for layer in capped.attention_layers():
        with pytest.raises(NotImplementedError, match="the nocap attention backend has no "
                                                      "attention soft-capping"):
            layer.backend = NoCap()
    plain = TransformersForCausalLM(_config("gemma2", head_dim=16, attn_logit_softcapping=None),
                                    torch.float32)
    for layer in plain.attention_layers():
        layer.backend = NoCap()


# ---- model_impl ------------------------------------------------------------------------------

def test_model_impl_picks_the_path() -> None:
    llama, phi = _config("llama"), _config("phi")
    assert resolve_model_class(llama).__name__ == "LlamaForCausalLM"  # auto: the native class
    assert resolve_model_class(phi).__name__ == "TransformersForCausalLM"  # auto: no class
    assert resolve_model_class(llama, model_impl="transformers").__name__ == (
        "TransformersForCausalLM")
    assert not uses_transformers_backend(llama, "pooling", "auto")
    with pytest.raises(ValueError, match=r"unsupported model architecture \['PhiForCausalLM'\]"):
        resolve_model_class(phi, model_impl="shoal")  # the registry's own error
    with pytest.raises(ValueError, match="model_impl must be one of auto, shoal, transformers"):
        resolve_model_class(llama, model_impl="hf")
    # pooling: the backend embeds too (tests/models/test_transformers_backend_pooling.py)
    assert resolve_model_class(llama, "pooling", "transformers").__name__ == (
        "TransformersForCausalLM")
    assert uses_transformers_backend(phi, "pooling", "auto")
    with pytest.raises(ValueError, match="it is an encoder-decoder model"):
        resolve_model_class(AutoConfig.for_model("t5"), model_impl="transformers")
    falcon = _config("falcon")
    with pytest.raises(ValueError, match="shoal has no class of its own for it .* and the "
                                         "Transformers backend cannot run it: its modeling"):
        resolve_model_class(falcon)


def test_model_impl_flag() -> None:
    from shoal.entrypoints.cli_args import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args_from(parser.parse_args([])).model_impl == "auto"
    ns = parser.parse_args(["--model-impl", "transformers"])
    assert engine_args_from(ns).model_impl == "transformers"


def test_start_up_log_names_the_path(tmp_path, caplog) -> None:
    path = write_tiny_checkpoint(tmp_path, "phi", seed=1)
    with caplog.at_level(logging.INFO, logger="shoal.loader.build"):
        LLM(model=str(path), **ENGINE)  # auto
    assert "model PhiForCausalLM loaded" in caplog.text
    assert "the Transformers backend" in caplog.text


# ---- the class itself -----------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_class_follows_the_interface(tied: bool) -> None:
    from shoal.models.transformers_backend.model import TransformersForCausalLM

    cfg = _config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, tie_word_embeddings=tied)
    model = TransformersForCausalLM(cfg, torch.float32)
    assert isinstance(model, CausalLM) and model.tie_word_embeddings == tied
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # transformers' own names, once each
    assert dict(model.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    assert set(model.state_dict()) <= set(hf.state_dict())
    # the checkpoint's names (MoE experts one tensor each, as stored) fill every parameter
    from transformers.core_model_loading import revert_weight_conversion

    stored = revert_weight_conversion(hf, hf.state_dict())
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored
    if tied:
        stored.pop("lm_head.weight", None)
    check_all_loaded(model, model.load_weights(stored.items()), "tiny")
    assert torch.equal(model.hf_model.model.layers[0].mlp.experts.gate_up_proj,
                       hf.model.layers[0].mlp.experts.gate_up_proj)
    layers = model.attention_layers()
    assert [(a.num_heads, a.num_kv_heads, a.head_dim) for a in layers] == [(4, 2, 16)] * 2
    with pytest.raises(ValueError, match="has no matching parameter"):
        model.load_weights([("model.nothing.weight", torch.zeros(1))])
