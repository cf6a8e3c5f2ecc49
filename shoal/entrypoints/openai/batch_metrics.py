"""`run_batch --enable-metrics --host H --port P`: the batch's Prometheus series on an HTTP
server that lives as long as the batch runner, as vLLM's batch runner has.

The server answers from the start (an empty page), before the model loads, so whatever
watches the job sees it alive at once; the families (the same `vllm:` and `shoal:` names as
`shoal serve`'s /metrics) appear when the engine is ready. The offline engine keeps no stat
loggers: `recording` hands each of its steps to a PrometheusStatLogger, as AsyncLLM does for
the server, and only while the batch runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from shoal.metrics import IterationStats, PrometheusStatLogger


class BatchMetrics:
    def __init__(self, host: str, port: int):
        """Starts serving (every path but /favicon.ico answers the metrics); an address in
        use is an OSError here, before any model loads."""
        self.registry = CollectorRegistry()
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.logger: PrometheusStatLogger | None = None

    @contextlib.contextmanager
    def recording(self, llm: Any, model_name: str) -> Iterator[PrometheusStatLogger]:
        """Records every step of `llm`'s engine until the block ends (the families are
        registered at the first call)."""
        from shoal.metrics.cache_info import cache_config_info

        engine = llm.llm_engine
        limits = engine.core.limits
        if self.logger is None:
            self.logger = PrometheusStatLogger(
                model_name, self.registry, max_model_len=limits.max_model_len,
                cache_info=cache_config_info(limits, llm.engine_args))
        logger, outputs = self.logger, engine.outputs
        process = outputs.process_outputs
        last: list[Any] = [None]

        def recorded(core_outputs: list[Any], it: IterationStats | None = None,
                     now: float | None = None) -> Any:
            it = IterationStats() if it is None else it
            result = process(core_outputs, it, now)
            # LLMEngine.step sets last_stats before this call; an unchanged object is a step
            # without a report, whose counters must not be added again.
            stats = engine.last_stats
            logger.record(stats if stats is not last[0] else None, it)
            last[0] = stats
            return result

        outputs.process_outputs = recorded
        try:
            yield logger
        finally:
            del outputs.process_outputs  # the class's method again

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
