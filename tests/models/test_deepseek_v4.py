"""DeepSeek-V4 against transformers 5.25 on a tiny random checkpoint, fp32: a sliding layer, two
CSA layers (m = 4, indexer top-4) and an HCA layer (m' = 16), a window of 8, hash-routed then
top-k-routed MoE layers, 3 hyper-connection streams. Prompts longer than the window, the HCA
group, top-k x m and 128 tokens take every path. Greedy tokens and logprobs within 1e-4, alone,
in mixed chunked batches (chunks ending inside groups), after a prefix hit (from an earlier
step and from the same step), through a preemption: the compressed entries are computed once
and kept, the open groups' inputs resume them (CompressedEntrySpec, CompressorStateSpec).

The oracle is transformers' full-sequence forward, re-run for every generated token: its
cached generation (DeepseekV4 cache layers) drifts from it once the indexer's top-k meets tied
scores (seen at 4 indexer heads, where relu zeroes every head of some entries; this config has
16 heads, where the two agree to 2e-5)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from oracle import check_against_hf, draft_continuations
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.core.kv_cache_spec import (
    CompressedEntrySpec,
    CompressorInputSpec,
    CompressorStateSpec,
    SlidingSharedKVSpec,
    context_bytes_per_token,
)

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]
V4 = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
          partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=8,
          n_shared_experts=1, layer_types=LAYERS,
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
          mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=3, sliding_window=8,
          o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=32, index_topk=4,
          max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
          rope_parameters={"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 128, "beta_fast": 32,
                           "beta_slow": 1})
STEPS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = AutoConfig.for_model("deepseek_v4", **V4)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):  # k distinct experts per token, as released
                b.copy_(torch.stack([torch.randperm(V4["n_routed_experts"])[:2]
                                     for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("dsv4")
    hf.save_pretrained(path, safe_serialization=True)  # in the release's tensor names
    return path, hf


_ORACLE: dict[tuple[int, ...], tuple[list[int], list[torch.Tensor]]] = {}


def full_forward_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    key = (*prompt, -n)
    if key not in _ORACLE:
        ids, out, logits = list(prompt), [], []
        with torch.no_grad():
            for _ in range(n):
                last = hf(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
                out.append(int(last.argmax()))
                logits.append(last)
                ids.append(out[-1])
        _ORACLE[key] = out, logits
    return _ORACLE[key]


def check(outs, prompts, hf, steps: int = STEPS) -> None:
    check_against_hf(outs, prompts, hf, steps, greedy=full_forward_greedy)


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_greedy_matches_transformers_in_mixed_chunked_batches(tiny):
    path, hf = tiny
    # 5 tokens (inside the window), 13, then past the HCA group, the indexer's top-k and 128;
    # 15 tokens a step: the long prompts run in chunks beside other requests' decodes, their
    # boundaries inside CSA and HCA groups
    prompts = _prompts((5, 13, 30, 61, 137), seed=1)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=15,
              num_gpu_blocks_override=256, max_model_len=256)
    runner = llm.llm_engine.core.runner
    # per layer the window's rows (4 layers); on the 3 CSA / HCA layers the entries (CSA's
    # tables, then HCA's sparse ones: groups of 16 > blocks of 4) and the open groups' inputs
    # (CSA: 2 groups of 4, in the window's tables; HCA: 1 group of 16)
    specs = runner.kv_specs
    assert sum(isinstance(s, SlidingSharedKVSpec) for s in specs) == 4
    assert sum(isinstance(s, CompressedEntrySpec) for s in specs) == 3
    assert [g.sliding_window for g in runner.kv_groups] == [None, None, 8, 16]
    assert [g.spec.ratio for g in runner.kv_groups[:2]] == [4, 16]
    check(_generate(llm, prompts), prompts, hf)


def test_two_tensor_parallel_ranks_match_transformers(tiny):
    """tensor_parallel_size=2 on gloo: 2 of the 4 query heads and 1 of the 2 output groups
    a rank, every expert's and the shared expert's intermediate dim halved; the KV rows,
    compressors and indexer replicated (whole caches on each rank, the one-rank specs).
    Chunked prompts past the window, the HCA group, top-k x m and 128 tokens."""
    path, hf = tiny
    prompts = _prompts((30, 137), seed=1)
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, block_size=4,
              max_num_batched_tokens=32, num_gpu_blocks_override=256, max_model_len=256)
    try:
        model = llm.llm_engine.core.runner.driver.model
        attn = model.model.layers[1].self_attn
        assert (attn.num_heads, attn.o_groups, tuple(attn.sinks.shape)) == (2, 1, (2,))
        assert model.model.layers[3].mlp.experts.inter == V4["moe_intermediate_size"] // 2
        runner = llm.llm_engine.core.runner.driver
        assert [g.sliding_window for g in runner.kv_groups] == [None, None, 8, 16]
        assert all(s.num_kv_heads == 1 for s in runner.kv_specs)
        check(_generate(llm, prompts), prompts, hf)
    finally:
        llm.shutdown()


def test_output_groups_must_split_evenly_over_tensor_parallel_ranks(monkeypatch):
    """A group of heads is projected on one rank: 4 heads split over 4 ranks, 2 groups not."""
    import shoal.layers.compressed_attention as ca

    monkeypatch.setattr(ca, "get_tp_world_size", lambda: 4)
    cfg = AutoConfig.for_model("deepseek_v4", **V4)
    with pytest.raises(ValueError, match=r"o_groups \(2\) must be a multiple of "
                                         r"tensor_parallel_size \(4\)"):
        ca.CompressedAttention(cfg, 0, torch.float32)


def test_whole_prompts_and_decodes_alone(tiny):
    path, hf = tiny
    prompts = _prompts((70,), seed=2)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    check(_generate(llm, prompts), prompts, hf)


def test_prefix_hit_gives_the_tokens_of_a_miss(tiny):
    path, hf = tiny
    # 44 cached tokens: the hit ends inside an HCA group (of 16), which the new tokens close
    shared = _prompts((46,), seed=3)[0]
    prompts = [shared + [7, 9, 11], shared + [300, 301]]
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_model_len=256,
              num_gpu_blocks_override=256)
    first = _generate(llm, prompts[:1])
    second = _generate(llm, prompts[1:])
    assert second[0].num_cached_tokens == 44
    # in one step: the second reads the entries the first stores in that very step
    shared = _prompts((34,), seed=6)[0]
    pair = [shared + [5], shared + [6, 8]]
    together = _generate(llm, pair)
    assert together[1].num_cached_tokens == 32
    check(first + second + together, prompts + pair, hf)


def test_preemption_recomputes(tiny):
    path, hf = tiny
    prompts = _prompts((60, 55, 50, 45), seed=4)
    # the override counts the first group's blocks (the CSA entries' partition: every token
    # of the context takes them), the other groups' partitions follow (kv_pool_split.py)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=36, max_model_len=128, enable_prefix_caching=False)
    check(_generate(llm, prompts), prompts, hf)
    scheduler = llm.llm_engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert len(scheduler.kv.pool.sizes) == 4 and scheduler.kv.pool.sizes[0] == 36


def test_both_spellings_load_alike_and_mtp_is_skipped(tiny, caplog):
    """transformers' in-memory names (stacked experts) fill the parameters as the release's
    names on disk do; multi-token-prediction tensors are skipped with a log line."""
    from safetensors.torch import load_file

    from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM

    path, hf = tiny
    in_memory = DeepseekV4ForCausalLM(hf.config, torch.float32)
    weights = list(hf.state_dict().items()) + [("mtp.0.attn.wq_a.weight", torch.zeros(1))]
    with caplog.at_level(logging.INFO, logger="shoal.models.deepseek_v4"):
        loaded = in_memory.load_weights(weights)
    assert loaded == {n for n, _ in in_memory.named_parameters()}
    assert "skipped 1 tensors of the multi-token-prediction layers" in caplog.text
    on_disk = DeepseekV4ForCausalLM(hf.config, torch.float32)
    on_disk.load_weights(load_file(path / "model.safetensors").items())
    for (name, a), (_, b) in zip(in_memory.named_parameters(), on_disk.named_parameters()):
        assert torch.equal(a, b), name


def test_ngram_drafts_verify_to_the_same_tokens(tiny, monkeypatch):
    """Verify steps (several query tokens, some drafts rejected and their rows overwritten)."""
    path, hf = tiny
    prompts = _prompts((30, 45), seed=5)
    draft_continuations(monkeypatch, {tuple(p): full_forward_greedy(hf, p, STEPS)[0]
                                      for p in prompts})
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    check(_generate(llm, prompts), prompts, hf)


def test_shipped_4_layer_config_builds_at_its_shape():
    from shoal.layers.moe.layer import FusedMoE
    from shoal.loader import load_model
    from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM
    from shoal.models.registry import resolve_model_class

    cfg = load_model("deepseek-ai/DeepSeek-V4-Flash-Base-4layers", load_format="dummy").hf_config
    assert resolve_model_class(cfg) is DeepseekV4ForCausalLM
    assert cfg.layer_types == ["sliding_attention", "sliding_attention",
                               "compressed_sparse_attention", "heavily_compressed_attention"]
    assert cfg.mlp_layer_types == ["hash_moe"] * 3 + ["moe"]
    assert (cfg.hidden_size, cfg.head_dim, cfg.qk_rope_head_dim, cfg.n_routed_experts,
            cfg.num_experts_per_tok, cfg.sliding_window, cfg.index_topk) == (
        4096, 512, 64, 256, 6, 128, 512)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in model.modules()
                 if isinstance(m, FusedMoE))
    assert round(total / 1e9, 2) == 27.39  # the README's count
    assert round((total - routed + routed * 6 // 256) / 1e9, 2) == 2.22
    # 4 windows; on the CSA and HCA layers their entries and their open groups' inputs
    assert len(model.attention_layers()) == 8


def test_compressed_entries_cost_a_fraction_of_the_inputs_they_pool():
    """KV bytes per token of context at the shipped shape (bf16, blocks of 16), from the
    specs: the entries (CSA: 1 per 4 tokens, with the indexer's key; HCA: 1 per 128, in the
    one block of 8 that closes its group) against every token's compressor inputs that the
    first version kept."""
    from shoal.loader import load_model
    from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM
    from shoal.worker.kv_cache_tensors import layer_specs

    cfg = load_model("deepseek-ai/DeepSeek-V4-Flash-Base-4layers", load_format="dummy").hf_config
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, torch.bfloat16)
    bs, specs = 16, layer_specs(model.attention_layers(), torch.bfloat16)
    entries = [s for s in specs if isinstance(s, CompressedEntrySpec)]
    # the open groups' inputs are rows of what the first version kept for every token
    inputs = [CompressorInputSpec(1, s.head_size, 2) for s in specs
              if isinstance(s, CompressorStateSpec)]
    assert [(e.ratio, e.head_size) for e in entries] == [(4, 512 + 128), (128, 512)]
    assert [i.head_size for i in inputs] == [4 * (512 + 128), 2 * 512]
    # an entry is (CSA) a quarter or (HCA) half of one token's inputs, for m tokens
    for e, i in zip(entries, inputs):
        assert e.bytes_per_token(bs) * e.ratio <= i.bytes_per_token(bs) / 2
    assert [e.bytes_per_token(bs) for e in entries] == [2 * 640 / 4, 2 * 512 / 128]
    # the whole model: the windows and the open groups' inputs are bounded per request
    before = sum(i.bytes_per_token(bs) for i in inputs)
    assert (before, context_bytes_per_token(specs, bs)) == (7168, 328)


def test_release_names_map_to_parameters():
    """The release's own spelling (no model. prefix), beside what save_pretrained writes."""
    from shoal.models.deepseek_v4_weights import shoal_name

    cases = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "layers.0.hc_attn_scale": "model.layers.0.attn_hc.scale",
        "layers.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "layers.2.attn.norm.weight": "model.layers.2.self_attn.kv_norm.weight",
        "layers.2.attn.compressor.norm.weight": "model.layers.2.self_attn.compressor.kv_norm.weight",
        "layers.2.attn.indexer.compressor.ape":
            "model.layers.2.self_attn.compressor.indexer.position_bias",
        "layers.2.attn.indexer.wq_b.weight":
            "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.3.ffn.gate.bias": "model.layers.3.mlp.gate.e_score_correction_bias",
        "layers.3.ffn.experts.7.w2.weight": "model.layers.3.mlp.experts.7.down_proj.weight",
        "layers.3.ffn.shared_experts.w3.weight": "model.layers.3.mlp.shared_experts.up_proj.weight",
        "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight":
            "model.layers.1.self_attn.compressor.indexer.weights_proj.weight",
        "model.layers.1.self_attn.q_a_proj.weight": "model.layers.1.self_attn.q_a_proj.weight",
        "mtp.0.attn.wq_a.weight": None,
        "layers.4.attn.wq_a.weight": None,  # past num_hidden_layers
    }
    assert {name: shoal_name(name, 4) for name in cases} == cases


def test_entries_of_groups_longer_than_a_block_hold_only_the_blocks_closing_them():
    """The KV manager's sparse tables (CompressedEntrySpec.holds_block): with groups of 16
    tokens over blocks of 4, a request holds one HCA block in 4, a prefix hit shares those
    and needs no other."""
    from shoal.core.kv_cache_spec import group_layers
    from shoal.core.request import Request
    from shoal.kv_cache.manager import KVCacheManager

    groups = group_layers([CompressedEntrySpec(1, 8, 4, ratio=4),
                           CompressedEntrySpec(1, 8, 4, ratio=16),
                           CompressorStateSpec(1, 8, 4, 16)])
    kv = KVCacheManager(64, 4, groups=groups)
    tokens = _prompts((40,), seed=7)[0]

    def request(rid: str, ids: list[int]) -> Request:
        return Request(rid, ids, SamplingParams(max_tokens=8), frozenset(), 8)

    a = request("a", tokens)
    assert kv.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    hca = kv.tables[1].blocks["a"]
    assert [i for i, b in enumerate(hca) if b is not None] == [3, 7]  # tokens 15 and 31
    assert kv.group_block_ids("a")[0][:4] == [kv.null_block] * 3 + [hca[3].block_id]
    b = request("b", tokens + [3, 4])
    hits, n = kv.get_computed_blocks(b)
    assert n == 40
    free = kv.num_free_blocks
    assert kv.allocate_slots(b, 2, hits) is not None
    assert kv.tables[1].blocks["b"][:8] == hca[:8]
    # a block each for the entries of 4 (token 41's) and the open group's rows; none for HCA
    assert free - kv.num_free_blocks == 2
