"""DocumentAffinityRouter inside Ray Serve's routing loop, with in-memory replicas (no Ray
instance): requests go through ``_choose_replica_for_request``, the call Ray's handle makes."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (pip install kvblend[cluster]) is not installed")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest, RunningReplica  # noqa: E402

from kvblend.cluster.affinity import ResidentSummary, rendezvous_owner  # noqa: E402
from kvblend.cluster.router import DocumentAffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="model", app_name="kvblend")


class FakeReplica(RunningReplica):
    """What the router touches on a replica: its id, routing stats, capacity and queue length."""

    def __init__(self, uid: str, *, stats: Any = None, queue_len: int = 0, max_ongoing: int = 8) -> None:
        self._replica_id = ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT)
        self.stats = stats if stats is not None else {}
        self.queue_len = queue_len
        self.max_ongoing = max_ongoing

    replica_id = property(lambda self: self._replica_id)
    routing_stats = property(lambda self: self.stats)
    max_ongoing_requests = property(lambda self: self.max_ongoing)
    node_id = property(lambda self: "node")
    availability_zone = property(lambda self: None)
    multiplexed_model_ids = property(lambda self: set())

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


class BrokenStats(FakeReplica):
    routing_stats = property(lambda self: 1 / 0)


@dataclass
class Shaped:
    route_keys: Any


def stats(keys: list[str], waiting: int = 0, running: int = 0, **extra: Any) -> dict[str, Any]:
    return {"resident": ResidentSummary.from_keys(keys).to_dict(), "waiting": waiting, "running": running, **extra}


def pending(route_keys: Any = None, *, arg: Any = "unset") -> PendingRequest:
    rid = uuid.uuid4().hex
    args = [Shaped(route_keys)] if arg == "unset" else ([] if arg is None else [arg])
    return PendingRequest(args=args, kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid))


def make_router(replicas: list[FakeReplica], **state: Any) -> DocumentAffinityRouter:
    router = DocumentAffinityRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    router.initialize_state(**state)
    router.update_replicas(replicas)
    return router


async def route(router: DocumentAffinityRouter, pr: PendingRequest) -> str:
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), timeout=10)
    return replica.replica_id.unique_id


def run(coro: Any) -> Any:
    return asyncio.run(coro)


DOC_A, DOC_B, DOC_C = (f"acme/{i:064x}" for i in range(3))


def test_requests_go_to_the_replica_holding_their_documents() -> None:
    async def main() -> None:
        r1, r2 = FakeReplica("r1", stats=stats([DOC_A])), FakeReplica("r2", stats=stats([DOC_B, DOC_C]))
        router = make_router([r1, r2])
        assert [await route(router, pending(((DOC_A, 500),))) for _ in range(5)] == ["r1"] * 5
        assert await route(router, pending(((DOC_A, 100), (DOC_B, 80), (DOC_C, 80)))) == "r2"
        assert router.decisions["affinity"] == 6
    run(main())


def test_unheld_documents_follow_rendezvous_and_spread() -> None:
    async def main() -> None:
        router = make_router([FakeReplica("r1", stats=stats([])), FakeReplica("r2", stats=stats([]))])
        fresh = [f"acme/{i:064x}" for i in range(100, 140)]
        landed = [await route(router, pending(((k, 256),))) for k in fresh]
        assert landed == [rendezvous_owner(k, ["r1", "r2"]) for k in fresh]
        assert set(landed) == {"r1", "r2"}
    run(main())


def test_a_full_preferred_replica_hands_over_to_the_next_rank() -> None:
    async def main() -> None:
        holder = FakeReplica("r1", stats=stats([DOC_A]), queue_len=2, max_ongoing=2)
        router = make_router([holder, FakeReplica("r2", stats=stats([]))])
        assert await route(router, pending(((DOC_A, 500),))) == "r2"
    run(main())


def test_a_holder_over_the_load_bound_sends_the_request_to_the_next_replica() -> None:
    async def main() -> None:
        holder = FakeReplica("r1", stats=stats([DOC_A], waiting=6), queue_len=6, max_ongoing=50)
        router = make_router([holder, FakeReplica("r2", stats=stats([]))], load_factor=1.25)
        await asyncio.sleep(0)  # let update_replicas' probe fill the queue-length cache
        await asyncio.sleep(0.05)
        assert await route(router, pending(((DOC_A, 500),))) == "r2"
        assert router.decisions["load"] == 1
        # 2 against 1 in flight: the bound is ceil(1.25 x 4 / 2) = 3, so the holder keeps it
        holder = FakeReplica("r1", stats=stats([DOC_A]), queue_len=2, max_ongoing=50)
        router = make_router([holder, FakeReplica("r2", stats=stats([]), queue_len=1)], load_factor=1.25)
        await asyncio.sleep(0.05)
        assert await route(router, pending(((DOC_A, 500),))) == "r1"
    run(main())


@pytest.mark.parametrize(
    "bad_stats",
    [{}, {"resident": None}, {"resident": {"v": 1}}, {"resident": "zz", "waiting": "many"}, ["not", "a", "dict"],
     {"resident": {"v": 1, "m": 64, "k": 3, "bits": "@@@@@@@@@@@@"}, "waiting": -1, "running": 10**9}],
)
def test_missing_or_malformed_stats_degrade_to_load_routing(bad_stats: Any) -> None:
    async def main() -> None:
        replicas = [FakeReplica("r1", stats=bad_stats), BrokenStats("r2"), FakeReplica("r3", stats=stats([DOC_A]))]
        router = make_router(replicas)
        assert await route(router, pending(((DOC_A, 500),))) == "r3"  # the one usable summary still counts
        fresh = f"acme/{999:064x}"
        assert await route(router, pending(((fresh, 500),))) == rendezvous_owner(fresh, ["r1", "r2", "r3"])
    run(main())


@pytest.mark.parametrize("arg", [None, object(), Shaped(None), Shaped("acme/x"), Shaped(((1, 2),))])
def test_requests_without_route_keys_use_power_of_two(arg: Any) -> None:
    async def main() -> None:
        replicas = [FakeReplica(f"r{i}", stats=stats([DOC_A])) for i in range(3)]
        router = make_router(replicas)
        landed = {await route(router, pending(arg=arg)) for _ in range(40)}
        assert len(landed) >= 2 and router.decisions["no-keys"] == 40
    run(main())


def test_unknown_router_options_are_refused() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="load_factor"):
            make_router([], load_threshold=3)
        for bad in (0.5, float("nan"), "2", 100.0):
            with pytest.raises(ValueError, match=r"in \[1, 64\]"):
                make_router([], load_factor=bad)
    run(main())


def test_the_load_bounded_is_requests_not_answering_yet_not_streams_decoding() -> None:
    async def main() -> None:
        # the holder runs 6 requests (Ray counts them all) but 5 of them decode: 1 unanswered
        holder = FakeReplica("r1", stats=stats([DOC_A], running=6, unanswered=1, at=time.time()), queue_len=6,
                             max_ongoing=50)
        other = FakeReplica("r2", stats=stats([], unanswered=0, at=time.time()))
        router = make_router([holder, other], load_factor=1.25)
        await asyncio.sleep(0.05)
        assert await route(router, pending(((DOC_A, 500),))) == "r1"  # 1 < ceil(1.25 x 2 / 2) = 2
        # that request counts on r1 until r1 reports again: 2 unanswered now, the next goes to r2
        assert await route(router, pending(((DOC_A, 500),))) == "r2"
        assert router.decisions == {"affinity": 1, "load": 1}
        holder.stats = stats([DOC_A], unanswered=0, at=time.time())  # a report after both: it covers them
        other.stats = stats([], unanswered=0, at=time.time())
        assert await route(router, pending(((DOC_A, 500),))) == "r1"
    run(main())


@pytest.mark.parametrize("bad", [{"unanswered": -1, "at": 1.0}, {"unanswered": "2", "at": 1.0},
                                 {"unanswered": 2, "at": float("nan")}, {"unanswered": 2}, {"unanswered": 1.5, "at": 1.0}])
def test_a_malformed_unanswered_report_falls_back_to_rays_queue_length(bad: dict) -> None:
    async def main() -> None:
        holder = FakeReplica("r1", stats={**stats([DOC_A]), **bad}, queue_len=6, max_ongoing=50)
        router = make_router([holder, FakeReplica("r2", stats=stats([]))])
        await asyncio.sleep(0.05)
        assert await route(router, pending(((DOC_A, 500),))) == "r2"  # Ray's 6 in flight: over the bound
    run(main())


def test_at_load_factor_1_a_request_waits_behind_no_prefill_that_another_replica_would_spare_it() -> None:
    async def main() -> None:
        holder = FakeReplica("r1", stats=stats([DOC_A], running=5, unanswered=1, at=time.time()), max_ongoing=50)
        other = FakeReplica("r2", stats=stats([], unanswered=0, at=time.time()))
        router = make_router([holder, other], load_factor=1.0)
        assert await route(router, pending(((DOC_A, 500),))) == "r2"  # r1 has a prefill ahead, r2 none
        # both have one unanswered now (r2: the request just sent): a tie, decided by the documents
        assert await route(router, pending(((DOC_A, 500),))) == "r1"
    run(main())


def test_a_request_that_ended_no_longer_counts_before_the_next_report() -> None:
    async def main() -> None:
        holder = FakeReplica("r1", stats=stats([DOC_A], unanswered=0, at=time.time()), max_ongoing=50)
        router = make_router([holder, FakeReplica("r2", stats=stats([], unanswered=0, at=time.time()))],
                             load_factor=1.0)  # the tightest bound: one stale count would move it
        for _ in range(3):  # one after another, each ended before the next: all on the holder
            pr = pending(((DOC_A, 500),))
            assert await route(router, pr) == "r1"
            router.on_request_completed(holder.replica_id, pr.metadata.internal_request_id)
        assert not router._sent
    run(main())


@dataclass
class Background:
    route_keys: Any
    background = True


def test_a_background_call_goes_to_its_documents_and_is_not_counted_as_load() -> None:
    """The guard's shadow checks run in the time requests leave: they go where their
    documents are whatever the loads (elsewhere the documents would be computed exactly and
    the check would judge another blend), and the requests after them are routed as if
    they were not there."""
    async def main() -> None:
        holder = FakeReplica("r1", stats=stats([DOC_A], unanswered=1, at=time.time()), max_ongoing=50)
        other = FakeReplica("r2", stats=stats([], unanswered=0, at=time.time()))
        router = make_router([holder, other], load_factor=1.0)
        assert await route(router, pending(((DOC_A, 500),))) == "r2"  # a request spills off the busy holder
        assert await route(router, pending(arg=Background(((DOC_A, 500),)))) == "r1"  # the check does not
        assert await route(router, pending(arg=Background(((DOC_A, 500),)))) == "r1"
        # r2 has the request just sent, r1 its one unanswered: not the two checks as well
        assert await route(router, pending(((DOC_A, 500),))) == "r1"
    run(main())


@dataclass
class SentAgain:
    route_keys: Any
    avoid: tuple[str, ...]


def test_a_call_sent_again_passes_over_the_replica_that_lost_it_while_another_runs() -> None:
    """A request whose replica died is sent once more (``cluster.remote``); until Ray drops
    the dead replica from the candidates, affinity would send it straight back there."""
    async def main() -> None:
        holder, other = FakeReplica("r1", stats=stats([DOC_A])), FakeReplica("r2", stats=stats([]))
        router = make_router([holder, other])
        assert await route(router, pending(((DOC_A, 500),))) == "r1"
        assert await route(router, pending(arg=SentAgain(((DOC_A, 500),), ("r1",)))) == "r2"
        alone = make_router([FakeReplica("r1", stats=stats([DOC_A]))])  # no other: the one there is
        assert await route(alone, pending(arg=SentAgain(((DOC_A, 500),), ("r1",)))) == "r1"
        assert await route(router, pending(arg=SentAgain(((DOC_A, 500),), "r1"))) == "r1"  # malformed: ignored
    run(main())
