"""DeepSeek-V3.2 (MLA with DeepSeek Sparse Attention's lightning indexer) against transformers
5.25 on a tiny random checkpoint with index_topk 8, so prompts and decodes past 8 tokens read
only the indexer's picks: greedy tokens and logprobs within 1e-4, alone and in mixed chunked
batches, after a prefix hit, through a preemption; short contexts skip the indexer."""

from __future__ import annotations

import random

import pytest
import torch
from deepseek_tiny import V3, check_against_hf, write_deepseek

from shoal import LLM, SamplingParams
from shoal.layers.sparse_indexer import LightningIndexer

V32 = dict(V3, index_n_heads=8, index_head_dim=32, index_topk=8)
STEPS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_deepseek(tmp_path_factory.mktemp("dsv32"), "deepseek_v32", seed=3, **V32)


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    path, hf = tiny
    # 5 tokens (dense throughout its prompt), 8 (exactly top-k), then past it; 16 tokens a
    # step: the long prompts run in chunks beside other requests' decodes
    prompts = _prompts((5, 8, 30, 61, 97), seed=1)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=256, max_model_len=256)
    layers = llm.llm_engine.core.runner.model.attention_layers()
    assert sum(isinstance(a, LightningIndexer) for a in layers) == 3  # one per layer
    check_against_hf(_generate(llm, prompts), prompts, hf, STEPS)


def test_whole_prompts_and_decodes_alone(tiny):
    path, hf = tiny
    prompts = _prompts((40,), seed=2)
    # 64 blocks: the CPU default (4 GiB of small latent blocks) is ~280k blocks, ~1 s
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    check_against_hf(_generate(llm, prompts), prompts, hf, STEPS)


def test_prefix_hit_gives_the_tokens_of_a_miss(tiny):
    path, hf = tiny
    shared = _prompts((48,), seed=3)[0]
    prompts = [shared + [7, 9, 11], shared + [300, 301]]
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_model_len=256,
              num_gpu_blocks_override=256)
    first = _generate(llm, prompts[:1])
    second = _generate(llm, prompts[1:])
    assert second[0].num_cached_tokens >= 48
    check_against_hf(first + second, prompts, hf, STEPS)


def test_preemption_recomputes(tiny):
    path, hf = tiny
    prompts = _prompts((60, 55, 50, 45), seed=4)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=40, max_model_len=128, enable_prefix_caching=False)
    check_against_hf(_generate(llm, prompts), prompts, hf, STEPS)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_short_contexts_skip_the_indexer(tiny, monkeypatch):
    """Every query of a step seeing at most index_topk keys: no scores, no selection."""
    path, hf = tiny
    calls: list[int] = []
    select = LightningIndexer._select

    def counting(self, *args):
        calls.append(1)
        return select(self, *args)

    monkeypatch.setattr(LightningIndexer, "_select", counting)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    short = _prompts((3,), seed=5)
    out = llm.generate([{"prompt_token_ids": short[0]}],
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1),
                       use_tqdm=False)
    assert not calls  # 3 + 5 tokens: within top-k all along
    check_against_hf(out, short, hf, 5)
    _generate(llm, _prompts((20,), seed=6))
    assert calls


def test_a_config_without_query_latent_is_refused():
    from transformers import AutoConfig

    from shoal.models.deepseek_v32 import DeepseekV32ForCausalLM

    cfg = AutoConfig.for_model("deepseek_v32", **dict(V32, q_lora_rank=0))
    with pytest.raises(ValueError, match="q_lora_rank"):
        DeepseekV32ForCausalLM(cfg, torch.float32)


def test_mtp_drafts_losslessly(tmp_path):
    """method="mtp" on a V3.2 checkpoint: its MTP layer (with an indexer of its own, reading
    the target's block tables) drafts; greedy tokens equal the run without speculation, with
    contexts past index_topk so the sparse path runs in the drafter too."""
    import json

    from safetensors.torch import load_file, save_file

    n = V32["num_hidden_layers"]
    full, _ = write_deepseek(tmp_path / "full", "deepseek_v32", seed=5,
                             **dict(V32, num_hidden_layers=n + 1))
    weights = load_file(full / "model.safetensors")
    h, v = V32["hidden_size"], V32["vocab_size"]
    gen = torch.Generator().manual_seed(11)
    p = f"model.layers.{n}."
    weights.update({p + "enorm.weight": 0.5 + torch.rand(h, generator=gen),
                    p + "hnorm.weight": 0.5 + torch.rand(h, generator=gen),
                    p + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=gen),
                    p + "shared_head.norm.weight": 0.5 + torch.rand(h, generator=gen),
                    p + "shared_head.head.weight": 0.2 * torch.randn(v, h, generator=gen)})
    target = tmp_path / "target"
    target.mkdir()
    save_file(weights, target / "model.safetensors")
    cfg = json.loads((full / "config.json").read_text())
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=1,
               mlp_layer_types=cfg["mlp_layer_types"][:n])
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:n]
    (target / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts((12, 40, 70), seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=24,
              num_gpu_blocks_override=256)
    plain = LLM(model=str(target), **kw)
    want = [o.outputs[0].token_ids for o in
            plain.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)]
    llm = LLM(model=str(target), speculative_config={"method": "mtp",
                                                     "num_speculative_tokens": 2}, **kw)
    drafter = llm.llm_engine.core.runner.drafter
    assert any(isinstance(a, LightningIndexer) for a in drafter.model.attention_layers())
    sched = llm.llm_engine.core.scheduler
    verified, stats = [0], sched.stats

    def counting():
        s = stats()
        verified[0] += s.spec_num_draft_tokens
        return s

    sched.stats = counting
    got = [o.outputs[0].token_ids for o in
           llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)]
    assert got == want
    assert verified[0] > 0  # drafts were proposed and verified


def _logits(path: str) -> torch.Tensor:
    from gloo_harness import load_tp_model, prompt_logits

    return prompt_logits(load_tp_model(path))


def test_two_rank_split_matches_one_rank(tiny):
    """Heads split over two gloo ranks (the indexer replicated: every rank picks the same
    tokens); the prompt is longer than index_topk, so the selection is used."""
    from gloo_harness import PROMPT, run_on_two_ranks

    assert len(PROMPT) > V32["index_topk"]
    path, _ = tiny
    torch.testing.assert_close(run_on_two_ranks(_logits, str(path)), _logits(str(path)),
                               atol=1e-4, rtol=1e-4)
