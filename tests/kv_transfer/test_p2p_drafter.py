"""Prefill/decode disaggregation with a drafter of layers on both sides (kv_transfer/
draft_rows.py): the drafter's rows of the prompt travel with the target's, so the consumer's
drafts are one engine's. Tiny random models in float32 on the CPU:

- DeepSeek-V3 with its MTP layer (the "bigram" checkpoint of spec_decode/test_mtp.py: most
  drafts are accepted) and a Llama target with an EAGLE-1 head: the consumer's tokens, spec
  counters and every proposal equal one engine's, its drafter's cache filled with noise
  before each run (what a block's previous owner leaves); zeroing the drafter's part of the
  payload changes the acceptance.
- A producer without a drafter: the consumer zeroes its drafter's rows of the loaded tokens
  (never reads the noise), exactly as a zeroed payload, and its tokens stay exact; a consumer
  without one gets and loads the target's rows alone.
- In pieces: the layout's drafter part on the wire, and a drafter part that does not fit
  (another drafter) zeroed with a warning instead of written; the drafter's bytes go only to
  a consumer whose fetch asks for them (an older one, or one without a drafter, gets the
  target's bytes alone)."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch
from engine_helpers import random_prompts, tiny_llm
from safetensors.torch import load_file, save_file
from spec_decode.proposal_log import record_proposals
from spec_decode.test_eagle import H, eagle_weights, write_eagle
from spec_decode.test_mtp import build_checkpoints
from spec_decode.test_spec_engine import SpecCounter

from shoal import SamplingParams
from shoal.core.kv_connector_plan import KVLayout
from shoal.kv_transfer.base import EngineInfo, KVRows
from shoal.kv_transfer.config import KVTransferConfig
from shoal.kv_transfer.draft_rows import DraftRows
from shoal.kv_transfer.p2p import P2PConnector, prompt_digest
from shoal.kv_transfer.rows import LayerTables, gather_rows
from shoal.kv_transfer.transport import fetch

STEPS = 12
PROMPTS = random_prompts(4, seed=5, lo=10, hi=40)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    target, _ = build_checkpoints(tmp_path_factory.mktemp("mtp"))["bigram"]
    return target, {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def eagle_target(tiny_llama_dir, tmp_path_factory):
    """test_eagle.py's "bigram" pair: a Llama whose layers add nothing to the residual and
    an EAGLE-1 head that mostly passes its input token's embedding through."""
    root = tmp_path_factory.mktemp("eagle")
    weights = load_file(tiny_llama_dir / "model.safetensors")
    target = root / "target"
    target.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", target / "config.json")
    save_file({n: t * 0.0 if re.search(r"(o_proj|down_proj)\.weight$", n) else t
               for n, t in weights.items()}, target / "model.safetensors")
    head = eagle_weights(seed=6, attn_scale=0.02, mlp_scale=0.02)
    head["fc.weight"] = torch.cat([10 * torch.diag(weights["model.norm.weight"]),
                                   torch.zeros(H, H)], dim=1)
    head["fc.bias"] = 0.01 * torch.randn(H, generator=torch.Generator().manual_seed(7))
    folder = write_eagle(root / "head", head, bin_format=False)
    return target, {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3}


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


def _role(role: str) -> dict:
    return {"kv_transfer_config": {"kv_connector": "P2PConnector", "kv_role": role,
                                   "kv_port": 0}}


class Run:
    """One engine's answer to PROMPTS: tokens, spec counters, proposals (sequence, drafts)."""

    def __init__(self, llm, params: list[dict] | None = None):
        counter, log = SpecCounter(llm), record_proposals(llm)
        sps = [_greedy(kv_transfer_params=kp) for kp in params] if params else _greedy()
        outs = llm.generate(PROMPTS, sps, use_tqdm=False)
        self.tokens = [list(o.outputs[0].token_ids) for o in outs]
        self.counts = (counter.drafts, counter.draft_tokens, counter.accepted)
        self.proposals = sorted((tuple(s), tuple(d)) for s, d in log)


def _prefill(producer) -> list[dict]:
    outs = producer.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False)
    return [o.kv_transfer_params for o in outs]


def _drafter_rows(consumer) -> DraftRows:
    draft = consumer.llm_engine.core.runner._connector_layout()[2]
    assert draft is not None
    return draft


def _noisy(consumer) -> None:
    """Every block's drafter rows hold noise, as rows of earlier requests (the null block
    and the scratch blocks after it stay as they are); the prefix cache is emptied."""
    runner = consumer.llm_engine.core.runner
    slots = runner.drafter.null_block * runner.block_size
    gen = torch.Generator().manual_seed(0)
    for kv in _drafter_rows(consumer).caches:
        kv[:, :slots] = torch.randn(kv[:, :slots].shape, generator=gen)
    assert consumer.reset_prefix_cache()


def _zeroing_the_drafter_part(consumer) -> None:
    connector = consumer.llm_engine.core.kv_connector
    fetch = connector._fetch

    def zeroed(params, prompt):
        got = fetch(params, prompt)
        layout = got.payload.layout
        memoryview(got.payload.data).cast("B")[layout.own_nbytes:] = bytes(layout.draft.nbytes)
        return got
    connector._fetch = zeroed


@pytest.mark.parametrize("family,producer_kw", [
    ("mtp", {}), ("mtp", {"max_num_batched_tokens": 16, "async_scheduling": True}),
    ("eagle", {})], ids=["mtp", "mtp-chunked-async-producer", "eagle"])
def test_the_drafters_kv_travels_with_the_prompt(request, family, producer_kw) -> None:
    """Chunked and async on the producer: the drafter mirrors chunks that sample nothing,
    then the last one behind a step already launched, before its rows are read out."""
    target, spec = request.getfixturevalue(f"{family}_target")
    one = Run(tiny_llm(target, speculative_config=spec))
    producer = tiny_llm(target, speculative_config=spec, **_role("kv_producer"), **producer_kw)
    consumer = tiny_llm(target, speculative_config=spec, **_role("kv_consumer"))
    try:
        _noisy(consumer)
        params = _prefill(producer)
        got = Run(consumer, params)
        assert got.tokens == one.tokens
        assert got.counts == one.counts and one.counts[2] > 0
        assert got.proposals == one.proposals
        draft = _drafter_rows(consumer)
        assert (draft.num_loaded, draft.num_zeroed) == (len(PROMPTS), 0)
        assert consumer.llm_engine.core.kv_connector.num_loaded == len(PROMPTS)

        _noisy(consumer)
        _zeroing_the_drafter_part(consumer)  # the drafter's rows of the prompt lost
        cold = Run(consumer, _prefill(producer))
        assert cold.tokens == one.tokens
        assert cold.counts[2] != one.counts[2] and cold.proposals != one.proposals
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_one_side_without_a_drafter(mtp_target, caplog) -> None:
    """A producer without a drafter: the consumer cannot warm its drafter, so it zeroes the
    drafter's rows of the loaded tokens and drafts exactly as from a zeroed payload, never
    from what its blocks held. A consumer without one gets the target's rows alone from a
    producer with one. Tokens exact both ways."""
    target, spec = mtp_target
    one = Run(tiny_llm(target, speculative_config=spec))
    plain = tiny_llm(target, **_role("kv_both"))
    producer = tiny_llm(target, speculative_config=spec, **_role("kv_producer"))
    consumer = tiny_llm(target, speculative_config=spec, **_role("kv_consumer"))
    try:
        _noisy(consumer)
        with caplog.at_level(logging.WARNING, logger="shoal.kv_transfer.draft_rows"):
            cold = Run(consumer, _prefill(plain))
        assert cold.tokens == one.tokens
        draft = _drafter_rows(consumer)
        assert (draft.num_loaded, draft.num_zeroed) == (0, len(PROMPTS))
        _noisy(consumer)
        _zeroing_the_drafter_part(consumer)
        zeroed = Run(consumer, _prefill(producer))
        assert (cold.counts, cold.proposals) == (zeroed.counts, zeroed.proposals)
        assert (draft.num_loaded, draft.num_zeroed) == (len(PROMPTS), len(PROMPTS))

        assert plain.reset_prefix_cache()  # (it prefilled PROMPTS itself)
        outs = plain.generate(PROMPTS, [_greedy(kv_transfer_params=kp)
                                        for kp in _prefill(producer)], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == one.tokens
        assert plain.llm_engine.core.kv_connector.num_loaded == len(PROMPTS)
    finally:
        plain.shutdown()
        producer.shutdown()
        consumer.shutdown()
    assert any("sent no drafter KV" in r.message for r in caplog.records)


# ---- in pieces ---------------------------------------------------------------------------
def _drafter(caches: list[torch.Tensor]) -> DraftRows:
    n = len(caches)
    rows = KVRows(str(caches[0].dtype).removeprefix("torch."),
                  [(kv.shape[0], kv.shape[2], kv.shape[3] * kv.element_size())
                   for kv in caches], (None,) * n)
    return DraftRows(caches, LayerTables((0,) * n, (None,) * n), rows)


def test_a_drafter_part_moves_or_is_zeroed(caplog) -> None:
    """Blocks of 4; a target layer and a drafter layer of 2 planes x 2 heads x 4 floats.
    Tokens [0, 10) out of blocks [3, 0, 5], loaded [2, 10) into blocks [1, 4, 2]; the
    drafter's rows after the target's, on the wire too. A drafter of other heads (another
    speculative config) gets zeros there instead, and a warning."""
    gen = torch.Generator().manual_seed(1)
    target = [torch.randn(2, 7 * 4, 2, 4, generator=gen)]
    src = _drafter([torch.randn(2, 7 * 4, 2, 4, generator=gen)])
    n, src_ids, dst_ids = 10, [3, 0, 5], [1, 4, 2]
    payload = gather_rows(target, src_ids, 4, n, draft=src.layout(n))
    layout = payload.layout
    assert layout.draft == src.layout(n) and layout.draft.layers == [[2, n, 2, 16]]
    assert layout.nbytes == layout.own_nbytes + layout.draft.nbytes == 2 * (2 * n * 2 * 16)
    src.save(payload, src_ids, 4, n)
    assert KVLayout.from_wire(layout.to_wire()) == layout
    with pytest.raises(ValueError, match="the drafter's part must hold token rows"):
        KVLayout.from_wire({**layout.to_wire(), "draft": {
            **layout.draft.to_wire(), "num_tokens": n - 1, "layers": [[2, n - 1, 2, 16]]}})

    pos = torch.arange(2, n)
    src_slots = torch.tensor(src_ids)[pos // 4] * 4 + pos % 4
    dst_slots = torch.tensor(dst_ids)[pos // 4] * 4 + pos % 4
    dst = _drafter([torch.full((2, 7 * 4, 2, 4), 5.0)])
    assert dst.load(layout, payload.data, dst_ids, 4, 2, n - 2)
    assert torch.equal(dst.caches[0][:, dst_slots], src.caches[0][:, src_slots])
    assert (dst.caches[0][:, dst_ids[0] * 4:dst_ids[0] * 4 + 2] == 5).all()  # not loaded

    other = _drafter([torch.full((2, 7 * 4, 1, 4), 5.0)])  # one KV head: another drafter
    assert "does not fit this drafter" in other.unfit(layout)
    with caplog.at_level(logging.WARNING, logger="shoal.kv_transfer.draft_rows"):
        assert not other.load(layout, payload.data, dst_ids, 4, 2, n - 2)
    assert (other.caches[0][:, dst_slots] == 0).all()
    assert (other.caches[0] != 0).sum() == other.caches[0].numel() - dst_slots.numel() * 8
    assert other.num_zeroed == 1
    assert any("does not fit this drafter" in r.message for r in caplog.records)


def test_the_drafters_rows_go_only_to_a_consumer_that_asks() -> None:
    """Over TCP, no model: a producer keeps a payload with a drafter part; a consumer with a
    drafter of layers gets all of it, one without gets the target's bytes alone (the old
    layout, no "draft"), and so does a fetch without the field, as an older consumer sends."""
    gen = torch.Generator().manual_seed(2)
    n, ids = 10, [3, 0, 5]
    target = [torch.randn(2, 7 * 4, 2, 4, generator=gen)]
    src = _drafter([torch.randn(2, 7 * 4, 1, 4, generator=gen)])
    payload = gather_rows(target, ids, 4, n, draft=src.layout(n))
    src.save(payload, ids, 4, n)
    own, full = payload.layout.own_nbytes, payload.layout.nbytes
    assert 0 < own < full
    prompt = list(range(100, 100 + n + 1))

    def engine(drafter_kv: bool) -> EngineInfo:
        return EngineInfo(4, 1, "m", drafter_kv=drafter_kv)

    producer = P2PConnector(KVTransferConfig("P2PConnector", "kv_producer", kv_port=0),
                            engine(True))
    consumers = {kv: P2PConnector(KVTransferConfig("P2PConnector", "kv_consumer"), engine(kv))
                 for kv in (True, False)}
    try:
        def keep(key: str) -> dict:
            producer._pending_saves[key] = prompt_digest(prompt[:n])
            producer.saved({key: payload})
            return {"remote_host": "127.0.0.1", "remote_port": producer.server.port,
                    "remote_request_id": key}

        for drafter_kv, consumer in consumers.items():
            got = consumer._fetch(keep(f"k{drafter_kv}"), prompt).payload
            assert got is not None and bytes(got.data) == bytes(payload.data)[:got.nbytes]
            if drafter_kv:
                assert got.layout == payload.layout and got.nbytes == full
            else:
                assert got.layout.draft is None and got.nbytes == len(got.data) == own
                assert got.layout.layers == payload.layout.layers

        params = keep("old")
        header, data = fetch("127.0.0.1", params["remote_port"], {"key": "old"}, 10.0)
        assert "draft" not in header["layout"] and len(data) == own
        assert KVLayout.from_wire(header["layout"]).nbytes == own
    finally:
        producer.shutdown()
        for consumer in consumers.values():
            consumer.shutdown()
