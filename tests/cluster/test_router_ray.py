"""DocumentAffinityRouter on a real local Ray Serve: two replicas of a model-less deployment
whose ``record_routing_stats`` reports fixed resident keys (derived from the replica id)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (pip install kvblend[cluster]) is not installed")

from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from kvblend.cluster.affinity import ResidentSummary, rendezvous_owner  # noqa: E402
from kvblend.cluster.router import DocumentAffinityRouter  # noqa: E402
from kvblend.store.localredis import free_port  # noqa: E402

APP = "kvblend-router-test"


@dataclass(frozen=True)
class Call:
    route_keys: tuple[tuple[str, int], ...]


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=16,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class=DocumentAffinityRouter,
        request_routing_stats_period_s=0.5,
        request_routing_stats_timeout_s=5,
    ),
)
class HoldsFixedKeys:
    """Answers its replica id and the keys it claims to hold."""

    def __init__(self) -> None:
        self.uid = serve.get_replica_context().replica_id.unique_id
        self.resident = [f"acme/{self.uid}-{i}" for i in range(32)]

    def record_routing_stats(self) -> dict:
        # as the model deployment reports them: with its unanswered count and the time, the
        # router's load is that report plus what it sent since, not Ray's queue-length cache
        # (which can lag on a busy host and make the holder look loaded: a flaky spill)
        return {"resident": ResidentSummary.from_keys(self.resident).to_dict(), "waiting": 0, "running": 0,
                "unanswered": 0, "at": time.time()}

    def __call__(self, call: Call) -> tuple[str, list[str]]:
        return self.uid, self.resident


def test_requests_reach_the_replica_holding_their_documents(ray_instance) -> None:
    # Serve's HTTP proxy on a free loopback port, not 8000 (a no-op when Serve already runs)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    handle = serve.run(HoldsFixedKeys.bind(), name=APP, route_prefix=None)
    try:
        def land(*keys: str) -> str:
            return handle.remote(Call(tuple((k, 300) for k in keys))).result(timeout_s=60)[0]

        holders: dict[str, list[str]] = {}
        for _ in range(200):  # without keys: power of two choices reaches both replicas
            uid, resident = handle.remote(Call(())).result(timeout_s=60)
            holders[uid] = resident
            if len(holders) == 2:
                break
        ids = sorted(holders)
        assert len(ids) == 2

        # what the replicas report; keys a filter claims by false positive are avoided below
        summaries = {uid: ResidentSummary.from_keys(resident) for uid, resident in holders.items()}

        def unclaimed(candidates: Iterable[str], *but: str) -> list[str]:
            return [k for k in candidates if not any(k in s for uid, s in summaries.items() if uid not in but)]

        for holder, resident in holders.items():
            # a key rendezvous hashing would send to the *other* replica: landing on the
            # holder can only come from its routing stats
            key = next(k for k in unclaimed(resident, holder) if rendezvous_owner(k, ids) != holder)
            deadline = time.monotonic() + 60
            while land(key) != holder:
                assert time.monotonic() < deadline, "the replicas' routing stats never reached the router"
                time.sleep(0.25)
            assert {land(key) for _ in range(10)} == {holder}
            unheld = unclaimed(f"acme/unheld-{i}" for i in range(40))
            placed_away = next(k for k in unheld if rendezvous_owner(k, ids) != holder)
            assert land(key, placed_away) == holder  # 300 held tokens beat 300 placed on the other

        fresh = unclaimed(f"acme/new-{i}" for i in range(40))[:16]
        landed = [land(k) for k in fresh]
        assert landed == [rendezvous_owner(k, ids) for k in fresh]
        assert set(landed) == set(ids)
    finally:
        serve.delete(APP)
