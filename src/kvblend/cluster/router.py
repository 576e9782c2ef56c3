"""Document-affinity request router for the model deployment.

(Interim version, written against the contract agreed with the router's author; their
``router.py`` replaces it.) Replicas are ranked by the tokens of the request's documents
(``pending_request.args[0].route_keys``) their memory tier holds (``record_routing_stats``'s
``resident``); documents no replica holds go where rendezvous hashing on their keys puts
them, so a first computation lands where later requests go.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvblend.cluster.affinity import ResidentSummary


def _weight(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}|{replica}".encode()).digest()[:8], "big")


class DocumentAffinityRouter(FIFOMixin, RequestRouter):
    """See the module docstring."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        keys: tuple[tuple[str, int], ...] = ()
        if pending_request is not None and pending_request.args:
            keys = tuple(getattr(pending_request.args[0], "route_keys", ()) or ())
        if not keys or len(candidate_replicas) < 2:
            return [candidate_replicas]
        scores: dict[Any, float] = {}
        for replica in candidate_replicas:
            summary = ResidentSummary.from_dict((replica.routing_stats or {}).get("resident"))
            held = sum(tokens for key, tokens in keys if key in summary)
            placed = sum(tokens for key, tokens in keys
                         if max(candidate_replicas, key=lambda r: _weight(key, r.replica_id.unique_id)) is replica)
            scores[replica.replica_id] = held * 2 + placed
        ranked = sorted(candidate_replicas, key=lambda r: -scores[r.replica_id])
        return [[r] for r in ranked]


__all__ = ["DocumentAffinityRouter"]
