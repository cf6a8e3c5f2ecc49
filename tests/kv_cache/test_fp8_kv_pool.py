"""The FP8 KV pool (kv_cache_dtype="fp8"): its argument and flag, its size (one byte a value:
twice bfloat16's blocks, four times float32's, in the same memory) and start-up line, its
blocks through the CPU and disk tiers (byte for byte; a store of FP8 blocks is never read by
an "auto" engine), and a linear-attention hybrid, whose float32 states live in FP8 pages."""

from __future__ import annotations

import argparse
import logging
import random

import pytest
import torch
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.config import CacheConfig
from shoal.entrypoints.cli_args import add_engine_flags, engine_args_from
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_offload.control import offload_device_prefix_cache
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.worker.kv_cache_tensors import zero_blocks

BLOCK = 4
# The tiny Llama's block: layers * K and V * tokens * kv heads * head dim, one byte each
FP8_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _prompt(seed: int, n: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}


P = _prompt(1, 50)
OTHERS = [_prompt(100 + i, 60) for i in range(3)]


def _run(llm: LLM, prompt: dict = P) -> tuple[int, list[int], list[float]]:
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    c = out.outputs[0]
    return out.num_cached_tokens, c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids,
                                                                             c.logprobs)]


def _same(run: tuple, cached: int, reference: tuple) -> bool:
    """The run had `cached` tokens from the caches and gave the reference's tokens and
    logprobs (a step reading cached blocks sums in another order than one computing them)."""
    return run[:2] == (cached, reference[0]) and run[2] == pytest.approx(reference[1], abs=1e-5)


def _runner(llm: LLM):
    core = llm.llm_engine.core
    return getattr(core.runner, "driver", core.runner)


def test_kv_cache_dtype_values_and_flag(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3 "
                                         r"\(got 'int8'\)"):
        LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="float16")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args_from(parser.parse_args([])).kv_cache_dtype == "auto"
    args = engine_args_from(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]))
    assert args.kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize(("dtype", "fp8_name", "factor"),
                         [("bfloat16", "fp8", 2), ("float32", "fp8_e4m3", 4)])
def test_fp8_pool_holds_more_blocks_in_the_same_memory(tiny_llama_dir, caplog, dtype, fp8_name,
                                                       factor):
    budget = 1 << 20

    def pool(kv_cache_dtype: str) -> tuple[int, torch.dtype]:
        llm = LLM(model=str(tiny_llama_dir), dtype=dtype, block_size=BLOCK, max_model_len=256,
                  kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype)
        return llm.llm_engine.core.scheduler.kv.pool.num_blocks, _runner(llm).kv_caches[0].dtype

    with caplog.at_level(logging.INFO, logger="shoal.worker.model_runner"):
        auto, auto_dtype = pool("auto")
        fp8, fp8_dtype = pool(fp8_name)
    assert (auto_dtype, fp8_dtype) == (getattr(torch, dtype), torch.float8_e4m3fn)
    assert fp8 == factor * auto == budget // FP8_BLOCK_BYTES
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines[0].endswith(f", {dtype})") and lines[1].endswith(", float8_e4m3fn)"), lines


def _offload_llm(path, disk=None, **kw) -> LLM:
    args = dict(dtype="float32", block_size=BLOCK, max_model_len=256, num_gpu_blocks_override=24,
                kv_cache_dtype="fp8", kv_offloading_size=64 * FP8_BLOCK_BYTES / 2**30)
    if disk is not None:
        args.update(kv_offloading_disk_path=str(disk),
                    kv_offloading_disk_size=256 * (FP8_BLOCK_BYTES + 64) / 2**30)
    args.update(kw)
    return LLM(model=str(path), **args)


def _push_out_of_device(llm: LLM) -> None:
    for o in OTHERS:
        _run(llm, o)
    h = hash_full_blocks(P["prompt_token_ids"], BLOCK, [])[0]
    assert llm.llm_engine.core.scheduler.kv.pool.get_cached_block(h) is None


def test_fp8_blocks_round_trip_through_the_cpu_tier(tiny_llama_dir):
    # A pool as small as the engine under test's: the default (4 GiB of one-byte blocks of
    # 4 tokens, 8M Python block objects) took 8 s to build and told nothing more.
    reference = _run(LLM(model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK,
                         max_model_len=256, kv_cache_dtype="fp8", num_gpu_blocks_override=24,
                         enable_prefix_caching=False))[1:]
    llm = _offload_llm(tiny_llama_dir)
    store = llm.llm_engine.core.kv_offload
    assert store.cpu.pool.dtype == torch.float8_e4m3fn
    assert store.cpu.layout.nbytes == FP8_BLOCK_BYTES
    assert _same(_run(llm), 0, reference)  # computed
    # The device's bytes of P's first block, then the CPU tier's copy of them
    hashes = hash_full_blocks(P["prompt_token_ids"], BLOCK, [])
    block = llm.llm_engine.core.scheduler.kv.pool.get_cached_block(hashes[0]).block_id
    device = torch.stack([kv.view(kv.shape[0], -1, BLOCK * kv.shape[2] * kv.shape[3])[:, block]
                          for kv in _runner(llm).kv_caches])  # [layers, planes, values]
    offload_device_prefix_cache(llm.llm_engine.core)
    cpu = store.cpu.pool[store.cpu.slot_of(hashes[0])]
    assert torch.equal(cpu.view(torch.uint8), device.view(torch.uint8))
    assert _same(_run(llm), 48, reference)  # loaded back from the CPU tier
    _push_out_of_device(llm)
    hits = {t.name: t.hits for t in store.stats().tiers}["cpu"]
    assert _same(_run(llm), 48, reference)
    assert {t.name: t.hits for t in store.stats().tiers}["cpu"] - hits == 12


def test_an_auto_engine_never_reads_fp8_blocks_from_disk(tiny_llama_dir, tmp_path):
    fp8_layout = BlockLayout(2, (2, BLOCK, 2, 16), torch.float8_e4m3fn)
    auto_layout = BlockLayout(2, (2, BLOCK, 2, 16), torch.float32)
    assert StoreKey.of("m", fp8_layout).dtype == "float8_e4m3fn"
    assert StoreKey.of("m", fp8_layout).digest() != StoreKey.of("m", auto_layout).digest()

    first = _offload_llm(tiny_llama_dir, tmp_path)
    reference = _run(first)[1:]
    _push_out_of_device(first)
    first.llm_engine.core.kv_offload.flush()  # the CPU tier lets go: the blocks go to disk
    auto = _offload_llm(tiny_llama_dir, tmp_path, kv_cache_dtype="auto",
                        kv_offloading_size=0.001)
    assert _run(auto)[0] == 0  # no hit: its store key names another dtype
    again = _offload_llm(tiny_llama_dir, tmp_path)
    assert _same(_run(again), 48, reference)  # the control: FP8 again, disk hits
    dirs = sorted(p.name for p in tmp_path.iterdir() if (p / "key.json").exists())
    assert len(dirs) == 2 and any("float8_e4m3fn" in d for d in dirs)


LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])


def test_hybrid_keeps_float32_states_in_fp8_pages(tmp_path):
    """Qwen3.5's Gated DeltaNet layers beside FP8 attention: a page of half the bytes needs
    twice the tokens to hold a state (block 64 -> 128), and a prefix hit restores the state
    from those pages (the same tokens as computing it)."""
    path = write_tiny_checkpoint(tmp_path / "hybrid", "qwen3_5_text", seed=1, **LINEAR)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 150)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=48,
              num_gpu_blocks_override=32, max_model_len=512, kv_cache_dtype="fp8")
    assert llm.llm_engine.config.cache_config.block_size == 128
    runner = _runner(llm)
    assert {kv.dtype for kv in runner.kv_caches} == {torch.float8_e4m3fn}
    pages = [layer.pages for layer in runner.model.attention_layers()
             if getattr(layer, "pages", None) is not None]
    assert len(pages) == 3 and all(p.words.dtype == torch.float32 for p in pages)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 128]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_fault_zeroing_clears_fp8_blocks():
    """zero_blocks (a request's non-finite values must not stay where padding reads): whole
    blocks and a block's tail, on FP8 tensors as on any."""
    cache = torch.full((2, 4 * BLOCK, 2, 16), 1.5).to(torch.float8_e4m3fn)
    zero_blocks([cache], [(1, 0), (3, 2)], BLOCK)
    blocks = cache.float().view(2, 4, BLOCK, 2, 16)
    assert torch.all(blocks[:, 1] == 0) and torch.all(blocks[:, 3, 2:] == 0)
    assert torch.all(blocks[:, 0] == 1.5) and torch.all(blocks[:, 2] == 1.5)
    assert torch.all(blocks[:, 3, :2] == 1.5)
