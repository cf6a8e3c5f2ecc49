"""LoRA and pipeline parallelism on issue 33's native families (Mixtral, Phi-3, Granite,
GraniteMoe, SmolLM3, OLMo 2, Gemma 2, GLM-4, GLM-4.5 MoE, StarCoder2, Cohere), on the tiny
random checkpoints of test_native_families_a.py and _b.py (fp32, CPU).

LoRA: a random PEFT adapter over each family's projections under the names PEFT finds in
transformers' model (Phi-3's fused qkv_proj and gate_up_proj, GLM-4's gate_up_proj,
StarCoder2's c_fc and c_proj, the MoE families' stacked experts through target_parameters),
served by the engine in one batch with base requests (chunked prefill beside decodes): each
output's greedy tokens are PEFT's model's (or the base model's) and each token's logprob is
within 1e-4. The adapter must move the logprobs (a test that cannot fail is none).

Pipeline parallelism: two gloo ranks as stages 0 and 1, each building and loading only its
layers (StageLink carries the activations, stage 0 computes the logits), decode the first
prompt greedily: the tokens are the one-stage engine's and the logprobs within 1e-4."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_harness import run_on_two_ranks

STEPS = 5
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=256, max_model_len=128)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
SWIGLU = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Family:
    arch: str
    source: str  # which test's tiny config: "a" or "b" (its FAMILIES key)
    key: str
    targets: list[str]  # PEFT target_modules
    parameters: list[str] = field(default_factory=list)  # PEFT target_parameters


FAMILIES = {f.arch: f for f in (
    Family("GraniteForCausalLM", "a", "GraniteForCausalLM", ATTN + SWIGLU),
    Family("SmolLM3ForCausalLM", "a", "SmolLM3ForCausalLM", ATTN + SWIGLU),
    Family("Olmo2ForCausalLM", "b", "olmo2", ATTN + SWIGLU),
    Family("Phi3ForCausalLM", "a", "Phi3ForCausalLM",
           ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    Family("Glm4ForCausalLM", "b", "glm4", ATTN + ["gate_up_proj", "down_proj"]),
    Family("Starcoder2ForCausalLM", "b", "starcoder2", ATTN + ["c_fc", "c_proj"]),
    Family("CohereForCausalLM", "b", "cohere", ATTN + SWIGLU),
    Family("Gemma2ForCausalLM", "b", "gemma2", ATTN + SWIGLU),
    Family("MixtralForCausalLM", "a", "MixtralForCausalLM", ATTN,
           ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    Family("GraniteMoeForCausalLM", "a", "GraniteMoeForCausalLM", ATTN,
           ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"]),
    # the dense first layer's MLP and the shared experts are gate/up/down_proj modules
    Family("Glm4MoeForCausalLM", "b", "glm4_moe", ATTN + SWIGLU,
           ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
)}


def _config(fam: Family) -> Any:
    from transformers import AutoConfig

    if fam.source == "a":
        from models.test_native_families_a import _config as config_a

        return config_a(fam.key)
    from models.test_native_families_b import COMMON
    from models.test_native_families_b import FAMILIES as B

    b = B[fam.key]
    return AutoConfig.for_model(b.model_type, **{**COMMON, **b.fields}, architectures=[b.arch])


def _prompts() -> list[list[int]]:
    """Longer than Phi-3's original context of 16 (transformers then takes LongRoPE's long
    factors, as shoal does for max_model_len 128) and than Gemma 2's and StarCoder2's window."""
    rng = random.Random(5)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (19, 26, 17)]


@dataclass
class Run:
    path: Path
    prompts: list[list[int]]
    lora: list[bool]  # which requests carry the adapter
    outs: list  # the engine's outputs, in request order
    oracles: list  # transformers' model of each request (PEFT's with the adapter)


@functools.cache
def _run(arch: str, folder: Path) -> Run:
    """The family's checkpoint and adapter, and the engine's outputs of a batch mixing them."""
    from lora.peft_adapters import peft_model, write_adapter
    from oracle import randomize_weights
    from transformers import AutoModelForCausalLM

    from shoal import LLM, SamplingParams
    from shoal.lora.request import LoRARequest

    fam = FAMILIES[arch]
    path = folder / arch
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(fam), dtype=torch.float32).eval()
    randomize_weights(hf)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # as test_native_families_b.py
                buf.uniform_(-1.0, 1.0)
    hf.save_pretrained(path)
    extra = {"target_parameters": fam.parameters} if fam.parameters else {}
    adapter = write_adapter(path, folder / f"{arch}-lora", seed=7, r=4, alpha=8,
                            targets=fam.targets, scale=0.2, **extra)
    experts = dict(lora_target_modules=["all-linear", "experts"]) if fam.parameters else {}
    llm = LLM(model=str(path), enable_lora=True, max_loras=1, max_lora_rank=8, **experts,
              **ENGINE)
    try:
        assert type(llm.llm_engine.core.runner.model).__name__ == arch  # not the backend
        p = _prompts()
        prompts, lora = [p[0], p[1], p[0], p[2]], [True, False, False, True]
        req = LoRARequest("a", 1, str(adapter))
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": x} for x in prompts], params,
                            lora_request=[req if x else None for x in lora], use_tqdm=False)
    finally:
        llm.shutdown()
    with_adapter = peft_model(path, adapter)
    return Run(path, prompts, lora, outs, [with_adapter if x else hf for x in lora])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families-lora-pp")
    return lambda arch: _run(arch, folder)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_adapter_and_base_requests_match_peft(arch: str, runs) -> None:
    from oracle import check_against_hf

    run = runs(arch)
    for out, prompt, model, lora in zip(run.outs, run.prompts, run.oracles, run.lora):
        try:
            check_against_hf([out], [prompt], model, STEPS)
        except AssertionError as e:
            raise AssertionError(f"{arch}, {'adapter' if lora else 'base'}") from e
    # the same prompt with and without the adapter: the adapter moves every logprob
    a, b = run.outs[0].outputs[0], run.outs[2].outputs[0]
    first = [o.logprobs[0][o.token_ids[0]].logprob for o in (a, b)]
    assert a.token_ids != b.token_ids or abs(first[0] - first[1]) > 1e-3


# ---- two pipeline stages -------------------------------------------------------------------
def _greedy_on_stages(cases: list[tuple[str, list[int], int]]) -> dict:
    """On each of two gloo ranks as pipeline stages 0 and 1: every checkpoint's model built
    and loaded for this stage, its prompt prefilled and `steps` tokens decoded greedily, the
    activations between the stages through StageLink. Rank 0's {path: (tokens, logprobs, the
    indices of the layers it built, whether it lacks the final norm)}."""
    import torch.distributed as dist

    from shoal.attention.metadata import GroupedMetadata, build_attention_metadata
    from shoal.distributed.parallel_state import (
        init_model_parallel,
        pp_is_first,
        reset_tensor_parallel,
    )
    from shoal.loader import load_model
    from shoal.models.llama import PPMissingLayer
    from shoal.models.registry import resolve_model_class
    from shoal.worker.stage_link import StageLink

    reset_tensor_parallel()
    init_model_parallel(1, 2)
    cpu, bs, results = torch.device("cpu"), 4, {}
    for path, prompt, steps in cases:
        loaded = load_model(path)
        model = resolve_model_class(loaded.hf_config)(loaded.hf_config, torch.float32,
                                                      use_triton_ops=False)
        model.load_weights(loaded.weights())
        n_max = len(prompt) + steps
        blocks = -(-n_max // bs)
        layers = model.attention_layers()
        windows = sorted({a.sliding_window or 0 for a in layers})  # one metadata per window
        for a in layers:
            spec = a.kv_cache_spec(4)
            a.kv_cache = torch.zeros(spec.planes, (blocks + 1) * bs, spec.num_kv_heads,
                                     spec.head_size)
            a.kv_group = windows.index(a.sliding_window or 0)
        link = StageLink(loaded.hf_config.hidden_size, torch.float32, cpu)
        ids, context, tokens, logprobs = list(prompt), 0, [], []
        with torch.inference_mode():
            for _ in range(steps):
                q = len(ids)
                md = GroupedMetadata.of_groups([build_attention_metadata(
                    query_lens=[q], context_lens=[context], block_tables=[list(range(blocks))],
                    block_size=bs, num_decodes=int(context > 0), sliding_window=w or None,
                    device=cpu, null_block=blocks) for w in windows])
                pending = link.run(model, torch.tensor(ids), torch.arange(context, context + q),
                                   md)
                tok = torch.zeros(1, dtype=torch.long)
                if pending is not None:
                    logits = model.compute_logits(pending.wait()[-1:])[0]
                    tok[0] = logits.argmax()
                    logprobs.append(torch.log_softmax(logits, -1)[tok].item())
                dist.broadcast(tok, src=0)
                context, ids = context + q, [int(tok)]
                tokens.append(int(tok))
        assert pp_is_first() == (pending is not None)
        stage = model.model
        built = [i for i, x in enumerate(stage.layers) if not isinstance(x, PPMissingLayer)]
        results[path] = (tokens, logprobs, built, isinstance(stage.norm, PPMissingLayer))
    return results


def test_two_pipeline_stages_give_the_one_stage_tokens(runs) -> None:
    torch.set_num_threads(1)
    cases = {arch: runs(arch) for arch in FAMILIES}
    got = run_on_two_ranks(_greedy_on_stages, [(str(r.path), r.prompts[2], STEPS)
                                               for r in cases.values()])
    for arch, run in cases.items():
        tokens, logprobs, built, no_norm = got[str(run.path)]
        # stage 0 built its first layers only, the last stage the final norm
        assert built == list(range(len(built))) and no_norm, arch
        assert 0 < len(built) < _config(FAMILIES[arch]).num_hidden_layers, arch
        one = run.outs[2].outputs[0]  # the first prompt, without the adapter, on one stage
        assert tokens == list(one.token_ids), arch
        want = [one.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert logprobs == pytest.approx(want, abs=1e-4), arch
