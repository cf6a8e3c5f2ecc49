"""Pipeline parallelism through the Transformers backend (transformers_backend/pipeline.py):
the engine on two CPU pipeline stages (gloo) gives transformers' own greedy tokens and
logprobs, on Gemma (no class of shoal's own) and on Llama (shoal's class bypassed with
model_impl="transformers"); each stage builds only its layers. Stages chained in one
process give transformers' final hidden states on Granite, which scales its embeddings
inside the base model's forward (stage 1 must not scale them again). A config without a
base_model_pp_plan is refused by the engine config, naming the field."""

from __future__ import annotations

import pytest
import torch
from oracle import TINY_COMMON, check_against_hf, greedy_with_logprobs, write_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

import shoal.distributed.parallel_state as parallel_state
from shoal import LLM
from shoal.attention.packed import PackedSeqs
from shoal.engine.engine_args import EngineArgs
from shoal.loader import load_model
from shoal.models.transformers_backend.model import TransformersForCausalLM
from shoal.models.transformers_backend.pipeline import OtherStage


@pytest.mark.parametrize("model_type, fields", [
    ("gemma", dict(head_dim=16)),  # no class of shoal's own
    ("llama", dict(tie_word_embeddings=True)),  # stage 0: embedding and tied lm_head
])
def test_two_stages_match_transformers(model_type, fields, tmp_path) -> None:
    """Chunked prefills beside decodes over two stages: transformers' tokens and logprobs;
    stage 0 (this process) holds the embedding, layer 0 and the LM head, not the norm."""
    path = write_tiny_checkpoint(tmp_path, model_type, seed=1, **fields)
    llm = LLM(model=str(path), model_impl="transformers", dtype="float32", device="cpu",
              pipeline_parallel_size=2, max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=64, max_model_len=64, enable_prefix_caching=False)
    try:
        model = llm.llm_engine.core.runner.driver.model  # stage 0, in this process
        assert type(model).__name__ == "TransformersForCausalLM"
        assert isinstance(model.model.layers[1], OtherStage)
        assert isinstance(model.model.norm, OtherStage)
        names = {n for n, _ in model.named_parameters()}
        assert "model.layers.0.mlp.down_proj.weight" in names
        assert not any(n.startswith(("model.layers.1.", "model.norm.")) for n in names)
        assert len(model.attention_layers()) == 1
        prompts = [[(7 * i) % 500 + 3 for i in range(23)], [7, 9, 11], list(range(40, 47))]
        outs = greedy_with_logprobs(llm, prompts, 4)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_against_hf(outs, prompts, hf, 4)


def test_a_model_without_a_pp_plan_is_refused_by_the_engine_config() -> None:
    """GPT-2's config has no base_model_pp_plan: refused before any rank starts."""
    cfg = AutoConfig.for_model("gpt2", **TINY_COMMON)
    cfg.architectures = ["GPT2LMHeadModel"]
    args = EngineArgs(device="cpu", model_impl="transformers", pipeline_parallel_size=2,
                      max_model_len=64)
    with pytest.raises(ValueError, match="GPT2LMHeadModel with pipeline_parallel_size 2: its "
                                         "config has no base_model_pp_plan"):
        args.create_engine_config(cfg)
    llama = AutoConfig.for_model("llama", **TINY_COMMON)
    llama.architectures = ["LlamaForCausalLM"]
    assert args.create_engine_config(llama).parallel_config.pipeline_parallel_size == 2


def test_stages_chained_in_one_process_give_the_final_hidden_states(tmp_path,
                                                                     monkeypatch) -> None:
    """Granite over two stages (3 layers: 2 + 1), each built and loaded as its rank would,
    run one after the other on a packed prompt: stage 1's output is transformers' final
    hidden state, though Granite's base model multiplies its input embeddings (stage 1
    receives them already scaled and past layer 1)."""
    path = write_tiny_checkpoint(tmp_path, "granite", seed=1, num_hidden_layers=3,
                                 embedding_multiplier=3.0, residual_multiplier=0.5)
    loaded = load_model(str(path))
    monkeypatch.setattr(parallel_state, "_PP_SIZE", 2)
    stages = []
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_PP_RANK", rank)
        stage = TransformersForCausalLM(loaded.hf_config, torch.float32)
        names = stage.load_weights(loaded.weights())  # (the other stage's tensors skipped)
        assert names == {n for n, _ in stage.named_parameters()}
        stages.append(stage)
    assert [(s.stage.start, s.stage.end) for s in stages] == [(0, 2), (2, 3)]
    assert [len(s.attention_layers()) for s in stages] == [2, 1]
    with pytest.raises(ValueError, match="no LM head here"):
        stages[1].compute_logits(torch.zeros(1, 64))
    ids, pos = torch.tensor([5, 17, 300, 42, 7]), torch.arange(5)
    seqs = PackedSeqs.build([5], True, torch.device("cpu"))
    with torch.no_grad():
        between = stages[0](ids, pos, seqs)
        assert isinstance(between, tuple) and not between[1].any()  # residual plane: zeros
        out = stages[1].forward_stage(ids, pos, seqs, between)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        want = hf.model(ids[None]).last_hidden_state[0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
