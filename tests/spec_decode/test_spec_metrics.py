"""spec_decode_* counters with vLLM's names, and the acceptance rate in the log line."""

from __future__ import annotations

from shoal.core.types import SchedulerStats
from shoal.metrics import IterationStats, LoggingStatLogger, PrometheusStatLogger


def _step(drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> SchedulerStats:
    return SchedulerStats(num_running=1, num_generation_tokens=accepted + drafts,
                          spec_num_drafts=drafts, spec_num_draft_tokens=tokens,
                          spec_num_accepted_tokens=accepted,
                          spec_num_accepted_tokens_per_pos=per_pos)


def test_prometheus_counters_under_vllm_names() -> None:
    p = PrometheusStatLogger("m")
    p.record(_step(2, 8, 5, [2, 2, 1, 0]), IterationStats())
    p.record(SchedulerStats(num_running=1), IterationStats())  # a step without verify
    p.record(_step(1, 4, 4, [1, 1, 1, 1]), IterationStats())
    r = p.registry
    for prefix in ("vllm", "shoal"):
        def value(name: str, prefix: str = prefix, **labels: str) -> float:
            v = r.get_sample_value(f"{prefix}:{name}", {"model_name": "m", "engine": "0", **labels})
            assert v is not None, name
            return v
        assert value("spec_decode_num_drafts_total") == 3
        assert value("spec_decode_num_draft_tokens_total") == 12
        assert value("spec_decode_num_accepted_tokens_total") == 9
        assert [value("spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                for i in range(4)] == [3, 3, 2, 1]


def test_log_line_shows_acceptance() -> None:
    log = LoggingStatLogger()
    log.record(_step(2, 8, 6, [2, 2, 1, 1]), IterationStats())
    line = log.format_line(now=log._last_time + 1)
    assert line is not None
    assert "draft acceptance rate: 75.0%" in line and "Mean acceptance length: 4.00" in line
    log.record(SchedulerStats(num_running=1, num_generation_tokens=1), IterationStats())
    assert "acceptance" not in (log.format_line(now=log._last_time + 1) or "")
