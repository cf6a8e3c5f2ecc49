"""Speculative decoding under pipeline parallelism: two stages on the CPU (the mp executor,
gloo) against one rank, for ngram, a draft model and EAGLE-1 (spec_decode/factory.py: stage
0, which samples, drafts; the later stage builds no drafter and runs the verify steps' tokens
like any others). EAGLE-3 and MTP: test_spec_pipeline_heads.py.

For each method: greedy tokens are the plain engine's (lossless), and the acceptance counters
(drafts, draft tokens, accepted) are the one-rank speculative run's, with verify steps
launched while another micro-batch is in flight. The draft model is built whole on stage 0
(every layer, the final norm), though the target's layers are split; EAGLE-1 mirrors each
step from the final hidden states the last stage sends back. MTP on a model whose stack is
not built per stage (Qwen3-Next) is refused by the architecture's row."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompts, tiny_llm
from spec_decode.test_spec_engine import SpecCounter
from spec_decode.test_spec_tensor_parallel import draft_dir, ngram_prompts  # noqa: F401
from transformers import AutoConfig

from shoal import SamplingParams
from shoal.engine.engine_args import EngineArgs
from shoal.models.llama import PPMissingLayer

K = 3
PROMPTS = random_prompts(3, seed=11, lo=4, hi=24)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _drafts_beside_micro_batches(llm) -> list[int]:
    """Lets every step verify drafts, another micro-batch in flight or not. (engine/core.py
    allows drafts only with no step in flight, async scheduling's rule, which with
    micro-batches leaves few verify steps; a request is never in two micro-batches, so the
    drafts from its last step are current whatever else is in flight.) Returns a list that
    gets an entry for every verify step launched beside another step in flight."""
    core = llm.llm_engine.core
    schedule, execute = core.scheduler.schedule, core.runner.execute
    beside: list[int] = []

    def launch(sched):
        if sched.has_drafts and len(core.queue) > 1:  # (the queue holds this step already)
            beside.append(len(core.queue))
        return execute(sched)
    core.scheduler.schedule = lambda allow_drafts=True: schedule(True)
    core.runner.execute = launch
    return beside


def _run(target, pp: int, spec: dict | None, prompts, check=None, before=None,
         sampling: SamplingParams = GREEDY):
    """Greedy tokens and (drafts, draft tokens, accepted); before(llm) ahead of generate,
    check(llm) before shutdown."""
    llm = tiny_llm(target, pipeline_parallel_size=pp, speculative_config=spec)
    try:
        counter = SpecCounter(llm)
        beside = _drafts_beside_micro_batches(llm) if pp > 1 else []
        if before is not None:
            before(llm)
        tokens = [list(o.outputs[0].token_ids)
                  for o in llm.generate(prompts, sampling, use_tqdm=False)]
        if check is not None:
            check(llm)
        assert pp == 1 or beside, "no verify step ran beside another micro-batch"
        return tokens, (counter.drafts, counter.draft_tokens, counter.accepted)
    finally:
        llm.shutdown()


def _whole_draft_model(llm) -> None:
    driver = llm.llm_engine.core.runner.driver
    assert driver.model.model.end_layer == 1  # the target: stage 0 holds layer 0 of 2
    draft = driver.drafter.model.model
    assert (draft.start_layer, draft.end_layer) == (0, 2)
    assert not any(isinstance(m, PPMissingLayer) for m in (draft.norm, *draft.layers))
    assert len(driver.drafter.kv_layers()) == 2


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_two_stages_speculate_as_one_rank_does(method, eagle_ckpts, request):
    torch.set_num_threads(1)
    # the "bigram" target (its next token a function of the current one: drafts are often
    # right) and its EAGLE-1 head
    target, head, _ = eagle_ckpts["bigram"]
    spec: dict = {"method": method, "num_speculative_tokens": K}
    prompts, check = PROMPTS, None
    if method == "ngram":
        prompts = request.getfixturevalue("ngram_prompts")
    elif method == "draft_model":
        spec["model"], check = str(request.getfixturevalue("draft_dir")), _whole_draft_model
    else:
        spec["model"] = str(head)
    plain, _ = _run(target, 1, None, prompts)
    one, one_counts = _run(target, 1, spec, prompts)
    two, two_counts = _run(target, 2, spec, prompts, check)
    assert one == plain and two == plain
    assert two_counts == one_counts
    drafts, draft_tokens, accepted = one_counts
    assert drafts > 0 and 0 < accepted <= draft_tokens <= K * drafts


def test_mtp_of_a_model_not_built_per_stage_is_refused():
    hf = AutoConfig.for_model("qwen3_next", num_hidden_layers=4, mtp_num_hidden_layers=1)
    spec = {"method": "mtp", "num_speculative_tokens": K}
    with pytest.raises(ValueError, match=r"pipeline_parallel_size > 1 supports .*; not "
                       r"Qwen3NextForCausalLM") as e:
        EngineArgs(device="cpu", pipeline_parallel_size=2, speculative_config=spec
                   ).create_engine_config(hf)
    assert "speculative_config" not in str(e.value)  # the method itself is no obstacle
