"""``DocumentAffinityRouter``: a Ray Serve request router that sends a request to the
replica holding most of its document tokens in its memory tier.

Configured on the model deployment::

    RequestRouterConfig(
        request_router_class=DocumentAffinityRouter,
        request_router_kwargs={"load_factor": 1.25},
        request_routing_stats_period_s=2.0,
    )

What it reads:

- the request: ``pending_request.args[0].route_keys`` — ``((chunk key, tokens), ...)``, one
  pair per document, keys ``tenant/digest`` (absent or malformed: power of two choices);
- each replica's ``routing_stats``, what the model deployment's ``record_routing_stats``
  returns: ``{"resident": ResidentSummary.to_dict(), "waiting": int, "running": int,
  "unanswered": int, "at": float}``. Missing or malformed stats leave that replica
  without a summary (it still owns its rendezvous share of unheld documents).

A replica's load, which the ranking bounds, is its requests not answering yet (queued or
in prefill: a new request waits for those, while streams already decoding cost its
prefill little): the ``unanswered`` it reported at wall-clock time ``at``, plus the
requests this router sent it since (a replica reports every ``routing_stats_period_s``;
requests other ingresses sent show at the next report). Records of sent requests go once
a report covers them or the request ends (``on_request_completed``), after
``ROUTED_TTL_S`` at the latest. Without a usable report the load is Ray's count of the
replica's requests in flight, or unknown. Background calls (``background`` true on the
first argument: the guard's shadow checks) go where their documents are whatever the
loads and are not counted as load. A call sent again after its replica was lost
(``avoid`` on its first argument, ``cluster.wire.ModelCall``) passes over that replica
while another runs (Ray drops a dead replica from the candidates only once it knows).

The ranking itself is ``kvblend.cluster.affinity.rank_replicas``; this class only maps
Ray's replica objects to ``ReplicaState`` and back, and never raises from routing: an
unexpected error is logged and the request goes to power of two choices.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, OrderedDict
from typing import Any, List, NamedTuple, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvblend.cluster.affinity import (
    DEFAULT_LOAD_FACTOR,
    MAX_LOAD_FACTOR,
    Ranking,
    ReplicaState,
    ResidentSummary,
    power_of_two,
    rank_replicas,
)

logger = logging.getLogger(__name__)

MAX_REPORTED_LOAD = 1 << 20
ROUTED_TTL_S = 60.0  # a sent request counts on its replica's load at most this long unreported
MAX_ROUTED = 4096  # sent requests remembered (oldest dropped first)


class _Sent(NamedTuple):
    replica: str
    at: float


def request_route_keys(pending_request: Optional[PendingRequest]) -> object:
    """The request's ``route_keys`` (None when absent or unreadable); validated by the ranking."""
    try:
        args = pending_request.args if pending_request is not None else None
        return getattr(args[0], "route_keys", None) if args else None
    except Exception:  # an argument whose attribute access fails routes by load
        return None


def request_avoids(pending_request: Optional[PendingRequest]) -> frozenset[str]:
    """Replica ids the request passes over while another runs (``avoid`` on its first
    argument: a call sent again after its replica was lost); empty when absent or unreadable."""
    try:
        args = pending_request.args if pending_request is not None else None
        avoid = getattr(args[0], "avoid", ()) if args else ()
        return frozenset(a for a in avoid if isinstance(a, str)) if isinstance(avoid, tuple) else frozenset()
    except Exception:
        return frozenset()


def request_is_background(pending_request: Optional[PendingRequest]) -> bool:
    """Whether the call is background work (``background`` true on its first argument: the
    guard's ``ShadowCall``): routed to its documents whatever the loads, and not counted
    as load (the replica runs it only in the time requests leave)."""
    try:
        args = pending_request.args if pending_request is not None else None
        return bool(args) and getattr(args[0], "background", False) is True
    except Exception:
        return False


def stats_unanswered(stats: Any) -> tuple[int, float] | None:
    """``(unanswered, at)`` from a replica's routing stats; None unless ``unanswered`` is an
    int in 0..MAX_REPORTED_LOAD and ``at`` a finite number."""
    if not isinstance(stats, dict):
        return None
    count, at = stats.get("unanswered"), stats.get("at")
    if type(count) is not int or not 0 <= count <= MAX_REPORTED_LOAD:
        return None
    if type(at) not in (int, float) or not math.isfinite(at):
        return None
    return count, float(at)


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

    ``initialize_state(load_factor=1.25)``: the load bound (``affinity.load_cap``): a
    replica takes a request only while its load (see the module docstring) stays under
    ``load_factor`` x the mean, else the request goes to the next replica in affinity
    order. ``decisions`` counts the ranking reasons (``affinity``, ``load``,
    ``no-keys``, ``error``) seen by this router instance.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_factor = DEFAULT_LOAD_FACTOR
        self._summaries: dict[str, tuple[object, ResidentSummary | None]] = {}
        self._sent: OrderedDict[str, _Sent] = OrderedDict()
        self.decisions: Counter[str] = Counter()

    def initialize_state(self, load_factor: float = DEFAULT_LOAD_FACTOR, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"DocumentAffinityRouter takes only load_factor; got {sorted(kwargs)}")
        if type(load_factor) not in (int, float) or not 1.0 <= load_factor <= MAX_LOAD_FACTOR:
            raise ValueError(f"load_factor must be a number in [1, {MAX_LOAD_FACTOR:g}]; got {load_factor!r}")
        self._load_factor = float(load_factor)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Retrying rank after rank must back off, or full replicas make a busy loop.
            pending_request.routing_context.should_backoff = True
        avoid = request_avoids(pending_request)
        if avoid and any(r.replica_id.unique_id not in avoid for r in candidate_replicas):
            candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        background = request_is_background(pending_request)
        ranking = self._rank(pending_request, candidate_replicas, background)
        self.decisions[ranking.reason] += 1
        if not background:
            self._remember(pending_request, ranking.first)
        return [[by_id[rid] for rid in rank if rid in by_id] for rank in ranking.ranks]

    def _rank(self, pending_request: Optional[PendingRequest], replicas: List[RunningReplica],
              background: bool = False) -> Ranking:
        try:
            self._forget(time.time())
            states = [self._state(r) for r in replicas]
            if background:  # no load bound: where the documents are
                states = [dataclasses.replace(s, load=None) for s in states]
            return rank_replicas(request_route_keys(pending_request), states, load_factor=self._load_factor)
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
        reported = stats_unanswered(stats)
        if reported is not None:
            load = reported[0] + self._sent_since(rid, reported[1])
        else:
            load = self._replica_queue_len_cache.get(replica.replica_id)
            load = load if load is not None else stats_load(stats)
        return ReplicaState(rid, self._summary(rid, stats.get("resident")), load)

    # -- requests sent since a replica's last report
    def _remember(self, pending_request: Optional[PendingRequest], replica: str | None) -> None:
        """Count the request on the replica it goes to (rank 0; a retry replaces the
        record, so a request counts once)."""
        if pending_request is None or replica is None:
            return
        key = _request_id(pending_request)
        self._sent.pop(key, None)
        self._sent[key] = _Sent(replica, time.time())
        while len(self._sent) > MAX_ROUTED:
            self._sent.popitem(last=False)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        """Ray's hook when a request ends on a replica: it is answered, whatever the next
        report says (a request that ends before its replica reports again would count on
        it until then, and requests sent one after another would all look unanswered)."""
        try:
            super().on_request_completed(replica_id, internal_request_id)
        finally:
            self._sent.pop(str(internal_request_id), None)

    def _sent_since(self, rid: str, at: float) -> int:
        return sum(1 for s in self._sent.values() if s.replica == rid and s.at > at)

    def _forget(self, now: float) -> None:
        while self._sent and now - next(iter(self._sent.values())).at > ROUTED_TTL_S:
            self._sent.popitem(last=False)

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
        for key in [k for k, s in self._sent.items() if s.replica not in live]:
            del self._sent[key]


def _request_id(pending_request: PendingRequest) -> str:
    try:
        return str(pending_request.metadata.internal_request_id)
    except Exception:  # a request without Ray's metadata: count it by object
        return f"obj-{id(pending_request)}"
