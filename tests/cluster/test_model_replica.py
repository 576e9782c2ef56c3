"""The model replica's Ray Serve hooks, on a real scheduler over a tiny model (no Ray
instance: the hooks are plain methods Serve calls)."""

from __future__ import annotations

import pytest

import asyncio

from kvblend.cluster.affinity import ResidentSummary
from kvblend.cluster.model import ModelReplica, Unanswered
from kvblend.cluster.remote import route_keys
from kvblend.cluster.wire import Accepted, ModelCall
from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import Scheduler
from kvblend.generation import SamplingParams
from kvblend.store.keys import chunk_key
from tests.conftest import make_loaded


def _replica(scheduler: Scheduler) -> ModelReplica:
    replica = object.__new__(ModelReplica)  # the hooks read only these (no Serve replica context here)
    replica.replica, replica.engine, replica.scheduler = "r1", scheduler.engine, scheduler
    replica.unanswered = Unanswered()
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


def test_a_request_counts_as_unanswered_from_arrival_to_its_first_item() -> None:
    engine = Engine(make_loaded())
    sched = Scheduler(engine, max_running=2)
    sched.start()
    try:
        replica = _replica(sched)
        request = Request(documents=[tuple(range(5, 45))], question="what?", tenant="acme")
        call = ModelCall(route_keys(engine, request), request, SamplingParams(max_tokens=3, ignore_eos=True))

        async def main() -> list[int]:
            seen = [replica.record_routing_stats()["unanswered"]]
            a, b = replica.generate(call), replica.generate(call)
            assert isinstance(await a.__anext__(), Accepted) and isinstance(await b.__anext__(), Accepted)
            seen.append(replica.record_routing_stats()["unanswered"])  # both queued or in prefill
            await a.__anext__()  # a's stats: its prefill is done; it decodes now
            seen.append(replica.record_routing_stats()["unanswered"])
            await b.aclose()  # b's client left before its first item
            seen.append(replica.record_routing_stats()["unanswered"])
            async for _ in a:
                pass
            return seen

        assert asyncio.run(main()) == [0, 2, 1, 0]
        assert replica.record_routing_stats()["at"] > 0
    finally:
        sched.drain(5)
