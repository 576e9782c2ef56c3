"""The model replica's Ray Serve hooks, on a real scheduler over a tiny model (no Ray
instance: the hooks are plain methods Serve calls)."""

from __future__ import annotations

import pytest

import asyncio

from kvblend.cluster.affinity import ResidentSummary, RouteCost
from kvblend.cluster.model import Backlog, ModelReplica
from kvblend.cluster.remote import route_cost, route_keys
from kvblend.cluster.wire import Accepted, ModelCall
from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import Scheduler
from kvblend.generation import SamplingParams
from kvblend.store.keys import chunk_key
from tests.conftest import make_loaded


def _replica(scheduler: Scheduler) -> ModelReplica:
    replica = object.__new__(ModelReplica)  # the hooks read only these (no Serve replica context here)
    replica.replica, replica.engine, replica.scheduler = "r1", scheduler.engine, scheduler
    replica.backlog = Backlog()
    return replica


def test_routing_stats_report_the_memory_tiers_keys_and_the_queue() -> None:
    engine = Engine(make_loaded())
    sched = Scheduler(engine, max_running=1)
    sched.start()
    try:
        replica = _replica(sched)
        empty = replica.record_routing_stats()
        assert (empty["waiting"], empty["running"]) == (0, 0)
        doc = (5, 6, 7, 8, 9, 10, 11, 12)
        request = Request(documents=[doc], question="what?", tenant="acme")
        sched.submit(request, SamplingParams(max_tokens=2)).result()
        engine.flush()  # the missed chunk's background write-back
        key = chunk_key(doc, engine.key_context(engine.chunk_prefix(request, engine.layout(request)), "acme"))
        summary = ResidentSummary.from_dict(replica.record_routing_stats()["resident"])
        assert str(key) in summary and str(key) not in ResidentSummary.from_dict(empty["resident"])
    finally:
        sched.drain(5)


def test_health_check_fails_once_the_supervisor_gives_up(monkeypatch) -> None:
    sched = Scheduler(Engine(make_loaded()), max_running=1)
    sched.start()
    replica = _replica(sched)
    replica.check_health()  # a live worker: healthy

    def broken() -> None:
        raise RuntimeError("simulated persistent failure")

    monkeypatch.setattr(sched, "_expire", broken)
    sched.submit(Request(question="hi"), SamplingParams(max_tokens=2))  # wakes the loop into its failures
    sched._thread.join(10)
    assert not sched.alive
    with pytest.raises(RuntimeError, match="model worker has stopped"):
        replica.check_health()


def test_backlog_counts_a_request_from_arrival_to_its_first_item_at_the_hit_share_of_held_documents() -> None:
    engine = Engine(make_loaded())
    sched = Scheduler(engine, max_running=1)
    sched.start()
    try:
        replica = _replica(sched)
        doc = tuple(range(5, 45))
        request = Request(documents=[doc], question="what?", tenant="acme")
        call = ModelCall(route_keys(engine, request), request, SamplingParams(max_tokens=2),
                         route_cost(engine, request))
        other = len(engine.layout(request).ids) - len(doc)
        assert call.route_cost == RouteCost(other, 0.15)  # the default blend's ratio

        async def first_two(c: ModelCall) -> list[float]:
            seen, gen = [], replica.generate(c)
            assert isinstance(await gen.__anext__(), Accepted)
            seen.append(replica.record_routing_stats()["backlog"])  # queued: not answering yet
            await gen.__anext__()
            seen.append(replica.record_routing_stats()["backlog"])
            async for _ in gen:
                pass
            return seen

        assert asyncio.run(first_two(call)) == [float(other + len(doc)), 0.0]  # a miss costs every token
        engine.flush()  # the chunk's write-back: now resident, and the report says so
        stats = replica.record_routing_stats()
        assert call.route_keys[0][0] in ResidentSummary.from_dict(stats["resident"]) and stats["backlog"] == 0.0
        assert asyncio.run(first_two(call))[0] == pytest.approx(other + 0.15 * len(doc))
        assert replica.record_routing_stats()["at"] > 0
    finally:
        sched.drain(5)


def test_route_cost_follows_the_method() -> None:
    engine = Engine(make_loaded())
    doc = tuple(range(5, 25))
    shares = {m: route_cost(engine, Request(documents=[doc], question="q?", method=m)).hit_share
              for m in ("full", "prefix", "reuse", "blend", "auto")}
    assert shares == {"full": 1.0, "prefix": 1.0, "reuse": 0.0, "blend": 0.15, "auto": 0.15}
    from kvblend.blend import BlendConfig

    assert route_cost(engine, Request(documents=[doc], question="q?",
                                      blend=BlendConfig(ratio="auto", r_min=0.3))).hit_share == 0.3
    assert route_cost(engine, Request(question="q?")).other_tokens == len(engine.layout(Request(question="q?")).ids)
