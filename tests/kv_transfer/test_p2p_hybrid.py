"""Prefill/decode disaggregation of a hybrid (Gated DeltaNet layers beside attention: a tiny
Qwen3.5 in fp32, blocks of 64). The producer sends the attention rows up to the last block end
before the prompt's last token and the linear layers' states there (computed inside the
prompt's chunk, or restored from its own prefix cache); the consumer writes both, computes the
rest as after a prefix hit, and gives one engine's greedy tokens and logprobs, with the same
or a larger block size. A prompt within its first block sends nothing. The rows and states in
pieces: across block sizes, a load that does not end where the states are, a two-rank
producer's states in the model's order (the TP resharding itself: test_state_resharding.py)."""

from __future__ import annotations

import random

import pytest
import torch
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, LinearStateSpec
from shoal.core.kv_connector_plan import KVLayout
from shoal.engine.kv_connector_setup import check_groups
from shoal.kv_transfer import rows as rows_module
from shoal.kv_transfer.base import KVRows
from shoal.kv_transfer.rows import LayerTables, gather_rows, scatter_rows
from shoal.kv_transfer.states import state_pages, to_model_order

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
BLOCK = 64  # raised from 16 so an attention page holds a linear layer's state
STEPS = 6


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


# two blocks exactly, not a multiple of the block, within the first block
PROMPTS = [_prompt(1, 2 * BLOCK), _prompt(2, 2 * BLOCK + 22), _prompt(3, 40)]
SENT = [BLOCK, 2 * BLOCK, 0]  # the last block end before the prompt's last token


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen35"), "qwen3_5_text", seed=4,
                                 **LINEAR)


def _llm(path, role: str | None = None, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=24,
                max_num_batched_tokens=256)
    if role is not None:
        args["kv_transfer_config"] = {"kv_connector": "P2PConnector", "kv_role": role,
                                      "kv_port": 0}
    return LLM(model=str(path), **{**args, **kw})


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0, **kw)


def _answer(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def _prefill(producer: LLM) -> tuple[list, list[int]]:
    outs = producer.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False)
    params = [o.kv_transfer_params for o in outs]
    assert [kp["remote_num_tokens"] if kp else 0 for kp in params] == SENT
    return params, [o.num_cached_tokens for o in outs]


def test_linear_states_go_with_the_attention_rows(qwen35) -> None:
    path = qwen35
    producer = _llm(path, "kv_producer")
    try:
        assert producer.llm_engine.config.cache_config.block_size == BLOCK
        want = [_answer(o) for o in producer.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)]
        assert producer.reset_prefix_cache()
        # first the states computed at a block end inside the prompt's chunk, then (the
        # producer's own prefix cache holding the prompts now) restored with the blocks
        for block_size, producer_hits in [(BLOCK, [0, 0, 0]), (2 * BLOCK, SENT)]:
            params, hits = _prefill(producer)
            assert hits == producer_hits
            consumer = _llm(path, "kv_consumer", block_size=block_size)
            try:
                outs = consumer.generate(
                    [{"prompt_token_ids": p} for p in PROMPTS],
                    [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
                connector = consumer.llm_engine.core.kv_connector
                assert connector.num_loaded == 2 and connector.num_failed == 0
                for out, (tokens, logprobs), sent in zip(outs, want, SENT):
                    got = _answer(out)
                    assert got[0] == tokens
                    assert max(abs(a - b) for a, b in zip(got[1], logprobs)) < 1e-4
                    assert out.num_cached_tokens == sent  # loaded, the rest computed
            finally:
                consumer.shutdown()
    finally:
        producer.shutdown()


def test_a_hybrid_producer_needs_prefix_caching(qwen35) -> None:
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        _llm(qwen35, "kv_producer", enable_prefix_caching=False)


# ---- in pieces ---------------------------------------------------------------------------
ATTN = FullAttentionSpec(2, 4, 4)  # 2 heads x 4 float32: 64 bytes a token, 2 planes
STATE = LinearStateSpec(2, 4, 4, conv_dim=4, conv_width=3, state_heads=2, key_dim=2,
                        value_dim=3)  # 24 words: 96 bytes, within a page of 8 tokens
GROUPS = (KVCacheGroup(ATTN, (0,)), KVCacheGroup(STATE, (1,)))


def _caches(blocks: int, block_size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, (blocks + 1) * block_size, 2, 4, generator=gen) for _ in range(2)]


def _state(cache: torch.Tensor, block_size: int, block: int) -> torch.Tensor:
    conv, state = state_pages(cache, block_size, STATE).read_one(block)
    return torch.cat([conv.reshape(-1), state.reshape(-1)])


def test_a_state_moves_to_the_block_covering_its_token_across_block_sizes(monkeypatch
                                                                           ) -> None:
    """Blocks of 8 on the producer, 16 on the consumer: rows [0, 24) and the state after token
    23 (the producer's block 2) go to the consumer's table entry 1, which its next token
    reads."""
    n, tables = 24, LayerTables.of(GROUPS)
    assert tables.state_layers == [1] and tables.first_sent(1, n) == n - 1
    src = _caches(8, 8, seed=0)
    src_ids, src_states = [3, 0, 5], [7, 7, 2]  # (the state table's early entries: dropped)
    payload = gather_rows(src, src_ids, 8, n, tables, [src_states])
    layout = payload.layout
    assert layout.states == [1] and layout.layers[1] == [1, 1, 1, STATE.state_bytes]
    assert payload.nbytes == 2 * n * 2 * 16 + STATE.state_bytes
    assert KVLayout.from_wire(layout.to_wire()) == layout
    with pytest.raises(ValueError, match="layer 0's state is not one row after token 23"):
        KVLayout.from_wire({**layout.to_wire(), "states": [0, 1]})
    KVRows("float32", [(2, 2, 16), (1, 1, STATE.state_bytes)], (None, None), (1,)).check(
        layout, 1)
    with pytest.raises(ValueError, match="linear-attention states in layers"):
        KVRows("float32", [(2, 2, 16), (2, 2, 16)]).check(layout, 1)

    dst = [torch.zeros(2, 5 * 16, 2, 4) for _ in range(2)]
    dst_ids, dst_states = [2, 0], [4, 1]
    scatter_rows(dst, layout, payload.data, dst_ids, 16, 0, n, tables, [dst_states])
    assert torch.equal(_state(dst[1], 16, 1), _state(src[1], 8, 2))
    pos = torch.arange(n)
    got = dst[0][:, torch.tensor(dst_ids)[pos // 16] * 16 + pos % 16]
    assert torch.equal(got, src[0][:, torch.tensor(src_ids)[pos // 8] * 8 + pos % 8])
    with pytest.raises(ValueError, match="states follow token 23, but the load ends at "
                                         "token 22"):
        scatter_rows(dst, layout, payload.data, dst_ids, 16, 0, n - 1, tables, [dst_states])
    # two consumer ranks each holding as large a state as the whole payload's: refused
    monkeypatch.setattr(rows_module, "get_tp_rank", lambda: 1)
    monkeypatch.setattr(rows_module, "get_tp_world_size", lambda: 2)
    with pytest.raises(ValueError, match="state of layer 1 is 1 x 1 x 96 bytes; this model's "
                                         "at 2 tensor-parallel ranks is 1 x 1 x 192"):
        scatter_rows(dst, layout, payload.data, dst_ids, 16, 0, n, tables, [dst_states])


def test_each_rank_takes_its_own_state_of_a_two_rank_payload(monkeypatch) -> None:
    """A two-rank producer's state layer holds both ranks' states in the model's order:
    consumer rank r of two writes state r."""
    n, tables = 8, LayerTables.of(GROUPS)
    src = [_caches(2, 8, seed=s) for s in (1, 2)]  # ranks 0 and 1 of the producer
    parts = [gather_rows(c, [0], 8, n, tables, [[1]]) for c in src]
    layout = parts[0].layout
    one = [bytes(p.data) for p in parts]
    size = 2 * n * 2 * 16
    # a two-rank payload as gather_rows assembles it: the attention rows of its 4 heads
    # (here two ranks' 2 heads, head-major), then both ranks' states in the model's order
    rows = [torch.frombuffer(bytearray(b[:size]), dtype=torch.uint8).view(2, n, 2, 16)
            for b in one]
    states = [torch.frombuffer(bytearray(b[size:]), dtype=torch.uint8) for b in one]
    data = torch.cat([torch.cat(rows, dim=2).reshape(-1),
                      to_model_order(torch.stack(states), STATE)]).numpy()
    wide = KVLayout(layout.dtype, n, [[2, n, 4, 16], [1, 1, 1, 2 * STATE.state_bytes]],
                        layout.starts, layout.states)
    KVRows("float32", [(2, 2, 16), (1, 1, STATE.state_bytes)], (), (1,)).check(wide, 2)
    with pytest.raises(ValueError, match="state of layer 1 \\(1 x 1 x 192 bytes\\) does "
                                         "not fit this model's \\(1 ranks of 96"):
        KVRows("float32", [(2, 4, 16), (1, 1, STATE.state_bytes)], (), (1,)).check(wide, 1)
    for rank in (0, 1):
        monkeypatch.setattr(rows_module, "get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr(rows_module, "get_tp_world_size", lambda: 2)
        dst = [torch.zeros(2, 3 * 8, 2, 4) for _ in range(2)]
        scatter_rows(dst, wide, data, [1], 8, 0, n, tables, [[0]])
        assert torch.equal(_state(dst[1], 8, 0), _state(src[rank][1], 8, 1))
        assert torch.equal(dst[0][:, 8:16], src[rank][0][:, :8])  # its own heads' rows


def test_a_kind_not_known_to_move_is_refused() -> None:
    """(DeepSeek-V4's groups move: test_p2p_deepseek_v4.py; its first version's per-token
    compressor inputs, which no model declares now, do not.)"""
    from shoal.core.kv_cache_spec import CompressorInputSpec

    groups = [KVCacheGroup(ATTN, (0,)), KVCacheGroup(STATE, (1,)),
              KVCacheGroup(CompressorInputSpec(1, 8, 4), (2,))]
    with pytest.raises(ValueError, match=r"group 2 of 3 holds DeepSeek-V4's per-token "
                                         r"compressor inputs"):
        check_groups(groups)
    check_groups(groups[:2])
