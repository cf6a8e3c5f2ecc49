"""allowed_token_ids and logprob_token_ids in the sampler, on random logits: only allowed ids
are ever sampled (greedy and random, mixed with unrestricted rows), logprobs stay the raw ones,
and rows asking for logprob_token_ids get exactly those ids' logprobs."""

from __future__ import annotations

import pytest
import torch

from shoal.sample.sampler import Sampler
from shoal.sample.sampling_metadata import SamplingMetadata, make_generator
from shoal.sampling_params import SamplingParams

VOCAB = 64


def build(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    return SamplingMetadata.build(params, [[] for _ in params], [[] for _ in params],
                                  generators or {}, (), VOCAB, "cpu")


def test_metadata_leaves_fields_unset_when_unused() -> None:
    md = build([SamplingParams(temperature=0.0), SamplingParams(logprobs=2)])
    assert md.allowed_token_ids is None and md.logprob_token_ids is None
    md = build([SamplingParams(allowed_token_ids=[3, 4]), SamplingParams(),
                SamplingParams(logprob_token_ids=[7])])
    assert md.allowed_token_ids == {0: [3, 4]}
    assert md.logprob_token_ids == {2: [7]}
    assert md.max_num_logprobs is None  # the id row is not a top-k row


def test_greedy_picks_the_best_allowed_token_only_in_restricted_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    allowed = [5, 17, 40]
    md = build([SamplingParams(temperature=0.0, allowed_token_ids=allowed),
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.0, allowed_token_ids=[9])])
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out[0] == allowed[int(logits[0, allowed].argmax())]
    assert out[1] == int(logits[1].argmax())
    assert out[2] == 9
    assert logits.isfinite().all()  # the caller's logits are not masked in place


def test_random_sampling_stays_inside_allowed_ids_with_filters_and_penalties() -> None:
    torch.manual_seed(1)
    allowed = [2, 11, 30, 63]
    params = [SamplingParams(temperature=1.5, top_p=0.9, seed=3, allowed_token_ids=allowed,
                             presence_penalty=0.5, logit_bias={0: 100.0}),
              SamplingParams(temperature=1.0)]
    seen: set[int] = set()
    other: set[int] = set()
    for _ in range(200):
        md = build(params, {0: make_generator(torch.randint(0, 1000, ()).item(), "cpu")})
        out = Sampler()(torch.randn(2, VOCAB), md).sampled_token_ids.tolist()
        seen.add(out[0])
        other.add(out[1])
    assert seen <= set(allowed) and len(seen) > 1  # a bias of +100 cannot revive token 0
    assert not other <= set(allowed)  # the unrestricted row is unaffected


def test_logprobs_are_raw_and_rank_the_sampled_token_in_the_full_vocab() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    md = build([SamplingParams(temperature=0.0, allowed_token_ids=[8], logprobs=2)])
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.sampled_token_ids.tolist() == [8]
    lt = out.logprobs
    assert lt.token_ids[0, 0] == 8
    assert torch.allclose(lt.logprobs[0, 0], raw[8])
    assert lt.ranks[0] == int((raw > raw[8]).sum()) + 1
    assert lt.token_ids[0, 1:].tolist() == raw.topk(2).indices.tolist()


def test_logprob_token_ids_rows_report_their_ids_beside_top_k_rows() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    md = build([SamplingParams(temperature=0.0, logprob_token_ids=[50, 1, 33]),
                SamplingParams(temperature=0.0, logprobs=1),
                SamplingParams(temperature=0.0, logprob_token_ids=[4], allowed_token_ids=[42])])
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)
    lt = out.logprobs
    sampled = out.sampled_token_ids.tolist()
    assert sampled[2] == 42
    assert lt.token_ids[0, :4].tolist() == [sampled[0], 50, 1, 33]
    assert torch.allclose(lt.logprobs[0, :4], raw[0, [sampled[0], 50, 1, 33]])
    assert lt.token_ids[1, :2].tolist() == [sampled[1], int(raw[1].argmax())]
    assert lt.token_ids[2, :2].tolist() == [42, 4]
    assert torch.allclose(lt.logprobs[2, :2], raw[2, [42, 4]])


def test_fast_greedy_path_is_unchanged_without_the_fields() -> None:
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 2))
    assert out.logprobs is None
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("field", ["allowed_token_ids", "logprob_token_ids"])
def test_params_validate_the_id_lists(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: []})
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: [1, -2]})
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: [1, "x"]})
    sp = SamplingParams(**{field: [1, 70]})
    with pytest.raises(ValueError, match=f"{field} token id 70 is out of range"):
        sp.validate_against_vocab(VOCAB)
    sp.validate_against_vocab(100)


def test_logprob_token_ids_count_and_logprobs_agreement() -> None:
    assert SamplingParams(logprob_token_ids=[1, 2]).num_logprobs == 2
    assert SamplingParams(logprobs=3).num_logprobs == 3
    assert SamplingParams(logprobs=2, logprob_token_ids=[1, 2]).num_logprobs == 2
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprobs=5, logprob_token_ids=[1])
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=list(range(129)))
