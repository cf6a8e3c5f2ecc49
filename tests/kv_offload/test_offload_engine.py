"""The engine with secondary KV tiers on a tiny random checkpoint: the same greedy tokens from
device blocks, the CPU tier, the disk tier or recompute; restarts; keys; damage; limits."""

from __future__ import annotations

import random
import threading
import time

import pytest
from oracle import write_tiny_checkpoint
from tier_fixtures import _disk_of

from shoal import LLM, SamplingParams
from shoal.core.types import EngineCoreRequest
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_offload.control import offload_device_prefix_cache, persist
from shoal.kv_offload.lower_tiers import LOWER_TIERS

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * KV * tokens * kv heads * head dim * fp32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(path, disk=None, cpu_blocks=64, disk_blocks=256, **kw) -> LLM:
    args = dict(dtype="float32", block_size=BLOCK, max_model_len=256, num_gpu_blocks_override=24,
                kv_offloading_size=cpu_blocks * BLOCK_BYTES / 2**30)
    if disk is not None:
        args.update(kv_offloading_disk_path=str(disk),
                    kv_offloading_disk_size=disk_blocks * (BLOCK_BYTES + 64) / 2**30)
    args.update(kw)
    return LLM(model=str(path), **args)


def _prompt(seed: int, n: int = 50) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}


P = _prompt(1)
OTHERS = [_prompt(100 + i, 60) for i in range(3)]


def _run(llm: LLM, prompt=P, params=GREEDY):
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


def _store(llm: LLM):
    return llm.llm_engine.core.kv_offload


def _hits(llm: LLM) -> dict[str, int]:
    return {t.name: t.hits for t in _store(llm).stats().tiers}


def _push_out_of_device(llm: LLM) -> None:
    """Runs unrelated prompts until P's blocks left the (24-block) device pool."""
    for o in OTHERS:
        _run(llm, o)
    assert llm.llm_engine.core.scheduler.kv.pool.get_cached_block(_hashes()[0]) is None


def _hashes(prompt=P) -> list[bytes]:
    return hash_full_blocks(prompt["prompt_token_ids"], BLOCK, [])


def _settled(llm: LLM) -> None:
    """Every device block free, no pins left, tiers consistent."""
    sched = llm.llm_engine.core.scheduler
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not sched.requests
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.offload.num_deferred and not sched.offload.num_plans_in_flight
    assert _store(llm).cpu.num_pinned() == 0 and not sched.offload._holds.pins
    _store(llm).check()


def _on_disk_only(llm: LLM) -> None:
    """Runs P, then moves its blocks out of the device and the CPU tier: disk only."""
    _run(llm)
    _push_out_of_device(llm)
    _store(llm).flush()
    assert not _store(llm).cpu.contains(_hashes()[0])


def _gate_disk_reads(llm: LLM) -> threading.Event:
    """Holds the disk tier's background reads until the event is set."""
    disk, gate = _disk_of(_store(llm)), threading.Event()
    read = disk.read_into

    def gated(h, dst):
        assert gate.wait(30)
        return read(h, dst)

    disk.read_into = gated
    return gate


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[int]:
    # 24 blocks as the engines under test (the default 4 GiB pool: 2M blocks, ~3 s to build)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=24, enable_prefix_caching=False)
    return _run(llm)[1]


def test_same_tokens_from_device_cpu_disk_and_recompute(tiny_llama_dir, tmp_path, reference):
    llm = _llm(tiny_llama_dir, tmp_path)
    assert _run(llm) == (0, reference)  # computed
    assert _run(llm) == (48, reference)  # device blocks
    _push_out_of_device(llm)
    before = _hits(llm)
    assert _run(llm) == (48, reference)  # CPU tier
    assert _hits(llm)["cpu"] - before["cpu"] == 12
    _push_out_of_device(llm)
    _store(llm).flush()  # the CPU tier lets go of everything: it goes to disk
    before = _hits(llm)
    assert _run(llm) == (48, reference)  # disk tier
    assert _hits(llm)["disk"] - before["disk"] == 12 and _hits(llm)["cpu"] == before["cpu"]
    _push_out_of_device(llm)
    _store(llm).clear()
    assert _run(llm) == (0, reference)  # recomputed
    stats = _store(llm).stats()
    cpu = stats.tier("cpu")
    assert cpu.blocks_loaded >= 12 and cpu.bytes_loaded == cpu.blocks_loaded * BLOCK_BYTES
    assert stats.tier("disk").blocks_loaded >= 12 and stats.tier("disk").load_seconds > 0
    _settled(llm)


def test_prefix_partly_on_device_continues_from_the_tiers(tiny_llama_dir, tmp_path, reference):
    llm = _llm(tiny_llama_dir, cpu_blocks=64)
    _run(llm)
    _push_out_of_device(llm)
    short = {"prompt_token_ids": P["prompt_token_ids"][:21]}  # first 5 blocks back on device
    _run(llm, short, SamplingParams(temperature=0, max_tokens=1))
    before = _hits(llm)["cpu"]
    assert _run(llm) == (48, reference)
    assert _hits(llm)["cpu"] - before == 7  # 5 device blocks, then 7 from the CPU tier
    _settled(llm)


def test_skip_tiers_per_request(tiny_llama_dir, tmp_path, reference):
    llm = _llm(tiny_llama_dir, tmp_path)
    _run(llm)
    _push_out_of_device(llm)
    _store(llm).flush()
    skip_disk = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                               kv_transfer_params={"skip_tiers": ["disk"]})
    assert _run(llm, P, skip_disk) == (0, reference)
    with pytest.raises(ValueError, match="skip_tiers.*tape"):  # checked before it runs
        llm.generate(P, SamplingParams(kv_transfer_params={"skip_tiers": ["tape"]}))
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams(kv_transfer_params={"skip": ["disk"]})


def test_restart_reuses_the_disk_tier(tiny_llama_dir, tmp_path, reference):
    first = _llm(tiny_llama_dir, tmp_path, cpu_blocks=4)
    _run(first)
    persist(first.llm_engine.core)  # device blocks -> CPU tier (4 at a time) -> disk
    assert len(_disk_of(_store(first))) >= 12 and len(_store(first).cpu) == 0
    _settled(first)
    del first
    again = _llm(tiny_llama_dir, tmp_path)
    assert len(_disk_of(_store(again))) > 0
    assert _run(again) == (48, reference)
    assert _hits(again)["disk"] == 12
    _settled(again)


def test_other_model_dtype_or_block_size_never_reuse(tiny_llama_dir, tmp_path, reference):
    def fill(llm):
        _run(llm)
        _push_out_of_device(llm)
        _store(llm).flush()

    fill(_llm(tiny_llama_dir, tmp_path))
    other_model = write_tiny_checkpoint(tmp_path / "other", "llama", seed=1)
    variants = [
        _llm(other_model, tmp_path),
        _llm(tiny_llama_dir, tmp_path, dtype="bfloat16"),
        _llm(tiny_llama_dir, tmp_path, block_size=8, kv_offloading_size=0.001),
    ]
    for llm in variants:
        cached, _ = _run(llm)
        assert cached == 0 and _hits(llm)["disk"] == 0
    dirs = [p for p in tmp_path.iterdir() if (p / "key.json").exists()]
    assert len(dirs) == 4
    same = _llm(tiny_llama_dir, tmp_path)
    assert _run(same) == (48, reference)  # the control: same key, disk hits


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_disk_block_is_recomputed(tiny_llama_dir, tmp_path, reference, damage):
    first = _llm(tiny_llama_dir, tmp_path)
    _run(first)
    _push_out_of_device(first)
    _store(first).flush()
    disk_dir = _disk_of(_store(first)).dir
    del first
    path = disk_dir / (_hashes()[5].hex() + ".kv")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[:-7]
    path.write_bytes(bytes(data))
    again = _llm(tiny_llama_dir, tmp_path)
    assert _run(again) == (20, reference)  # blocks 0-4 from disk, the rest recomputed
    _settled(again)
    disk = _disk_of(_store(again))
    assert disk.stats.damaged == 1 and not path.exists()  # truncation: seen at the scan


def test_size_limits_hold_under_load(tiny_llama_dir, tmp_path):
    llm = _llm(tiny_llama_dir, tmp_path, cpu_blocks=6, disk_blocks=10)
    store = _store(llm)
    for i in range(8):
        _run(llm, _prompt(200 + i, 40))
        _push_out_of_device(llm)
        store.check()  # CPU slots <= capacity; disk bytes <= limit, index == files
        assert store.cpu.used_bytes <= 6 * BLOCK_BYTES
        assert len(_disk_of(store)) <= 10
    assert store.stats().tier("disk").evictions > 0
    _settled(llm)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_many_requests_sharing_and_evicting_prefixes(tiny_llama_dir, tmp_path, policy):
    rng = random.Random(7)
    bases = [_prompt(300 + i, 36)["prompt_token_ids"] for i in range(4)]
    prompts = []
    for i in range(36):
        suffix = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))]
        prompts.append({"prompt_token_ids": bases[i % 4][: rng.choice([16, 28, 36])] + suffix})
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(2, 10), ignore_eos=True)
              for _ in prompts]
    big = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=512)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, tmp_path, cpu_blocks=12, disk_blocks=40, num_gpu_blocks_override=40,
               max_num_seqs=6, max_num_batched_tokens=48, kv_offloading_policy=policy)
    for _ in range(2):  # the second round finds the prefixes in the tiers
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        _settled(llm)
    hits = _hits(llm)
    assert hits["cpu"] > 0 and hits["disk"] > 0
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_request_left_waiting_releases_its_staged_blocks(tiny_llama_dir, reference):
    llm = _llm(tiny_llama_dir, num_gpu_blocks_override=64, max_model_len=128,
               max_num_batched_tokens=128, enable_chunked_prefill=False)
    _run(llm)
    offload_device_prefix_cache(llm.llm_engine.core)  # P only in the CPU tier now
    assert _store(llm).cpu.contains(_hashes()[0])
    big = _prompt(400, 120)  # leaves 8 tokens of budget in its step
    tail = {"prompt_token_ids": P["prompt_token_ids"][:48] + [5] * 10}  # 10 to compute
    outs = llm.generate([big, tail], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert outs[1].num_cached_tokens == 48  # admitted a step later, still from the CPU tier
    _settled(llm)  # its blocks staged in the first step were unpinned


def test_offloading_arguments_are_checked(tiny_llama_dir, tmp_path):
    cases = [
        (dict(kv_offloading_size=0.0), "kv_offloading_size"),
        (dict(kv_offloading_size=1e-9), "smaller than one KV block"),
        (dict(kv_offloading_disk_path=str(tmp_path)), "kv_offloading_size"),
        (dict(kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path)), "disk_size"),
        (dict(kv_offloading_size=0.01, kv_offloading_disk_size=1.0), "disk_path"),
        (dict(kv_offloading_size=0.01, kv_offloading_policy="fifo"), "kv_offloading_policy"),
        (dict(kv_offloading_size=0.01, enable_prefix_caching=False), "enable_prefix_caching"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            LLM(model=str(tiny_llama_dir), dtype="float32", **kw)


def test_engine_steps_report_tier_figures(tiny_llama_dir, tmp_path, reference):
    """The per-tier figures reach SchedulerStats, which the server exports to Prometheus."""
    llm = _llm(tiny_llama_dir, tmp_path)
    _run(llm)
    _push_out_of_device(llm)
    core = llm.llm_engine.core
    core.add_request(EngineCoreRequest("tiers", P["prompt_token_ids"], GREEDY, time.monotonic()))
    tiers = None
    while core.has_unfinished_requests():
        tiers = core.step().stats.kv_tiers
    assert tiers is not None and set(tiers) == {"cpu", "disk"}
    assert tiers["cpu"]["hits"] >= 12 and tiers["cpu"]["queries"] >= tiers["cpu"]["hits"]
    assert 0 < tiers["cpu"]["usage"] <= 1 and tiers["cpu"]["bytes_loaded"] >= 12 * BLOCK_BYTES
    assert _run(llm) == (48, reference)


def test_disk_reads_do_not_stall_decoding(tiny_llama_dir, tmp_path, reference):
    llm = _llm(tiny_llama_dir, tmp_path)
    _on_disk_only(llm)
    core = llm.llm_engine.core
    conn = core.scheduler.offload
    gate = _gate_disk_reads(llm)
    try:
        decode = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        core.add_request(EngineCoreRequest("other", _prompt(500, 8)["prompt_token_ids"], decode,
                                           time.monotonic()))
        core.step()
        core.add_request(EngineCoreRequest("p", P["prompt_token_ids"], GREEDY, time.monotonic()))
        produced = 0
        for _ in range(4):  # P's blocks are being read: it waits, "other" goes on decoding
            outs = core.step().outputs
            produced += sum(len(o.new_token_ids) for o in outs if o.request_id == "other")
        assert produced == 4 and conn.num_deferred == 1
    finally:
        gate.set()
    tokens, cached = [], None
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.request_id == "p":
                tokens += o.new_token_ids
                cached = o.num_cached_tokens
    assert (cached, tokens) == (48, reference)
    assert _hits(llm)["disk"] == 12  # looked up once, not once per step it waited
    _settled(llm)


def test_aborting_a_request_waiting_for_disk_lets_go_of_its_blocks(tiny_llama_dir, tmp_path,
                                                                    reference):
    llm = _llm(tiny_llama_dir, tmp_path)
    _on_disk_only(llm)
    core = llm.llm_engine.core
    gate = _gate_disk_reads(llm)
    try:
        core.add_request(EngineCoreRequest("p", P["prompt_token_ids"], GREEDY, time.monotonic()))
        core.step()
        assert core.scheduler.offload.num_deferred == 1
        core.abort_requests(["p"])
    finally:
        gate.set()
    while core.has_unfinished_requests():
        core.step()
    _store(llm).wait_loads()
    _settled(llm)  # no pins left behind
    assert core.scheduler.offload.num_deferred == 0
    assert _run(llm) == (48, reference)  # the reads landed: CPU-tier hits now


def test_shutdown_keeps_the_cpu_tier_for_a_restart(tiny_llama_dir, tmp_path, reference):
    first = _llm(tiny_llama_dir, tmp_path)
    _run(first)
    offload_device_prefix_cache(first.llm_engine.core)  # P in the CPU tier only
    store = _store(first)
    assert store.cpu.contains(_hashes()[0]) and len(_disk_of(store)) == 0
    store.shutdown()
    del first
    again = _llm(tiny_llama_dir, tmp_path)
    assert _run(again) == (48, reference)
    assert _hits(again)["disk"] == 12
    _settled(again)


def test_a_request_waiting_for_disk_counts_its_prefix_query_once(tiny_llama_dir, tmp_path,
                                                                 reference):
    llm = _llm(tiny_llama_dir, tmp_path)
    _on_disk_only(llm)
    core = llm.llm_engine.core
    kv = core.scheduler.kv
    queries, hits = kv.prefix_queries, kv.prefix_hits
    gate = _gate_disk_reads(llm)
    try:
        core.add_request(EngineCoreRequest("p", P["prompt_token_ids"], GREEDY, time.monotonic()))
        for _ in range(3):  # asked again every step while its blocks are read
            core.step()
        assert core.scheduler.offload.num_deferred == 1
    finally:
        gate.set()
    while core.has_unfinished_requests():
        core.step()
    assert kv.prefix_queries - queries == len(P["prompt_token_ids"])  # once, not per step
    assert kv.prefix_hits == hits  # nothing was on the device
    _settled(llm)


def test_a_tier_listed_in_lower_tiers_is_built_and_its_hits_load(tiny_llama_dir, tmp_path,
                                                                  monkeypatch, reference):
    """A third tier is one file (memory_tier.py) plus its line in LOWER_TIERS."""
    monkeypatch.setitem(LOWER_TIERS, "memory", "memory_tier:build_memory_tier")
    llm = _llm(tiny_llama_dir, tmp_path)
    store = _store(llm)
    assert [t.name for t in store.tiers] == ["cpu", "disk", "memory"]
    _run(llm)
    _push_out_of_device(llm)
    store.flush()  # the CPU tier writes P down to both lower tiers
    store.clear("disk")  # so only the memory tier has it
    before = _hits(llm)
    assert _run(llm) == (48, reference)
    after = _hits(llm)
    assert after["memory"] - before["memory"] == 12 and after["disk"] == before["disk"]
    assert store.tier("memory").reads == 12
    _settled(llm)
