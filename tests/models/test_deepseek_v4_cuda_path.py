"""DeepSeek-V4 the way the engine runs it on CUDA, checked on the CPU against transformers
5.25 (the tiny checkpoint of test_deepseek_v4.py, fp32, logprobs within 1e-4): the Triton
backend's metadata (the CUDA default) with async scheduling, queries in small chunks (what
bounds a long prefill's score tensors), and the start-up warm-up on its partitioned pool."""

from __future__ import annotations

import pytest
from models.test_deepseek_v4 import _generate, _prompts, check, tiny  # noqa: F401 (fixture)

from shoal import LLM


def test_triton_metadata_and_async_scheduling_match_transformers(tiny):  # noqa: F811
    """CUDA's defaults: the Triton backend's metadata (its layers read only the spans, tables
    and slots) and async scheduling; chunked prompts past the window and the groups beside
    other requests' decodes, and a 2-token prompt whose second decode closes CSA's group 0
    (no group before it)."""
    path, hf = tiny
    prompts = _prompts((2, 5, 30, 61, 137), seed=11)
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend="triton",
              async_scheduling=True, block_size=4, max_num_batched_tokens=15,
              num_gpu_blocks_override=256, max_model_len=256)
    assert type(llm.llm_engine.core.runner.backend).__name__ == "TritonAttentionBackend"
    check(_generate(llm, prompts), prompts, hf)


def test_queries_in_small_chunks_match_transformers(tiny, monkeypatch):  # noqa: F811
    """A score budget of 600 elements: a prompt's queries attend a few at a time (windows and
    entries read per chunk) and the batch of decodes in slices of a few rows."""
    import shoal.layers.compressed_attention as ca

    path, hf = tiny
    seen: list[int] = []
    chunk = ca.queries_per_chunk

    def spy(heads: int, keys: int, grows: bool = True) -> int:
        seen.append(chunk(heads, keys, grows))
        return seen[-1]

    monkeypatch.setattr(ca, "SCORE_ELEMENTS", 600)
    monkeypatch.setattr(ca, "queries_per_chunk", spy)
    prompts = _prompts((70, 13, 137, 40, 9), seed=12)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=256, max_model_len=256)
    check(_generate(llm, prompts), prompts, hf)
    # CSA's decodes one row at a time (16 indexer heads x (8 + 34 entries) keys); at most
    # 600 // 4 heads // 8 keys rows of a sliding layer's decodes
    assert min(seen) == 1 and max(seen) == 18


def test_warmup_on_the_partitioned_pool(tiny, monkeypatch):  # noqa: F811
    """The start-up warm-up (run on CUDA) writes its made-up requests into pages from 1 of
    every group's partition, never the null page 0, and as many as the smallest partition
    holds; requests after it get transformers' tokens."""
    import shoal.worker.warmup as startup

    path, hf = tiny
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=64, max_model_len=256)
    runner = llm.llm_engine.core.runner
    sizes = [g.num_blocks for g in runner.kv_groups]
    assert len(sizes) == 4 and runner.null_block == 0  # a partition per group
    calls: list[tuple[list[int], int]] = []
    forward = startup.dummy_forward

    def counted(run, lens, num_decodes, sample=True, first_block=0):
        calls.append((lens, first_block))
        forward(run, lens, num_decodes, sample, first_block)

    monkeypatch.setattr(startup, "dummy_forward", counted)
    startup.warmup(runner)
    assert calls and {first for _, first in calls} == {1}
    assert max(sum(-(-q // 4) for q in lens) for lens, _ in calls) <= min(sizes)
    for kv in runner.kv_caches:  # page 0 of every group: still the zero null page
        assert not kv[:, :4].any()
    prompts = _prompts((30, 61), seed=13)
    check(_generate(llm, prompts), prompts, hf)


@pytest.mark.parametrize("heads, keys, grows", [(64, 128, True), (64, 33000, True),
                                                (16, 40, False), (1, 1 << 30, True)])
def test_chunks_keep_scores_within_the_budget(heads, keys, grows):
    import shoal.layers.compressed_attention as ca

    c = ca.queries_per_chunk(heads, keys, grows)
    size = (lambda n: n * heads * (keys + n)) if grows else (lambda n: n * heads * keys)
    assert c >= 1 and (c == 1 or size(c) <= ca.SCORE_ELEMENTS) and size(c + 1) > ca.SCORE_ELEMENTS
