"""``DocumentAffinityRouter``: a Ray Serve request router that sends a request to the
replica holding most of its document tokens in its memory tier.

Configured on the model deployment::

    RequestRouterConfig(
        request_router_class=DocumentAffinityRouter,
        request_router_kwargs={"load_threshold": 4},
        request_routing_stats_period_s=2.0,
    )

What it reads:

- the request: ``pending_request.args[0].route_keys`` — ``((chunk key, tokens), ...)``, one
  pair per document, keys ``tenant/digest`` (absent or malformed: power of two choices) —
  and ``args[0].route_cost``, a ``RouteCost`` (what its prefill computes);
- each replica's ``routing_stats``, what the model deployment's ``record_routing_stats``
  returns: ``{"resident": ResidentSummary.to_dict(), "waiting": int, "running": int,
  "backlog": float, "at": float}`` — ``backlog`` the prefill work of the requests it has
  not started answering, ``at`` its wall-clock time when it measured it. Missing or
  malformed stats leave that replica without a summary (it still owns its rendezvous share
  of unheld documents) or without a backlog (the request is then ranked by the affinity
  order and the load threshold); its load comes from Ray's queue-length cache, or is
  unknown.

A replica reports every ``routing_stats_period_s``: between two reports, the router adds
to a replica's reported backlog the work of each request it routed there after the
report's ``at``, so a burst of requests does not all go to the replica that looked idle
(requests routed by other ingresses show up at the next report). Those records are
dropped once a report covers them, and after ``ROUTED_TTL_S`` in any case.

The ranking itself is ``kvblend.cluster.affinity.rank_replicas``; this class only maps
Ray's replica objects to ``ReplicaState`` and back, and never raises from routing: an
unexpected error is logged and the request goes to power of two choices.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from typing import Any, List, NamedTuple, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvblend.cluster.affinity import (
    DEFAULT_LOAD_THRESHOLD,
    Ranking,
    ReplicaState,
    ResidentSummary,
    power_of_two,
    rank_replicas,
)

logger = logging.getLogger(__name__)

MAX_REPORTED_LOAD = 1 << 20
MAX_REPORTED_BACKLOG = float(1 << 40)
ROUTED_TTL_S = 60.0  # a routed request's work counts on its replica's backlog at most this long unreported
MAX_ROUTED = 4096  # routed requests remembered (oldest dropped first)


class _Routed(NamedTuple):
    replica: str
    work: float
    at: float


def request_route_keys(pending_request: Optional[PendingRequest]) -> object:
    """The request's ``route_keys`` (None when absent or unreadable); validated by the ranking."""
    try:
        args = pending_request.args if pending_request is not None else None
        return getattr(args[0], "route_keys", None) if args else None
    except Exception:  # an argument whose attribute access fails routes by load
        return None


def request_route_cost(pending_request: Optional[PendingRequest]) -> object:
    """The request's ``route_cost`` (None when absent or unreadable); validated by the ranking."""
    try:
        args = pending_request.args if pending_request is not None else None
        return getattr(args[0], "route_cost", None) if args else None
    except Exception:  # as for route_keys
        return None


def stats_backlog(stats: Any) -> tuple[float, float] | None:
    """``(backlog, at)`` from a replica's routing stats; None unless both are finite numbers,
    the backlog within 0..MAX_REPORTED_BACKLOG."""
    if not isinstance(stats, dict):
        return None
    backlog, at = stats.get("backlog"), stats.get("at")
    if type(backlog) not in (int, float) or type(at) not in (int, float):
        return None
    if not (math.isfinite(at) and 0.0 <= backlog <= MAX_REPORTED_BACKLOG):  # NaN fails the range
        return None
    return float(backlog), float(at)


def stats_load(stats: Any) -> int | None:
    """``waiting + running`` from a replica's routing stats; None unless both are ints in range."""
    if not isinstance(stats, dict):
        return None
    waiting, running = stats.get("waiting"), stats.get("running")
    if type(waiting) is not int or type(running) is not int:
        return None
    if not (0 <= waiting <= MAX_REPORTED_LOAD and 0 <= running <= MAX_REPORTED_LOAD):
        return None
    return waiting + running


class DocumentAffinityRouter(RequestRouter):
    """Ranks replicas by the request's document tokens they hold (see the module docstring).

    ``initialize_state(load_threshold=4)``: where a replica reports no backlog, how many
    more queued + running requests than the least loaded replica the preferred one may
    have before the request goes to power of two choices instead. ``decisions`` counts the ranking reasons (``affinity``,
    ``load``, ``no-keys``, ``error``) seen by this router instance.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_threshold = DEFAULT_LOAD_THRESHOLD
        self._summaries: dict[str, tuple[object, ResidentSummary | None]] = {}
        self._routed: OrderedDict[str, _Routed] = OrderedDict()
        self.decisions: Counter[str] = Counter()

    def initialize_state(self, load_threshold: int = DEFAULT_LOAD_THRESHOLD, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"DocumentAffinityRouter takes only load_threshold; got {sorted(kwargs)}")
        if type(load_threshold) is not int or load_threshold < 0:
            raise ValueError(f"load_threshold must be a non-negative int; got {load_threshold!r}")
        self._load_threshold = load_threshold

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Retrying rank after rank must back off, or full replicas make a busy loop.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = self._rank(pending_request, candidate_replicas)
        self.decisions[ranking.reason] += 1
        self._remember(pending_request, ranking)
        return [[by_id[rid] for rid in rank if rid in by_id] for rank in ranking.ranks]

    def _rank(self, pending_request: Optional[PendingRequest], replicas: List[RunningReplica]) -> Ranking:
        try:
            now = time.time()
            self._forget(now)
            states = [self._state(r) for r in replicas]
            return rank_replicas(request_route_keys(pending_request), states,
                                 cost=request_route_cost(pending_request), load_threshold=self._load_threshold)
        except Exception:
            logger.exception("document-affinity ranking failed; routing by load")
            fallback = [ReplicaState(r.replica_id.unique_id) for r in replicas]
            return Ranking((power_of_two(fallback),), "error")

    def _state(self, replica: RunningReplica) -> ReplicaState:
        rid = replica.replica_id.unique_id
        try:
            stats = replica.routing_stats
        except Exception:
            stats = None
        stats = stats if isinstance(stats, dict) else {}
        load = self._replica_queue_len_cache.get(replica.replica_id)
        load = load if load is not None else stats_load(stats)
        reported = stats_backlog(stats)
        backlog = None if reported is None else reported[0] + self._routed_since(rid, reported[1])
        return ReplicaState(rid, self._summary(rid, stats.get("resident")), load, backlog)

    # -- work routed since a replica's last report
    def _remember(self, pending_request: Optional[PendingRequest], ranking: Ranking) -> None:
        """Count the request's work on the replica it is sent to (rank 0; a retry replaces
        the record, so a request counts once)."""
        first = ranking.first
        if pending_request is None or first is None or first not in ranking.work:
            return
        key = _request_id(pending_request)
        self._routed.pop(key, None)
        self._routed[key] = _Routed(first, ranking.work[first], time.time())
        while len(self._routed) > MAX_ROUTED:
            self._routed.popitem(last=False)

    def _routed_since(self, rid: str, at: float) -> float:
        return sum(r.work for r in self._routed.values() if r.replica == rid and r.at > at)

    def _forget(self, now: float) -> None:
        while self._routed:
            oldest = next(iter(self._routed.values()))
            if now - oldest.at <= ROUTED_TTL_S:
                break
            self._routed.popitem(last=False)

    def _summary(self, rid: str, resident: object) -> ResidentSummary | None:
        """The replica's parsed summary, parsed again only when its stats object changed."""
        cached = self._summaries.get(rid)
        if cached is not None and cached[0] is resident:
            return cached[1]
        summary = None
        if resident is not None:
            try:
                summary = ResidentSummary.from_dict(resident)
            except ValueError as exc:
                logger.warning("replica %s reported an unusable resident summary (%s); routing it by load", rid, exc)
        self._summaries[rid] = (resident, summary)
        return summary

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in [rid for rid in self._summaries if rid not in live]:
            del self._summaries[rid]
        for key in [k for k, r in self._routed.items() if r.replica not in live]:
            del self._routed[key]


def _request_id(pending_request: PendingRequest) -> str:
    try:
        return str(pending_request.metadata.internal_request_id)
    except Exception:  # a request without Ray's metadata: count it by object
        return f"obj-{id(pending_request)}"
