"""The ingress's ``/metrics`` over the model replicas' expositions (``cluster.metrics.merge``):
no Ray instance, the replicas' registries built here."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvblend.cluster.metrics import merge
from kvblend.server.metrics import ServerMetrics
from kvblend.store.base import StoreStats

REDIS = StoreStats(hits=1, entries=7, bytes=7000)  # Redis's own accounting: the same figure in every process


def _metrics(tiers: dict[str, StoreStats]) -> ServerMetrics:
    return ServerMetrics("m", lambda: 0, lambda: 0, lambda: tiers, background=lambda: 0, cache_usage=lambda: 0.0)


def _samples(text: bytes, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text.decode()) for s in f.samples
            if s.name == name]


def test_the_shared_tiers_occupancy_is_exported_once_not_per_replica() -> None:
    """Two replicas over one Redis each report its whole occupancy: summed over replicas it
    counted the tier twice. The merged exposition has it once (the ingress's, no replica
    label); each replica's own tiers and its own Redis lookups stay per replica."""
    replicas = {r: generate_latest(_metrics({"memory": StoreStats(entries=2, bytes=200 + i), "redis": REDIS}).registry)
                for i, r in enumerate(("r0", "r1"))}
    ingress = _metrics({"redis": REDIS})
    text = merge("i0", ingress.registry, replicas)
    for name, value in (("kvblend:store_bytes", 7000), ("kvblend:store_entries", 7)):
        samples = _samples(text, name)
        redis = [(labels, v) for labels, v in samples if labels["tier"] == "redis"]
        assert redis == [({"model_name": "m", "tier": "redis"}, value)]  # a sum over replicas counts it once
    memory = {labels["replica"]: v for labels, v in _samples(text, "kvblend:store_bytes") if labels["tier"] == "memory"}
    assert memory == {"r0": 200, "r1": 201}
    hits = [(labels["replica"], v) for labels, v in _samples(text, "kvblend:document_lookups_total")
            if labels["tier"] == "redis" and labels["outcome"] == "hit"]
    assert sorted(hits) == [("r0", 1), ("r1", 1)]  # each replica's own lookups: they sum
    assert text.decode().count("# TYPE kvblend:store_bytes gauge") == 1
