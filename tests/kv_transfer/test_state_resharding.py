"""Linear-attention states between engines of different tensor-parallel sizes
(kv_transfer/states.py): a payload holds a layer's state in the model's order of conv
channels and value heads, whatever the producer's ranks, and each consumer rank takes its
slices. The layout comes from the layers themselves: a Gated DeltaNet and a Kimi Delta
Attention layer, built at one rank and at each of two, load the same checkpoint conv weights
and per-head values; states made of those regather from two ranks into the one rank's state
and split back. End to end: a tiny Qwen3.5
prefilled on one rank decodes on two, and prefilled on two decodes on one, with the one
engine's greedy tokens."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams
from shoal.core.kv_cache_spec import LinearStateSpec
from shoal.kv_transfer.states import (
    rank_share,
    read_state,
    state_pages,
    to_model_order,
    write_state,
)
from shoal.layers import gated_delta_net, kimi_delta_attention
from shoal.layers import linear as linear_module
from shoal.layers.gated_delta_net import GatedDeltaNet
from shoal.layers.kimi_delta_attention import KimiDeltaAttention

GDN_CFG = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=4, linear_value_head_dim=3,
                          linear_conv_kernel_dim=4, hidden_size=8, rms_norm_eps=1e-6)
KDA_CFG = SimpleNamespace(linear_num_heads=2, linear_head_dim=4, linear_conv_kernel_dim=4,
                          hidden_size=8, rms_norm_eps=1e-6)


def _at_rank(monkeypatch, rank: int, world: int) -> None:
    for module in (linear_module, gated_delta_net, kimi_delta_attention):
        monkeypatch.setattr(module, "get_tp_world_size", lambda: world, raising=False)
        monkeypatch.setattr(module, "get_tp_rank", lambda: rank, raising=False)


def _gdn():
    # (Qwen3.5's in-projections; Qwen3-Next's load the conv weight alike)
    return GatedDeltaNet(GDN_CFG, torch.float32, interleaved=False)


def _kda():
    return KimiDeltaAttention(KDA_CFG, torch.float32)


def _checkpoint(kind: str) -> dict[str, torch.Tensor]:
    """The layer's conv weights and per-head values as a checkpoint holds them (random)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "kda":
        full = KDA_CFG.linear_num_heads * KDA_CFG.linear_head_dim
        return {**{f"{p}_conv1d": torch.randn(full, 1, 4, generator=gen) for p in "qkv"},
                "A_log": torch.randn(1, 1, KDA_CFG.linear_num_heads, 1, generator=gen)}
    c = GDN_CFG
    channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + \
        c.linear_num_value_heads * c.linear_value_head_dim
    return {"conv1d": torch.randn(channels, 1, 4, generator=gen),
            "A_log": torch.randn(c.linear_num_value_heads, generator=gen)}


def _rank_state(build, kind: str, monkeypatch, rank: int, world: int
                ) -> tuple[LinearStateSpec, torch.Tensor]:
    """The layer's spec at `rank` of `world` and a state of it, as read_state gives it: the
    conv state is its loaded conv weight's first taps (a channel's weight row is that
    channel's), head h's delta-rule state is made of its A_log value."""
    _at_rank(monkeypatch, rank, world)
    layer = build()
    weight, a_log = layer.conv1d.weight, layer.A_log
    for name, loaded in _checkpoint(kind).items():
        if name.endswith("conv1d"):
            shard = name[0] if kind == "kda" else None
            args = (shard,) if shard else ()
            weight.weight_loader(weight, loaded, *args)
        else:
            a_log.weight_loader(a_log, loaded)
    spec = layer.kv_cache_spec(4)
    conv = weight[:, :spec.conv_width].float()
    taps = torch.arange(spec.key_dim * spec.value_dim, dtype=torch.float32)
    state = (a_log.float()[:, None] * 100 + taps).view(-1, spec.key_dim, spec.value_dim)
    cache = torch.zeros(2, 2, 1, spec.state_words)  # two blocks of one token
    pages = state_pages(cache, 1, spec)
    pages.write_one(1, conv, state)
    return spec, read_state(pages, 1).reshape(-1)


@pytest.mark.parametrize("kind, build", [("gdn", _gdn), ("kda", _kda)],
                         ids=["gated-deltanet", "kda"])
def test_two_ranks_states_regather_into_one_ranks_and_split_back(monkeypatch, kind, build
                                                                ) -> None:
    one_spec, whole = _rank_state(build, kind, monkeypatch, 0, 1)
    specs, ranks = zip(*(_rank_state(build, kind, monkeypatch, r, 2) for r in (0, 1)))
    spec = specs[0]
    assert spec.conv_dim * 2 == one_spec.conv_dim and len(spec.conv_parts) == 3
    assert torch.equal(to_model_order(torch.stack(ranks), spec), whole)
    for r in (0, 1):
        assert torch.equal(rank_share(whole, spec, r, 2), ranks[r])
    assert rank_share(whole, one_spec, 0, 1).data_ptr() == whole.data_ptr()  # no copy
    assert torch.equal(to_model_order(whole[None], one_spec), whole)  # one rank: unchanged
    # the parts matter: the conv channels taken as one part land elsewhere
    assert not torch.equal(to_model_order(torch.stack(ranks), replace(spec, conv_parts=())),
                           whole)
    # and a rank's share written into its pages reads back as that rank's state
    cache = torch.zeros(2, 2, 1, spec.state_words)
    write_state(state_pages(cache, 1, spec), 0, rank_share(whole, spec, 1, 2))
    assert torch.equal(read_state(state_pages(cache, 1, spec), 0).reshape(-1), ranks[1])


def test_unsplittable_states_are_refused(monkeypatch) -> None:
    spec, whole = _rank_state(_gdn, "gdn", monkeypatch, 0, 1)
    with pytest.raises(ValueError, match=f"state of {spec.state_bytes} bytes does not split "
                                         f"into 3 tensor-parallel ranks' states of "
                                         f"{spec.state_bytes // 2} bytes"):
        rank_share(whole, replace(spec, conv_dim=spec.conv_dim // 2, conv_parts=(),
                                  state_heads=spec.state_heads // 2), 0, 3)
    with pytest.raises(ValueError, match=r"conv_parts \(4, 4\) do not add up to conv_dim"):
        to_model_order(whole[None], replace(spec, conv_parts=(4, 4)))
    # 2 key heads over 4 ranks: no layer to take a state at all
    _at_rank(monkeypatch, 0, 4)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) is not divisible by "
                                         r"tensor_parallel_size \(4\)"):
        GatedDeltaNet(GDN_CFG, torch.float32, interleaved=False)


# ---- end to end: a tiny Qwen3.5 (Gated DeltaNet beside attention) ------------------------
LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
BLOCK = 64


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


PROMPTS = [_prompt(1, 2 * BLOCK + 22), _prompt(2, BLOCK + 9)]  # one rank -> two
MORE = [_prompt(3, 2 * BLOCK + 5), _prompt(4, BLOCK + 30)]  # two ranks -> one
SENT = [2 * BLOCK, BLOCK]  # the last block end before each prompt's last token


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen35"), "qwen3_5_text", seed=4,
                                 **LINEAR)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=512, num_gpu_blocks_override=24,
               max_num_batched_tokens=256, kv_transfer_config={
                   "kv_connector": "P2PConnector", "kv_role": "kv_both", "kv_port": 0}, **kw)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)


def _prefill(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False)
    params = [o.kv_transfer_params for o in outs]
    assert [kp["remote_num_tokens"] for kp in params] == SENT
    return params


def _decode(llm: LLM, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == SENT  # loaded, the rest computed
    return [list(o.outputs[0].token_ids) for o in outs]


def _state_bytes(llm: LLM) -> int:
    runner = llm.llm_engine.core.runner
    specs = getattr(runner, "driver", runner).kv_specs
    return next(s.state_bytes for s in specs if isinstance(s, LinearStateSpec))


def test_states_move_between_one_and_two_tensor_parallel_ranks(qwen35) -> None:
    """As test_p2p_engines' two-rank test: two engines in one process share
    torch.distributed's world, so the one-rank engine prefills before the two-rank one starts
    and decodes once that one's ranks have stopped (its connector still serving)."""
    one = _llm(qwen35)
    two = None
    try:
        want = [list(o.outputs[0].token_ids) for o in one.generate(
            [{"prompt_token_ids": p} for p in PROMPTS + MORE], _greedy(), use_tqdm=False)]
        assert one.reset_prefix_cache()
        params = _prefill(one, PROMPTS)
        whole = _state_bytes(one)
        two = _llm(qwen35, tensor_parallel_size=2)
        assert _state_bytes(two) * 2 == whole  # each rank holds half of every layer's state
        assert _decode(two, PROMPTS, params) == want[:len(PROMPTS)]
        assert two.llm_engine.core.kv_connector.num_loaded == len(PROMPTS)

        params = _prefill(two, MORE)
        for kept in two.llm_engine.core.kv_connector._store.values():  # the whole state
            layout = kept.payload.layout
            assert all(layout.layers[i] == [1, 1, 1, whole] for i in layout.states)
        two.llm_engine.core.runner.shutdown()
        assert _decode(one, MORE, params) == want[len(PROMPTS):]
        assert one.llm_engine.core.kv_connector.num_loaded == len(MORE)
    finally:
        one.shutdown()
        if two is not None:
            two.shutdown()
