"""Two offline engines in one process, a producer (prefill) and a consumer (decode), joined
by the P2P connector: the consumer's greedy tokens equal one engine's, also with another
block size on each side and with two tensor-parallel ranks on either side; its prompt's KV is
loaded, not computed (the producer ran the prompt once); a consumer that cannot fetch the KV
(the producer gone, the key served already, another prompt) recomputes and still answers
right."""

from __future__ import annotations

import time

import pytest
from engine_helpers import tiny_llm

from shoal import SamplingParams
from shoal.executor.commands import RunStep

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(37 + 5 * i)] for i in range(3)]
MORE = [[(11 * i + 5 * j) % 500 + 1 for j in range(29 + 6 * i)] for i in range(2)]
STEPS = 8


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


def _producer(path, block_size=4):
    return tiny_llm(path, block_size=block_size, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_port": 0})


def _consumer(path, block_size=4):
    return tiny_llm(path, block_size=block_size, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer"})


def _prefill(producer, prompt) -> dict:
    (out,) = producer.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False)
    params = out.kv_transfer_params
    assert params and params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
    return params


@pytest.fixture(scope="module")
def answers(tiny_llama_dir):
    """One engine's tokens for PROMPTS, then MORE."""
    llm = tiny_llm(tiny_llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + MORE], _greedy(),
                        use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(answers):
    return answers[:len(PROMPTS)]


@pytest.mark.parametrize("sizes", [(4, 4), (4, 16), (16, 8)], ids=["same", "4-16", "16-8"])
def test_decode_engine_gives_one_engines_tokens(tiny_llama_dir, reference, sizes) -> None:
    producer, consumer = _producer(tiny_llama_dir, sizes[0]), _consumer(tiny_llama_dir, sizes[1])
    try:
        params = [_prefill(producer, p) for p in PROMPTS]
        outs = consumer.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == len(PROMPTS) and connector.num_failed == 0
        for out, want in zip(outs, reference):
            assert list(out.outputs[0].token_ids) == want
            assert out.num_cached_tokens == len(out.prompt_token_ids) - 1  # loaded, not run
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_missing_or_wrong_kv_is_recomputed(tiny_llama_dir, reference) -> None:
    producer, consumer = _producer(tiny_llama_dir), _consumer(tiny_llama_dir)
    try:
        params = _prefill(producer, PROMPTS[0])
        first = consumer.generate({"prompt_token_ids": PROMPTS[0]},
                                  _greedy(kv_transfer_params=params), use_tqdm=False)[0]
        # the same key again: served already, so recomputed
        again = consumer.generate({"prompt_token_ids": PROMPTS[0]},
                                  _greedy(kv_transfer_params=params), use_tqdm=False)[0]
        # the KV of another prompt: refused by its hash, recomputed
        other = _prefill(producer, PROMPTS[1])
        wrong = consumer.generate({"prompt_token_ids": PROMPTS[2]},
                                  _greedy(kv_transfer_params=other), use_tqdm=False)[0]
        port = params["remote_port"]
        producer.shutdown()  # the producer gone
        gone = consumer.generate({"prompt_token_ids": PROMPTS[1]}, _greedy(
            kv_transfer_params={**params, "remote_port": port}), use_tqdm=False)[0]
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == 1 and connector.num_failed == 3
        assert list(first.outputs[0].token_ids) == reference[0]
        assert list(again.outputs[0].token_ids) == reference[0]
        assert list(wrong.outputs[0].token_ids) == reference[2]
        assert list(gone.outputs[0].token_ids) == reference[1]
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_bad_transfer_settings_are_refused(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="kv_role must be one of"):
        tiny_llm(tiny_llama_dir, kv_transfer_config={"kv_connector": "P2PConnector",
                                                     "kv_role": "decoder"})
    with pytest.raises(ValueError, match="unknown connector"):
        tiny_llm(tiny_llama_dir, kv_transfer_config={"kv_connector": "Nope"})
    with pytest.raises(ValueError, match="do_remote_prefill needs remote_host"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True})


def _both(path, **kw):
    return tiny_llm(path, kv_transfer_config={"kv_connector": "P2PConnector",
                                              "kv_role": "kv_both", "kv_port": 0}, **kw)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_on_either_side(tiny_llama_dir, answers) -> None:
    """One rank to two, then two to one (two engines, each producer and consumer). Two
    consumer ranks (gloo, the mp executor) each write their own KV heads of the transferred
    rows, read out of shared memory: the steps sent to the ranks carry a handle, not the KV.
    Two producer ranks each read out their own heads and rank 0 gathers them into a payload
    of every head, which one consumer rank takes whole. (Two engines in one process share
    torch.distributed's world: the one-rank engine prefills before the two-rank one starts,
    and consumes once that one's ranks have stopped, its connector still serving its kept
    KV.)"""
    reference, more = answers[:len(PROMPTS)], answers[len(PROMPTS):]
    one = _both(tiny_llama_dir)
    params = [_prefill(one, p) for p in PROMPTS]
    kept = one.llm_engine.core.kv_connector.stats()["kept_bytes"]
    two = _both(tiny_llama_dir, tensor_parallel_size=2)
    connector = two.llm_engine.core.kv_connector
    assert connector.engine.ranks_share_memory  # mp ranks on one host
    runner, sent = two.llm_engine.core.runner, []
    broadcast = runner._broadcast

    def record(cmd) -> None:
        plan = cmd.sched.kv_connector if isinstance(cmd, RunStep) else None
        if plan is not None and plan.loads:
            sent.append(len(runner._encoder.encode(cmd)))
        broadcast(cmd)

    runner._broadcast = record
    try:
        outs = two.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
        assert connector.num_loaded == len(PROMPTS)
        for out, want in zip(outs, reference):
            assert list(out.outputs[0].token_ids) == want
            assert out.num_cached_tokens == len(out.prompt_token_ids) - 1
        assert sent and sum(sent) < kept / 4  # the KV itself went through shared memory
        assert connector._segments.sweep() == 0  # every rank mapped and let go of its link

        params = [_prefill(two, p) for p in MORE]
        # each rank held 1 of the 2 KV heads: the payload has both
        assert all(k.payload.layout.layers[0][2] == 2 for k in connector._store.values())
        runner.shutdown()  # its ranks stop, torch.distributed's world goes back to `one`
        outs = one.generate([{"prompt_token_ids": p} for p in MORE],
                            [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
        assert one.llm_engine.core.kv_connector.num_loaded == len(MORE)
        for out, want in zip(outs, more):
            assert list(out.outputs[0].token_ids) == want
            assert out.num_cached_tokens == len(out.prompt_token_ids) - 1
    finally:
        one.shutdown()
        two.shutdown()


def _kv_bytes(producer, prompt) -> int:
    """The payload size of a prompt's KV on this producer (the connector's kept bytes)."""
    connector = producer.llm_engine.core.kv_connector
    before = connector.stats()["kept_bytes"]
    params = _prefill(producer, prompt)
    return connector.stats()["kept_bytes"] - before, params


def test_expired_or_dropped_kv_is_recomputed(tiny_llama_dir, reference) -> None:
    """The producer's budget (kv_buffer_bytes: oldest dropped) and TTL (kv_ttl_s): a key no
    longer kept is recomputed by the consumer."""
    probe = _producer(tiny_llama_dir)
    size, _ = _kv_bytes(probe, PROMPTS[2])
    probe.shutdown()
    producer = tiny_llm(tiny_llama_dir, block_size=4, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_port": 0,
        "kv_connector_extra_config": {"kv_buffer_bytes": size, "kv_ttl_s": 0.5}})
    consumer = _consumer(tiny_llama_dir)
    try:
        params = [_prefill(producer, p) for p in PROMPTS]  # the last one pushes out the rest
        assert producer.llm_engine.core.kv_connector.num_dropped == 2
        outs = consumer.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                 [_greedy(kv_transfer_params=kp) for kp in params],
                                 use_tqdm=False)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == 1 and connector.num_failed == 2
        assert [list(o.outputs[0].token_ids) for o in outs] == reference
        late = _prefill(producer, PROMPTS[0])
        time.sleep(0.7)  # past its kv_ttl_s
        out = consumer.generate({"prompt_token_ids": PROMPTS[0]},
                                _greedy(kv_transfer_params=late), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == reference[0]
        assert connector.num_failed == 3 and connector.num_loaded == 1
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_many_transfers_with_few_fetch_threads_and_a_small_fetch_budget(tiny_llama_dir
                                                                       ) -> None:
    """Twelve requests at once, two fetch threads, room for one fetched KV awaiting
    admission: every one is loaded, none recomputed, each gives one engine's tokens."""
    prompts = [[(13 * i + 5 * j) % 500 + 1 for j in range(20 + 7 * i)] for i in range(12)]
    one = tiny_llm(tiny_llama_dir)
    want = [list(o.outputs[0].token_ids) for o in one.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)]
    one.shutdown()
    producer = _producer(tiny_llama_dir)
    consumer = tiny_llm(tiny_llama_dir, block_size=8, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_fetch_workers": 2, "kv_fetch_buffer_bytes": 1}})
    try:
        params = [_prefill(producer, p) for p in prompts]
        outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                                 [_greedy(kv_transfer_params=kp) for kp in params],
                                 use_tqdm=False)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == len(prompts) and connector.num_failed == 0
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert all(o.num_cached_tokens == len(p) - 1 for o, p in zip(outs, prompts))
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("extra", [{"kv_ttl_s": 0}, {"kv_fetch_workers": -1},
                                   {"kv_buffer_bytes": "big"}])
def test_bad_connector_settings_are_refused(tiny_llama_dir, extra) -> None:
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.{next(iter(extra))}"):
        tiny_llm(tiny_llama_dir, kv_transfer_config={
            "kv_connector": "P2PConnector", "kv_role": "kv_both", "kv_port": 0,
            "kv_connector_extra_config": extra})
