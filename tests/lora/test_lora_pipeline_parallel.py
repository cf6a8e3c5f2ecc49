"""LoRA under pipeline parallelism (issues 33 and 35): two gloo stages on the CPU, each holding
the adapter slots of its own decoder layers and reading only the adapter tensors of those,
serve base requests and two adapters' at once, in two micro-batches in flight, with PEFT's
tokens and logprobs (within 1e-4). One adapter adapts only the last layer, which no projection
of stage 0 holds: the driver still takes it (the stages share their limits), and a module of
a layer no stage has is refused by name as on one stage. Unloading an adapter reaches every
stage: its id then served from a rewritten folder gives the new adapter's tokens on both.
GLM-4 (a fused gate_up_proj adapted as one module, B rows reordered for its interleaved
rotary) and Mixtral (adapters on the routed experts) take the same paths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from executor.worker_checks import StepLog
from oracle import check_against_hf, write_tiny_checkpoint
from peft_adapters import ATTN, peft_model, write_adapter, write_raw_adapter

from shoal import LLM, SamplingParams
from shoal.lora.request import LoRARequest

STEPS = 6
PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8, 1, 2, 3, 4, 5, 6, 7], [9, 9, 9],
           [1, 2, 3, 4], [100, 200, 300, 400, 500, 60, 70], [33, 44, 55, 66, 77]]
# steps of at most 16 tokens: prompts prefill in chunks beside other requests' decodes
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22,
              max_num_batched_tokens=16, pipeline_parallel_size=2, enable_lora=True,
              max_lora_rank=8)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


def check_each(outs, prompts, base: Path, adapters: list[Path | None], tol: float = 1e-4
               ) -> None:
    models = {a: peft_model(base, a) for a in set(adapters)}
    for i, (out, prompt, adapter) in enumerate(zip(outs, prompts[:len(adapters)], adapters,
                                                   strict=True)):
        try:
            check_against_hf([out], [prompt], models[adapter], STEPS, tol=tol)
        except AssertionError as e:
            name = "the base" if adapter is None else adapter.name
            raise AssertionError(f"output {i} differs from PEFT's with {name}") from e


def serve(llm: LLM, chosen: list[Path | None], ids: dict[Path, int], prompts=PROMPTS):
    requests = [None if p is None else LoRARequest(p.name, ids[p], str(p)) for p in chosen]
    return llm.generate(prompts[:len(chosen)], greedy(), lora_request=requests, use_tqdm=False)


def test_two_stages_serve_adapters_and_base_like_peft(tmp_path):
    torch.set_num_threads(1)
    base = write_tiny_checkpoint(tmp_path / "base", "llama", seed=1)
    every = write_adapter(base, tmp_path / "every", seed=11, r=8, alpha=16)
    # layer 1 only (stage 1's), its o_proj of another rank and its down_proj of another alpha
    last = write_adapter(base, tmp_path / "last", seed=12, r=8, alpha=16, layers_to_transform=[1],
                         rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 4})
    later = write_adapter(base, tmp_path / "later", seed=13, r=4, alpha=16)
    swap = shutil.copytree(last, tmp_path / "swap")  # id 2: `last`, then `later`
    llm = LLM(model=str(base), max_loras=2, **ENGINE)
    try:
        driver = llm.llm_engine.core.runner.driver
        assert driver.model.model.end_layer == 1  # stage 0 holds layer 0 only
        slots = driver.lora
        assert not any(n.startswith("model.layers.1.") for n in slots.stage_modules.targets)
        assert "model.layers.1.mlp.down_proj" in slots.limits.targets  # stage 1's
        log = StepLog(llm.llm_engine.core.runner)
        steps: list[set[int]] = []  # each step's adapters (stage 0's slot tables)
        set_step = slots.set_step

        def recording(loras, num_tokens):
            steps.append({x.lora_int_id for x in loras if x is not None})
            set_step(loras, num_tokens)

        slots.set_step = recording
        chosen = [every, None, swap, every, swap, None]
        ids = {every: 1, swap: 2}
        outs = serve(llm, chosen, ids)
        # two micro-batches in flight (StepLog: of disjoint requests), adapters in both
        assert log.most == 2 and any(a and b for a, b in zip(steps, steps[1:]))
        # each stage read the adapters, stage 0 none of `last`'s tensors
        assert [i["lora_adapters"] for i in llm.collective_rpc("rank_info")] == [[1, 2]] * 2
        assert slots.host[2][1] == {} and slots.host[1][1]

        # unloaded at run time on every stage; the id served again from a rewritten folder
        llm.llm_engine.core.remove_lora(2)
        assert [i["lora_adapters"] for i in llm.collective_rpc("rank_info")] == [[1]] * 2
        shutil.rmtree(swap)
        shutil.copytree(later, swap)
        again = serve(llm, [swap, None], ids, PROMPTS[3:])

        # a module of a layer no stage holds is refused by name, as on one stage
        ghost = write_raw_adapter(tmp_path / "ghost", {"model.layers.2.self_attn.q_proj":
                                                       (64, 64)}, seed=5, leaves=("q_proj",))
        with pytest.raises(ValueError, match=r"adapts 'model\.layers\.2\.self_attn\.q_proj', "
                                             r"which this model has no LoRA-capable projection"):
            serve(llm, [ghost], {ghost: 4})
    finally:
        llm.shutdown()
    check_each(outs, PROMPTS, base, [last if p == swap else p for p in chosen])
    check_each(again, PROMPTS[3:], base, [later, None])


@pytest.mark.parametrize("model_type, overrides, adapter", [
    ("glm4", dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0),
     dict(targets=ATTN + ["gate_up_proj", "down_proj"])),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
     dict(targets=["q_proj", "o_proj"],
          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
])
def test_fused_and_expert_adapters_on_two_stages(model_type, overrides, adapter, tmp_path):
    torch.set_num_threads(1)
    base = write_tiny_checkpoint(tmp_path / "base", model_type, seed=2, **overrides)
    path = write_adapter(base, tmp_path / "adapter", seed=21, r=4, alpha=8, scale=0.2,
                         **adapter)
    experts = dict(lora_target_modules=["all-linear", "experts"]) \
        if "target_parameters" in adapter else {}
    llm = LLM(model=str(base), max_loras=1, **experts, **ENGINE)
    try:
        chosen, prompts = [path, None, path], [PROMPTS[0], PROMPTS[0], PROMPTS[2]]
        outs = serve(llm, chosen, {path: 1}, prompts)
    finally:
        llm.shutdown()
    check_each(outs, prompts, base, chosen)
    # the adapter moves the first prompt's logprobs (PEFT's check above could not fail else)
    a, b = (o.outputs[0] for o in outs[:2])
    assert a.token_ids != b.token_ids or \
        abs(a.logprobs[0][a.token_ids[0]].logprob - b.logprobs[0][b.token_ids[0]].logprob) > 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_stages_serve_adapters_like_peft(tmp_path):
    """The CUDA path (Triton LoRA kernels, NCCL between the stages; eager, as pipeline
    parallelism is on CUDA): PEFT's tokens, logprobs within 2e-3 (fp32 on the GPU)."""
    base = write_tiny_checkpoint(tmp_path / "base", "llama", seed=1)
    every = write_adapter(base, tmp_path / "every", seed=11, r=8, alpha=16)
    last = write_adapter(base, tmp_path / "last", seed=12, r=8, alpha=16, layers_to_transform=[1])
    llm = LLM(model=str(base), max_loras=2, **{**ENGINE, "device": "cuda"}, enforce_eager=True)
    try:
        chosen = [every, None, last, every, last, None]
        outs = serve(llm, chosen, {every: 1, last: 2})
    finally:
        llm.shutdown()
    check_each(outs, PROMPTS, base, chosen, tol=2e-3)
