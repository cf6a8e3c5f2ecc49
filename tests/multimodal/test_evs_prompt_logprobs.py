"""Prompt logprobs of a Qwen3-VL prompt whose video EVS prunes, on the tiny random checkpoint
of tests/vl_checkpoints.py.

The prompt (and the prompt_token_ids a user gets back) keeps the planned layout of the video's
span, while the model reads the timestamp texts between frames where the kept tokens put them
(test_qwen3_vl_evs), so at some span positions it reads another id than the prompt's. What is
expected: one entry per prompt token; None for the first token and for each position whose
prompt token the model does not read there; elsewhere the logprob of the prompt's token given
what the model read before it. The oracle is transformers' language model over the pruned
sequence (test_qwen3_vl_evs.hand_made: kept tower rows, the texts' embeddings, unpruned M-RoPE
positions at the kept columns, deepstack), scored at each position."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_qwen3_vl_evs import TEXT, evs_video, hand_made
from test_qwen3_vl_video import Oracle
from vl_checkpoints import write_tiny_qwen3_vl

from shoal import LLM, SamplingParams
from shoal.engine.output_processor import OutputKind

RATE = 0.5
K = 2  # prompt_logprobs: the prompt's token and the 2 most likely


@torch.no_grad()
def reference_logprobs(oracle: Oracle, want: dict) -> torch.Tensor:
    """[L - 1, V]: transformers' log-softmax at each pruned-prompt position but the last."""
    lm, head = oracle.model.model.language_model, oracle.model.lm_head
    h = lm(inputs_embeds=want["embeds"][None], position_ids=want["positions"][:, None],
           visual_pos_masks=want["is_pad"][None],
           deepstack_visual_embeds=want["deepstack"]).last_hidden_state
    return torch.log_softmax(head(h[0, :-1]).float(), -1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    folder = write_tiny_qwen3_vl(tmp_path_factory.mktemp("evs_prompt_logprobs"))
    oracle, video = Oracle(folder), evs_video()
    want = hand_made(oracle, video, RATE)
    oracle.proc.video_pruning_rate = RATE
    planned, (feature,) = oracle.expand(TEXT, [], [video])
    # chunks of 8 tokens: the span's prompt logprobs come over several steps
    llm = LLM(model=str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=8,
              video_pruning_rate=RATE, num_gpu_blocks_override=256, block_size=16)
    return SimpleNamespace(llm=llm, planned=planned, seen=want["ids"], feature=feature,
                           ref=reference_logprobs(oracle, want),
                           prompt={"prompt": TEXT, "multi_modal_data": {"video": video}})


def params(n: int = 1, prompt_logprobs: int | None = K) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, n=n,
                          prompt_logprobs=prompt_logprobs)


def check(out, s: SimpleNamespace) -> None:
    """out's prompt logprobs line up with its prompt_token_ids and match the oracle."""
    planned, seen, f = s.planned, s.seen, s.feature
    assert out.prompt_token_ids == planned
    lps = out.prompt_logprobs
    assert len(lps) == len(planned) and lps[0] is None
    moved = {p for p in range(len(planned)) if planned[p] != seen[p]}
    # the case at hand: the plan and the kept tokens differ, and the span holds both kinds
    assert moved and all(f.offset <= p < f.end for p in moved)
    assert any(planned[p] == seen[p] for p in range(max(moved) + 1, f.end))
    for p in range(1, len(planned)):
        if p in moved:
            assert lps[p] is None, p
            continue
        ref, tid = s.ref[p - 1], planned[p]
        entry = lps[p]
        assert entry is not None and tid in entry, p
        assert entry[tid].logprob == pytest.approx(float(ref[tid]), abs=1e-4), p
        assert entry[tid].rank == int((ref > ref[tid]).sum()) + 1, p
        assert set(torch.topk(ref, K).indices.tolist()) <= set(entry), p


def test_prompt_logprobs_score_the_tokens_the_model_reads(setup) -> None:
    (out,) = setup.llm.generate(setup.prompt, params(), use_tqdm=False)
    check(out, setup)


def test_prompt_logprobs_with_n_streaming_and_a_cached_video(setup) -> None:
    s = setup
    # beside a request without prompt logprobs, sharing its video (one tower run)
    both = s.llm.generate([s.prompt, s.prompt], [params(prompt_logprobs=None), params(n=2)],
                          use_tqdm=False)
    assert both[0].prompt_logprobs is None and len(both[1].outputs) == 2
    check(both[1], s)
    # the video's blocks are cached now: a plain request hits them, one asking for prompt
    # logprobs recomputes the whole prompt
    (hit,) = s.llm.generate(s.prompt, params(prompt_logprobs=None), use_tqdm=False)
    assert hit.num_cached_tokens > s.feature.offset
    (again,) = s.llm.generate(s.prompt, params(), use_tqdm=False)
    check(again, s)
    # streamed: the prompt logprobs arrive with the chunks, the last output has them all
    engine = s.llm.llm_engine
    engine.add_request("streamed", s.prompt, params(), kind=OutputKind.DELTA)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished
    check(outs[-1], s)
