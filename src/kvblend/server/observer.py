"""Scheduler hooks that feed the app's metrics (called on the model-worker thread)."""

from __future__ import annotations

import threading

from kvblend.engine.request import RequestStats
from kvblend.engine.scheduler import Outcome, RequestHandle, SchedulerObserver
from kvblend.errors import NonFiniteLogitsError
from kvblend.generation import StreamEvent
from kvblend.server.metrics import ServerMetrics
from kvblend.server.usage import cached_tokens


class MetricsObserver(SchedulerObserver):
    """TTFT, inter-token latency, queue time, end-to-end latency and token counters.

    ``inner`` is an observer the scheduler already had; it is called too."""

    def __init__(self, metrics: ServerMetrics, inner: SchedulerObserver | None = None) -> None:
        self.metrics = metrics
        self.inner = inner or SchedulerObserver()
        self._last: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def on_queued(self, handle: RequestHandle) -> None:
        self.inner.on_queued(handle)

    def on_admitted(self, handle: RequestHandle) -> None:
        self.inner.on_admitted(handle)

    def on_first_token(self, handle: RequestHandle, stats: RequestStats) -> None:
        self.inner.on_first_token(handle, stats)

    def on_step(self, batch_size: int, seconds: float) -> None:
        self.inner.on_step(batch_size, seconds)

    def on_token(self, handle: RequestHandle, event: StreamEvent, now: float) -> None:
        key = (handle.id, event.index)  # inter-token latency within a choice (n choices decode side by side)
        with self._lock:
            last = self._last.get(key)
            self._last[key] = now
        if last is not None:
            self.metrics.itl.observe(now - last)
        self.inner.on_token(handle, event, now)

    def on_finish(self, handle: RequestHandle, outcome: Outcome) -> None:
        with self._lock:
            for index in range(handle.sampling.n):
                self._last.pop((handle.id, index), None)
        if outcome.status == "ok":
            cached = cached_tokens(outcome.stats) if outcome.stats is not None else 0
            self.metrics.observe_request(outcome.stats, cached, outcome.completion_tokens,
                                         outcome.finish_reason or "stop", outcome.queue_s, outcome.e2e_s)
        elif outcome.stats is not None:  # cancelled/expired after its prefill: the work still counts
            self.metrics.prompt_tokens.inc(outcome.stats.prompt_tokens)
            self.metrics.generation_tokens.inc(outcome.completion_tokens)
        if outcome.status == "error" and outcome.stage is not None:
            self.metrics.failures.labels(self.metrics.model_name, outcome.stage).inc()
            if isinstance(outcome.error, NonFiniteLogitsError):
                self.metrics.nonfinite.inc()
        self.inner.on_finish(handle, outcome)

    def on_restart(self, error: BaseException) -> None:
        self.metrics.restarts.inc()
        self.inner.on_restart(error)

    def on_job(self, lane: str, outcome: str) -> None:
        self.metrics.jobs.labels(self.metrics.model_name, lane, outcome).inc()
        self.inner.on_job(lane, outcome)

    def on_preempt(self, handle) -> None:
        self.metrics.preemptions.inc()
        self.inner.on_preempt(handle)
