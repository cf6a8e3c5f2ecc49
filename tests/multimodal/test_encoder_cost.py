"""The scheduler's encoder budget (engine/encoder_schedule.py) counts what the encoder computes,
the cache what it keeps: a pruned video (EVS) keeps fewer rows than its tower computes over
every frame. One costing more than a step's whole budget runs alone in a step, not never."""

from __future__ import annotations

from shoal.core.request import Request
from shoal.engine.encoder_schedule import EncoderSchedule
from shoal.multimodal.inputs import MultiModalFeature
from shoal.sampling_params import SamplingParams


def _request(serial: int, *features: MultiModalFeature) -> Request:
    req = Request(f"r{serial}", list(range(200)), SamplingParams(max_tokens=4),
                  frozenset(), 4, serial=serial)
    req.mm_features = list(features)
    return req


def _video(ident: str, kept: int, computed: int | None) -> MultiModalFeature:
    return MultiModalFeature("video", ident, 10, kept, {}, None, computed)


def test_a_pruned_video_costs_its_towers_tokens_in_the_step_budget() -> None:
    enc = EncoderSchedule(cache_size=100, step_budget=100)
    enc.begin_step()
    first, second = _request(1, _video("a", 30, 60)), _request(2, _video("b", 30, 60))
    n, plan = enc.fit(first, 0, 50)
    assert n == 50 and plan.encode == [(0, "a", 30)]
    enc.commit(first, plan)
    assert enc.used == 30  # the cache holds what it keeps
    n, plan = enc.fit(second, 0, 50)  # 60 + 60 computed > 100: waits, though 30 + 30 fit
    assert n == 10 and plan.encode == []
    enc.begin_step()
    n, plan = enc.fit(second, 0, 50)
    assert n == 50 and plan.encode == [(0, "b", 30)]


def test_a_video_over_the_whole_budget_runs_alone_in_a_step() -> None:
    enc = EncoderSchedule(cache_size=100, step_budget=100)
    enc.begin_step()
    small, big = _request(1, _video("s", 10, None)), _request(2, _video("big", 40, 160))
    n, plan = enc.fit(small, 0, 50)
    enc.commit(small, plan)
    assert enc.fit(big, 0, 50)[0] == 10  # not beside another encode
    enc.begin_step()
    n, plan = enc.fit(big, 0, 50)
    assert n == 50 and plan.encode == [(0, "big", 40)]
    enc.commit(big, plan)
    assert enc.fit(_request(3, _video("t", 5, None)), 0, 50)[0] == 10  # the step is spent
