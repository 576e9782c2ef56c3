"""The quality guard in the server: ``QualityGuard`` + ``ShadowRunner`` composed as
``kvblend.guard.quality.serve`` documents, around the scheduler instead of ``generate``.

    routing = guard.route(model, request)      # before submit: resolves "auto", applies fallback
    ... the scheduler serves routing.request ...
    guard.observe(model, tenant, stats)        # when the request ends (free selection-score signal)
    runner.submit(routed, served, probe, risky)  # when guard.shadow_after(model, routing, stats): the
                                               # draw, or a risk in the top of the key's recent ones (first)

Shadow checks never touch the served answer and never block the request: they run as
jobs of small steps in the scheduler's background lane, on the one model worker, only
while no request waits and between decode steps; at most ``guard.max_pending`` are
pending (more are dropped, counted), and drain drops the rest (counted). The guard's state
is exported as Prometheus metrics labelled by model name only (never tenant ids):
``kvblend:shadow_checks_total{outcome}``, ``kvblend:guard_fallbacks_total``,
``kvblend:shadow_agreement_f1`` and ``kvblend:shadow_kl`` histograms,
``kvblend:shadow_first_token_agreements_total``, and at scrape time
``kvblend:guard_keys_in_fallback`` and ``kvblend:guard_switches_total``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvblend.engine import Request
from kvblend.engine.request import Result
from kvblend.engine.scheduler import Scheduler
from kvblend.guard.quality import QualityGuard, Routing, ShadowRunner
from kvblend.guard.shadow import ShadowResult
from kvblend.server.metrics import FRACTION_BUCKETS, P
from kvblend.server.responses import StreamResult
from kvblend.settings import GuardSettings

log = logging.getLogger("kvblend.server")
KL_BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


# The guard's metric families (it lives in the HTTP layer: with replicas, in the ingress).
GUARD_FAMILIES = (P + "shadow_checks", P + "guard_fallbacks", P + "shadow_agreement_f1", P + "shadow_kl",
                  P + "shadow_first_token_agreements", P + "guard_keys_in_fallback", P + "guard_switches")


class _GuardCollector(Collector):
    """Keys (model, tenant) in fallback and switches so far, read from the guard at scrape."""

    def __init__(self, guard: QualityGuard, model_name: str) -> None:
        self.guard = guard
        self.model_name = model_name

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        states = self.guard.snapshot().values()
        keys = GaugeMetricFamily(P + "guard_keys_in_fallback", "Tenants whose blended requests the guard "
                                 "currently serves by fallback", labels=["model_name"])
        keys.add_metric([self.model_name], sum(1 for s in states if s.fallback))
        switches = CounterMetricFamily(P + "guard_switches", "Guard switches into or out of fallback",
                                       labels=["model_name"])
        switches.add_metric([self.model_name], sum(s.switches for s in states))
        yield keys
        yield switches


class ServerGuard:
    """One app's guard, runner and guard metrics (``registry``: the app's); shadow checks
    run on ``scheduler``'s model worker, or, when the scheduler sends work elsewhere (the
    cluster's ``RemoteScheduler``: it has ``start_shadow``), on a model replica, while the
    guard's windows, fallback decisions and metrics stay here."""

    def __init__(self, settings: GuardSettings, registry: CollectorRegistry, model_name: str,
                 guard_model: str, scheduler: Scheduler) -> None:
        self.guard = QualityGuard(settings.guard_config())
        self.runner = ShadowRunner(self.guard, scheduler, max_pending=settings.max_pending,
                                   chunk_tokens=settings.chunk_tokens, start=getattr(scheduler, "start_shadow", None))
        self.model_name = model_name  # the metrics label (served id)
        self.guard_model = guard_model  # the guard's key (the loaded model's name, as ShadowResult has it)
        labels = ["model_name"]
        self.checks = Counter(P + "shadow_checks", "Shadow checks by outcome (ok, failed, dropped)",
                              labels + ["outcome"], registry=registry)
        self.fallbacks = Counter(P + "guard_fallbacks", "Requests the guard served by fallback", labels,
                                 registry=registry)
        self.f1 = Histogram(P + "shadow_agreement_f1", "Token F1 of blended vs full-prefill answers",
                            labels, buckets=FRACTION_BUCKETS, registry=registry)
        self.kl = Histogram(P + "shadow_kl", "Mean next-token KL(full || blended) along the served answer",
                            labels, buckets=KL_BUCKETS, registry=registry)
        self.first_token = Counter(P + "shadow_first_token_agreements",
                                   "Shadow checks whose first tokens agreed", labels, registry=registry)
        registry.register(_GuardCollector(self.guard, model_name))

    def route(self, request: Request) -> Routing:
        """What to serve for ``request`` (``auto`` resolved, the tenant's fallback applied)."""
        routing = self.guard.route(self.guard_model, request)
        if routing.fallback is not None:
            self.fallbacks.labels(self.model_name).inc()
        return routing

    def after(self, routing: Routing, out: StreamResult) -> bool:
        """The request ended: feed the guard its stats and, when routed so, queue its shadow
        check (never waits). Returns whether a check was queued."""
        stats = out.stats
        if stats is None or out.error is not None or out.disconnected:
            return False
        if routing.request.method in ("blend", "reuse"):
            self.guard.observe(self.guard_model, routing.request.tenant, stats)
        if not self.guard.shadow_after(self.guard_model, routing, stats) or not out.token_ids:
            return False
        served = Result("".join(out.text), list(out.token_ids), out.finish_reason or "stop", stats)
        job = self.runner.submit(routing.request, served, routing.probe,
                                 self.guard.risky(self.guard_model, routing.request.tenant, stats))
        if job is None:
            self.checks.labels(self.model_name, "dropped").inc()
            return False
        job.add_done_callback(self._done)
        return True

    def _done(self, job: Future) -> None:
        if job.cancelled():  # dropped by drain
            self.checks.labels(self.model_name, "dropped").inc()
            return
        result: ShadowResult | None = job.result()  # the runner catches and counts failures
        if result is None:
            self.checks.labels(self.model_name, "failed").inc()
            return
        self.checks.labels(self.model_name, "ok").inc()
        self.f1.labels(self.model_name).observe(result.answer_f1)
        self.kl.labels(self.model_name).observe(result.kl)
        if result.first_token_agree:
            self.first_token.labels(self.model_name).inc()


def open_guard(settings: GuardSettings, registry: CollectorRegistry, model_name: str,
               guard_model: str, scheduler: Scheduler) -> ServerGuard | None:
    """The app's guard, or None when ``settings.enabled`` is off."""
    return ServerGuard(settings, registry, model_name, guard_model, scheduler) if settings.enabled else None


__all__ = ["GUARD_FAMILIES", "ServerGuard", "open_guard"]
