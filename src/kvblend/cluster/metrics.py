"""``/metrics`` for a Ray Serve deployment: every model replica's metrics, labelled.

Gathered by the ingress, not through Ray's metrics pipeline: Ray exports application
metrics from each node's own agent (one more scrape target per node, names rewritten
with a ``ray_`` prefix, histograms re-declared through ``ray.util.metrics``), while
users of ``kvblend serve`` already scrape one ``/metrics`` with vLLM's names. So each
model replica keeps today's ``ServerMetrics`` and pushes its exposition every few seconds
to a small named Ray actor (``MetricsBoard``); the ingress's ``/metrics`` reads the board
and answers the same families, each sample with a ``replica`` label: a model replica's id,
or ``ingress:<id>`` for what only the HTTP layer counts (errors it answered, client
disconnects, the quality guard's checks, scores and fallbacks). A replica silent for ``STALE_S`` (gone: killed, restarted under a new id)
drops out. A scrape sees values up to one push period old.

The Redis tier is one store every process shares, and its occupancy (``store_bytes``,
``store_entries``) is read from Redis itself: every replica would report the same figure,
and a sum over replicas would count it once per replica. So those two gauges of the shared
tiers (``SHARED_TIERS``) come once, from the ingress's own store, without a ``replica``
label, as a gauge of one shared resource is exported once; the replicas' own lookups of
that tier (``document_lookups``, ``store_unavailable``) stay labelled by replica, and sum.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvblend.server.quality import GUARD_FAMILIES

log = logging.getLogger("kvblend.cluster")

BOARD_NAME = "kvblend-metrics"
NAMESPACE = "kvblend"
STALE_S = 30.0
# counted by the HTTP layer only: its errors, disconnects, and the quality guard
INGRESS_FAMILIES = ("kvblend:request_errors", "kvblend:client_disconnects", *GUARD_FAMILIES)
SHARED_TIERS = ("redis",)  # one store for every process: its occupancy is the same figure in each
OCCUPANCY = ("kvblend:store_bytes", "kvblend:store_entries")
RESTARTS = "kvblend:worker_restarts_total"


class MetricsBoard:
    """The latest exposition of each replica (a Ray actor: ``board_actor``)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.time(), text)

    def forget(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def latest(self, max_age_s: float = STALE_S) -> dict[str, bytes]:
        now = time.time()
        for replica in [r for r, (t, _) in self._texts.items() if now - t > max_age_s]:
            del self._texts[replica]
        return {r: text for r, (_, text) in self._texts.items()}


def board_actor(create: bool = True) -> Any | None:
    """The named board (created, detached, on first use when ``create``); None when absent."""
    import ray

    try:
        if create:
            return ray.remote(num_cpus=0)(MetricsBoard).options(
                name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
        return ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


class MetricsPusher:
    """A replica's thread that pushes its registry's exposition to the board every
    ``period_s`` (a failed push is logged and retried next period)."""

    def __init__(self, replica: str, registry: CollectorRegistry, period_s: float) -> None:
        self.replica, self.registry, self.period_s = replica, registry, period_s
        self._stop = threading.Event()
        self._board: Any = None
        self._thread = threading.Thread(target=self._run, name="kvblend-metrics-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.push()
            self._stop.wait(self.period_s)

    def push(self) -> None:
        try:
            if self._board is None:
                self._board = board_actor()
            self._board.put.remote(self.replica, generate_latest(self.registry))
        except Exception:  # noqa: BLE001 - metrics must not take a replica down
            log.warning("metrics push failed", exc_info=True)
            self._board = None

    def close(self) -> None:
        self._stop.set()
        try:
            if self._board is not None:
                self._board.forget.remote(self.replica)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass


def _add(family: Metric, samples: Iterable[Sample], merged: dict[str, Metric]) -> None:
    into = merged.get(family.name)
    if into is None:
        into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
    into.samples.extend(samples)


def _labelled(family: Metric, replica: str, merged: dict[str, Metric]) -> None:
    _add(family, (s._replace(labels={**s.labels, "replica": replica}) for s in family.samples), merged)


def _shared(family: Metric, sample: Sample) -> bool:
    """Whether ``sample`` is the occupancy of a tier every process shares."""
    return family.name in OCCUPANCY and sample.labels.get("tier") in SHARED_TIERS


def merge(ingress_id: str, ingress: CollectorRegistry, replicas: dict[str, bytes]) -> bytes:
    """One exposition: the ingress's HTTP-layer families and every replica's, each sample
    labelled with its ``replica``, and the shared tiers' occupancy once, from the
    ingress, unlabelled; a family appears once."""
    merged: dict[str, Metric] = {}
    for family in ingress.collect():
        if family.name in INGRESS_FAMILIES:
            _labelled(family, f"ingress:{ingress_id}", merged)
        shared = [s for s in family.samples if _shared(family, s)]
        if shared:
            _add(family, shared, merged)
    for replica, text in sorted(replicas.items()):
        for family in text_string_to_metric_families(text.decode()):
            family.samples = [s for s in family.samples if not _shared(family, s)]
            _labelled(family, replica, merged)

    class _Merged:
        def collect(self):  # noqa: ANN202 - prometheus_client's protocol
            return list(merged.values())

    out = CollectorRegistry(auto_describe=False)
    out.register(_Merged())
    return generate_latest(out)


def board_texts(timeout_s: float = 5.0) -> dict[str, bytes]:
    """Each live replica's latest exposition ({} while no replica has pushed one); raises
    when the board does not answer."""
    import ray

    board = board_actor(create=False)
    return {} if board is None else ray.get(board.latest.remote(), timeout=timeout_s)


class ClusterExposition:
    """The ingress's ``/metrics`` body (``ServerState.exposition``): see the module docstring."""

    def __init__(self, ingress_id: str, registry: CollectorRegistry) -> None:
        self.ingress_id, self.registry = ingress_id, registry

    def __call__(self) -> bytes:
        texts: dict[str, bytes] = {}
        try:
            texts = board_texts()
        except Exception:  # noqa: BLE001 - the ingress's own metrics still answer
            log.warning("replica metrics unavailable", exc_info=True)
        return merge(self.ingress_id, self.registry, texts)


def worker_restarts(text: bytes) -> int:
    """The model worker's loop restarts in one replica's exposition (its supervisor's)."""
    lines = [line for line in text.decode().splitlines() if line.startswith(RESTARTS)]
    return int(sum(s.value for f in text_string_to_metric_families("\n".join(lines) + "\n") for s in f.samples))


class RestartTally:
    """The model workers' loop restarts this ingress has seen (``/health``'s
    ``X-Kvblend-Worker-Restarts``): each replica's largest count, summed, so that a replica
    gone from the board (its worker gave up and Ray replaced it) keeps its part and the
    total, like one process's count, never goes down while the ingress runs."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def update(self, texts: dict[str, bytes]) -> int:
        """Take the replicas' latest expositions; the total."""
        for replica, text in texts.items():
            self._seen[replica] = max(self._seen.get(replica, 0), worker_restarts(text))
        return sum(self._seen.values())


__all__ = ["BOARD_NAME", "ClusterExposition", "MetricsBoard", "MetricsPusher", "RestartTally", "board_actor",
           "board_texts", "merge", "worker_restarts"]
