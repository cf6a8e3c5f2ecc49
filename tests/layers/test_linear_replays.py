"""What verify graphs of linear-attention layers rest on: rows of a few tokens at fixed shapes
(padding tokens leave a row's state and conv state exactly as its real tokens leave them,
whatever the padding holds), and the replay slots of kept inputs (a request outside the step
spilled when slots run out, restored when it folds its run in)."""

from __future__ import annotations

import pytest
import torch

from shoal.layers.linear_replays import TRASH_SLOT, KeptInputs, ReplaySlots
from shoal.layers.ops.delta_rule_rows import causal_conv1d_rows, gated_delta_rule_rows
from shoal.layers.ops.gated_delta_rule import causal_conv1d, recurrent_gated_delta_rule


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_padding_tokens_leave_each_rows_state_as_its_real_tokens_do(per_channel: bool):
    gen = torch.Generator().manual_seed(0)
    R, T, H, D, C, Kc = 3, 4, 2, 8, 6, 4
    counts = torch.tensor([4, 1, 0])

    def rand(*shape):
        return torch.randn(*shape, generator=gen)
    q, k, v = rand(R, T, H, D), rand(R, T, H, D), rand(R, T, H, D)
    k = k / k.norm(dim=-1, keepdim=True)
    g = -rand(R, T, H, *([D] if per_channel else [])).abs()
    beta = rand(R, T, H).sigmoid()
    state = rand(R, H, D, D)
    x, conv0, w, b = rand(R, T, C), rand(R, C, Kc - 1), rand(C, Kc), rand(C)
    for t in (q, k, v, g, beta, x):  # padding holds anything, NaN included
        for r, n in enumerate(counts.tolist()):
            t[r, n:] = float("nan")
    o, end = gated_delta_rule_rows(q, k, v, g, beta, state, counts, scale=0.5)
    y, conv_end = causal_conv1d_rows(x, w, b, conv0, counts)
    for r, n in enumerate(counts.tolist()):
        s = state[r:r + 1]
        for t in range(n):
            want, s = recurrent_gated_delta_rule(q[r:r + 1, t], k[r:r + 1, t], v[r:r + 1, t],
                                                 g[r:r + 1, t], beta[r:r + 1, t], s, scale=0.5)
            torch.testing.assert_close(o[r, t], want[0])
        assert torch.equal(end[r], s[0])  # exactly: padding steps are identities
        if n == 0:  # a padding row: its conv state as read
            assert torch.equal(conv_end[r], conv0[r])
            continue
        ref_y, ref_conv = causal_conv1d(x[r, :n], w, b, conv0[r])
        torch.testing.assert_close(y[r, :n], ref_y)
        assert torch.equal(conv_end[r], ref_conv)


class _Layer:
    def __init__(self):
        self.kept = KeptInputs(2, 3, 4, torch.float32, torch.device("cpu"))


def test_replay_slots_spill_a_request_outside_the_step_and_restore_it():
    layers = [_Layer(), _Layer()]
    slots = ReplaySlots(2, layers)
    a, b = slots.assign([1, 2], [0, 0], [True, True])
    assert sorted([a, b]) == [1, 2] and TRASH_SLOT not in (a, b)
    for i, layer in enumerate(layers):
        layer.kept.buffer[a] = 10.0 + i
        layer.kept.buffer[b] = 20.0 + i
    # Request 3 verifies while 1 and 2 (outside the step, e.g. preempted) hold both slots:
    # the one held longest (1) moves aside.
    (c,) = slots.assign([3], [0], [True])
    assert c == a and slots.held == 2
    for layer in layers:
        layer.kept.buffer[c] = -1.0
    # Request 1 folds its run in (no verify): back in a slot (2 spilled now), then given back.
    (d,) = slots.assign([1], [2], [False])
    assert d == b
    for i, layer in enumerate(layers):
        assert torch.equal(layer.kept.buffer[d], torch.full((3, 4), 10.0 + i))
    assert slots.held == 1  # 3's; 1 gave its slot back after the step
    (e,) = slots.assign([2], [1], [True])  # 2 restored and verifying again: keeps it
    for i, layer in enumerate(layers):
        assert torch.equal(layer.kept.buffer[e], torch.full((3, 4), 20.0 + i))
    assert slots.held == 2
    slots.forget({2, 3})
    assert slots.held == 0
    with pytest.raises(RuntimeError, match="serial 2"):
        slots.assign([2], [1], [False])  # forgotten: nothing to fold
    with pytest.raises(ValueError, match="max_num_seqs"):
        slots.assign([4, 5, 6], [0, 0, 0], [True, True, True])


def test_preempted_verifiers_give_the_tokens_of_no_speculation(tmp_path, monkeypatch):
    """A tiny Qwen3.5 under speculation with too few blocks for its requests (prompts just
    short of a 64-token block, so decoding crosses into the next): requests are preempted and
    come back; every replay slot is given back; tokens as without speculation."""
    from oracle import write_tiny_checkpoint
    from worker.test_hybrid_verify_graphs_cpu import LINEAR, SPEC, _scripted_drafts

    from shoal import LLM, SamplingParams

    path = write_tiny_checkpoint(tmp_path / "qwen3_5", "qwen3_5_text", seed=4, **LINEAR)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (60, 58, 62, 55)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**kw) -> tuple[LLM, list[list[int]]]:
        llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=64,
                  num_gpu_blocks_override=10, max_model_len=256, max_num_seqs=3,
                  enable_prefix_caching=False, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]

    _, plain = run()
    _scripted_drafts(monkeypatch, {tuple(p): t for p, t in zip(prompts, plain)})
    llm, got = run(speculative_config=SPEC)
    assert got == plain
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert llm.llm_engine.core.runner.forwarder.replay_slots.held == 0
