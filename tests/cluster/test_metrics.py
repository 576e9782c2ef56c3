"""The ingress's ``/metrics`` over the model replicas' expositions (``cluster.metrics.merge``)
and its ``/health``'s count of their worker restarts: no Ray instance, the replicas'
registries built here."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
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


def _exposition(restarts: int) -> bytes:
    metrics = _metrics({})
    metrics.restarts.inc(restarts)
    return generate_latest(metrics.registry)


def test_the_tally_keeps_a_replaced_replicas_restarts() -> None:
    from kvblend.cluster.metrics import RestartTally, worker_restarts

    tally = RestartTally()
    assert tally.update({"r0": _exposition(1), "r1": _exposition(2)}) == 3
    assert tally.update({"r0": _exposition(1), "r2": _exposition(0)}) == 3  # r1 gave up; Ray replaced it
    assert tally.update({}) == 3  # the board did not answer
    assert worker_restarts(b"") == 0


def test_health_on_the_ingress_counts_the_replicas_worker_restarts(tmp_path, monkeypatch) -> None:
    """``X-Kvblend-Worker-Restarts`` on the ingress's ``/health`` was always 0 (the remote
    scheduler has no worker loop of its own): now the watcher reads the replicas' counts
    from their metrics, and a replica that gave up keeps its part once Ray replaced it."""
    serve = pytest.importorskip("ray.serve")
    from starlette.testclient import TestClient

    from kvblend.cluster import remote as remote_mod
    from kvblend.cluster.remote import RemoteScheduler, watch_replicas
    from kvblend.engine import Engine
    from kvblend.server import create_app
    from kvblend.settings import Settings
    from tests.conftest import make_loaded

    boards = iter([{"r0": _exposition(1), "r1": _exposition(2)}, {"r0": _exposition(1), "r2": _exposition(0)}])
    stop, seen = threading.Event(), []
    engine = Engine(make_loaded())
    remote = RemoteScheduler(SimpleNamespace(options=lambda **_: None), engine)  # no call reaches a replica

    def read() -> dict[str, bytes]:
        seen.append(remote.restarts)  # what the last read left
        board = next(boards, None)
        if board is None:
            stop.set()
            raise RuntimeError("no more boards")
        return board

    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    monkeypatch.setattr(remote_mod, "board_texts", read, raising=False)
    try:
        watch_replicas(remote, "app", "model", 0.01, stop).join(10)
    finally:
        stop.set()
    settings = Settings(state_dir=str(tmp_path / "state"), store={"tiers": ["memory"]})
    with TestClient(create_app(engine, settings, scheduler=remote)) as client:
        health = client.get("/health")
    assert health.status_code == 200 and health.headers["X-Kvblend-Worker-Restarts"] == "3"
    assert seen == [0, 3, 3]  # each read's total stood until the next
