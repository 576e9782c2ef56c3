"""Prometheus metrics of one app, named after vLLM's with a ``kvblend:`` prefix.

Each app owns its ``CollectorRegistry`` (several apps may live in one process, as in
tests or replicas). The only label besides the model name is a bounded enum (tier,
outcome, error type, finish reason): never a tenant's document id or text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvblend.blend.strategies import risk_kind
from kvblend.engine.request import RequestStats

log = logging.getLogger("kvblend.server")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FRACTION_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
RISK_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0, 2.0)
SCORE_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 1e3, 1e4)
P = "kvblend:"


class StoreCollector(Collector):
    """Reads the chunk store's per-tier counters at scrape time: bytes and entries held,
    document lookups by tier and outcome (hit, miss, corrupt), and calls that found the
    tier's backend unavailable (a Redis node down, hung or CLUSTERDOWN: each a miss or a
    dropped write)."""

    def __init__(self, tier_stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.tier_stats = tier_stats
        self.model_name = model_name

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        stats = self.tier_stats()
        size = GaugeMetricFamily(P + "store_bytes", "Bytes of chunk KV held per store tier",
                                 labels=["model_name", "tier"])
        entries = GaugeMetricFamily(P + "store_entries", "Chunk KV entries held per store tier",
                                    labels=["model_name", "tier"])
        lookups = CounterMetricFamily(P + "document_lookups", "Chunk lookups per store tier and outcome",
                                      labels=["model_name", "tier", "outcome"])
        unavailable = CounterMetricFamily(P + "store_unavailable", "Store tier calls whose backend was down, hung "
                                          "or refused (each a miss or a dropped write)", labels=["model_name", "tier"])
        for tier, s in stats.items():
            size.add_metric([self.model_name, tier], s.bytes)
            entries.add_metric([self.model_name, tier], s.entries)
            for outcome, value in (("hit", s.hits), ("miss", s.misses), ("corrupt", s.errors)):
                lookups.add_metric([self.model_name, tier, outcome], value)
            unavailable.add_metric([self.model_name, tier], s.warnings)
        yield size
        yield entries
        yield lookups
        yield unavailable


def kv_cache_usage(store: Any) -> float:
    """Share (0..1) of the chunk store's KV byte capacity in use: bytes held by its fastest
    tier that has a byte cap (the memory tier whenever it is enabled, since every memory
    tier is capped) over that cap. 0.0 when no tier has a cap, or its occupancy cannot be
    read (the tier is down)."""
    for tier in getattr(store, "tiers", None) or (store,):
        cap = getattr(tier, "capacity_bytes", None)
        if not cap:
            continue
        try:
            used = tier.stats().bytes
        except Exception:  # noqa: BLE001 - a scrape must not fail because a tier is down
            log.warning("store occupancy unavailable", exc_info=True)
            return 0.0
        return min(1.0, used / cap)
    return 0.0


class ServerMetrics:
    """The app's metrics; ``observe_request`` records one finished request.

    ``running``/``waiting``/``parked``/``background``: the scheduler's requests decoding,
    requests queued, decoding requests parked for another tenant's fair part of the slots
    (vLLM's ``num_requests_swapped``; their cache is kept) and background jobs (shadow
    checks) queued or running; ``cache_usage``: see
    ``kv_cache_usage``; all read at scrape time."""

    def __init__(self, model_name: str, running: Callable[[], float], waiting: Callable[[], float],
                 tier_stats: Callable[[], dict[str, Any]], *, background: Callable[[], float],
                 cache_usage: Callable[[], float], jobs: Callable[[], float] = lambda: 0.0,
                 parked: Callable[[], float] = lambda: 0.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, lab = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, lab, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited for the model worker",
                          QUEUE_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Prefill / fusion time of a request", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to last token of a request", LATENCY_BUCKETS)
        self.recompute = hist("recompute_fraction", "Share (0..1) of a request's prompt token-layers computed, not reused",
                              FRACTION_BUCKETS)
        self.risk = Histogram(P + "blend_risk", "A blend's estimate (0: none, 1: reuse's) of how much of reuse's error "
                              "it left, from what it computed anyway; kind: shift (KV error left) or moved (how little "
                              "the answer moved from reuse's)", [*lab, "kind"], buckets=RISK_BUCKETS, registry=reg)
        self.escalations = Counter(P + "blend_escalations", "Blends whose risk was in the top of their "
                                   "tenant's recent ones of its kind, so they recomputed at twice their ratio", lab,
                                   registry=reg).labels(model_name)
        Gauge(P + "num_requests_running", "Requests decoding now", lab, registry=reg).labels(
            model_name).set_function(running)
        Gauge(P + "num_requests_waiting", "Requests waiting in the queue", lab, registry=reg).labels(
            model_name).set_function(waiting)
        Gauge(P + "num_requests_parked", "Decoding requests set aside, their cache kept, so that another tenant "
              "gets its fair part of the decode slots", lab, registry=reg).labels(model_name).set_function(parked)
        Gauge(P + "num_background_jobs", "Background jobs (shadow checks) queued or running on the model worker",
              lab, registry=reg).labels(model_name).set_function(background)
        Gauge(P + "num_jobs", "Jobs of the model worker's jobs lane (document precompute, write-back) queued or "
              "running", lab, registry=reg).labels(model_name).set_function(jobs)
        self.jobs = Counter(P + "jobs", "Model-worker jobs ended, by lane (jobs, background) and outcome "
                            "(ok, failed, dropped)", lab + ["lane", "outcome"], registry=reg)
        self.failures = Counter(P + "request_failures", "Requests ended by an error of their own, by stage "
                                "(prepare, decode, sample, worker)", lab + ["stage"], registry=reg)
        self.nonfinite = Counter(P + "nonfinite_logits", "Requests ended because the model produced NaN/inf logits",
                                 lab, registry=reg).labels(model_name)
        self.preemptions = Counter(P + "num_preemptions", "Decoding requests parked (cache kept) to give their "
                                   "slot to a tenant owed one", lab, registry=reg).labels(model_name)
        self.restarts = Counter(P + "worker_restarts", "Times the supervisor restarted a failed model-worker loop",
                                lab, registry=reg).labels(model_name)
        Gauge(P + "kv_cache_usage_perc", "Share (0..1) of the chunk KV store's byte capacity in use: its fastest "
              "capped tier (the memory tier when enabled)", lab, registry=reg).labels(model_name).set_function(cache_usage)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", lab,
                                     registry=reg).labels(model_name)
        self.cached_tokens = Counter(P + "cached_prompt_tokens", "Prompt tokens whose KV was reused", lab,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", lab,
                                         registry=reg).labels(model_name)
        self._success = Counter(P + "request_success", "Finished requests by finish reason",
                                lab + ["finished_reason"], registry=reg)
        self._errors = Counter(P + "request_errors", "Failed requests by error type", lab + ["type"],
                               registry=reg)
        self.disconnects = Counter(P + "client_disconnects", "Requests cancelled because the client left",
                                   lab, registry=reg).labels(model_name)
        reg.register(StoreCollector(tier_stats, model_name))
        self._check_score = Histogram(P + "selection_score_mean", "Mean selection score (KV deviation) at a check layer",
                                      lab + ["layer"], buckets=SCORE_BUCKETS, registry=reg)
        self._check_max = Histogram(P + "selection_score_max", "Largest selection score at a check layer",
                                    lab + ["layer"], buckets=SCORE_BUCKETS, registry=reg)
        self._check_kept = Histogram(P + "selection_kept_fraction", "Share of candidates a check layer kept",
                                     lab + ["layer"], buckets=FRACTION_BUCKETS, registry=reg)
        self._doc_share = Histogram(P + "document_selected_share",
                                    "Each document's share of the tokens a check layer kept (by document position)",
                                    lab, buckets=FRACTION_BUCKETS, registry=reg).labels(model_name)

    def observe_request(self, stats: RequestStats | None, cached: int, generated: int, finish_reason: str,
                        queue_s: float, e2e_s: float) -> None:
        if stats is not None:
            self.ttft.observe(stats.ttft_s)
            self.prefill.observe(stats.prefill_s)
            self.recompute.observe(stats.recompute_frac)
            if getattr(stats, "risk", None) is not None:
                self.risk.labels(self.model_name, risk_kind(getattr(stats, "strategy", None))).observe(stats.risk)
            if getattr(stats, "escalated", False):
                self.escalations.inc()
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.cached_tokens.inc(cached)
            self.decode.observe(max(0.0, e2e_s - stats.ttft_s))
            self._observe_checks(stats)
        self.queue.observe(queue_s)
        self.e2e.observe(e2e_s)
        self.generation_tokens.inc(generated)
        self._success.labels(self.model_name, finish_reason).inc()

    def _observe_checks(self, stats: RequestStats) -> None:
        """Per check layer: score level, kept fraction and how the kept tokens fall on the
        documents (labels: model and layer index only, never a document)."""
        for check in getattr(stats, "checks", ()) or ():
            layer = str(check.layer)
            self._check_score.labels(self.model_name, layer).observe(check.mean_score)
            self._check_max.labels(self.model_name, layer).observe(check.max_score)
            if check.candidates:
                self._check_kept.labels(self.model_name, layer).observe(check.selected / check.candidates)
            if check.selected:
                for share in check.doc_share:
                    self._doc_share.observe(share)

    def error(self, type_: str) -> None:
        self._errors.labels(self.model_name, type_).inc()
