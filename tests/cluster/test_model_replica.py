"""The model replica's Ray Serve hooks, on a real scheduler over a tiny model (no Ray
instance: the hooks are plain methods Serve calls)."""

from __future__ import annotations

import pytest

import asyncio

from kvblend.cluster.affinity import ResidentSummary
from kvblend.cluster.model import ModelReplica, Unanswered
from kvblend.cluster.remote import route_keys
from kvblend.cluster.wire import Accepted, Answering, ModelCall
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
            while not isinstance(await a.__anext__(), Answering):  # Started once it left the queue
                assert replica.record_routing_stats()["unanswered"] == 2
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


class _Method:
    def __init__(self, call) -> None:
        self.remote = call


class _Stream:
    """A streaming handle call's response over the replica's async generator."""

    def __init__(self, agen) -> None:
        self._agen = agen

    def __anext__(self):
        return self._agen.__anext__()

    def cancel(self) -> None:
        asyncio.get_event_loop().create_task(self._agen.aclose())


class _LocalHandle:
    """The model deployment's handle over one in-process ``ModelReplica`` (no Ray)."""

    def __init__(self, replica: ModelReplica) -> None:
        self.calls = []
        self.generate = _Method(lambda call: _Stream(replica.generate(call)))
        self.shadow = _Method(lambda call: self.calls.append(call) or replica.shadow(call))

    def options(self, **_):
        return self


def _guarded_ingress(tmp_path, **guard):
    """An ingress app (``RemoteScheduler``) over one replica on a real scheduler, guard on."""
    from kvblend.cluster.remote import RemoteScheduler
    from kvblend.server import create_app
    from kvblend.settings import Settings

    settings = Settings(state_dir=str(tmp_path / "state"), store={"tiers": ["memory"]},
                        guard={"enabled": True, "shadow_fraction": 1.0, "min_f1": None, **guard})
    engine = Engine(make_loaded())
    sched = Scheduler(engine, max_running=2)
    sched.start()
    replica = _replica(sched)
    replica.settings = settings
    handle = _LocalHandle(replica)
    return create_app(engine, settings, scheduler=RemoteScheduler(handle, engine)), sched, handle


def _checks(client, outcome: str) -> float:
    from tests.server.test_retrieval_and_guard import _metric

    return _metric(client.get("/metrics").text, "kvblend:shadow_checks_total", outcome=outcome)


def _wait(client, outcome: str, n: int = 1) -> float:
    import time

    deadline = time.monotonic() + 60
    while _checks(client, outcome) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return _checks(client, outcome)


BODY = {"max_tokens": 4, "messages": [{"role": "user", "content": "what ?"}],
        "documents": [{"text": "the river runs east of the old town ."}], "kvblend": {"method": "blend"}}


def test_with_replicas_the_ingress_guard_checks_on_a_replica_and_records_the_result(tmp_path) -> None:
    """The guard works with replicas: the ingress keeps the guard (windows, metrics) and
    sends each shadow check to a model replica's background lane, routed by the request's
    documents; its result equals the same check run in one process, and reaches the
    ingress's guard and metrics."""
    from starlette.testclient import TestClient

    from kvblend.guard.shadow import shadow_check

    app, sched, handle = _guarded_ingress(tmp_path)
    seen = []
    state = app.state.kvblend
    real = state.guard.guard.record
    state.guard.guard.record = lambda result: seen.append(result) or real(result)
    try:
        with TestClient(app) as client:
            body = {**BODY, "model": state.model_id}
            assert client.post("/v1/chat/completions", json=body).status_code == 200  # a miss: stored after
            assert _wait(client, "ok") == 1
            sched.engine.flush()
            again = {**body, "messages": [{"role": "user", "content": "and then ?"}]}  # not served the first blend whole
            r = client.post("/v1/chat/completions", json=again)  # a hit, and so is its check's re-prepare
            assert r.status_code == 200, r.text
            assert _wait(client, "ok", 2) == 2 and _checks(client, "failed") == 0
            assert 'kvblend:shadow_kl_count{model_name="%s"} 2.0' % state.model_id in client.get("/metrics").text
        result, call = seen[-1], handle.calls[-1]
        assert [k for k, _ in call.route_keys] == [k for k, _ in route_keys(sched.engine, call.request)]
        assert call.served.text == r.json()["choices"][0]["message"]["content"] and call.probe is None
        assert call.served.stats.docs[0].source == "memory"
        assert (result.tenant, result.method) == ("default", "blend")
        assert result.tokens == r.json()["usage"]["completion_tokens"]
        assert list(state.guard.guard.snapshot()) == [(sched.engine.loaded.name, "default")]
        # the same check run in one process on the request as the ingress shaped it
        alone = shadow_check(sched.engine, call.request, call.served, call.probe)
        assert (alone.answer_f1, alone.first_token_agree, alone.tokens) == (
            result.answer_f1, result.first_token_agree, result.tokens)
        assert alone.kl == pytest.approx(result.kl, rel=1e-4, abs=1e-6)
    finally:
        sched.drain(5)


def test_with_replicas_a_failing_or_dropped_check_is_counted_at_the_ingress(tmp_path, monkeypatch) -> None:
    from starlette.testclient import TestClient

    from kvblend.guard import quality

    app, sched, _ = _guarded_ingress(tmp_path)
    state = app.state.kvblend
    try:
        with TestClient(app) as client:
            body = {**BODY, "model": state.model_id}

            def broken(*args, **kwargs):
                raise RuntimeError("simulated shadow failure")
                yield  # a generator

            monkeypatch.setattr(quality, "shadow_steps", broken)
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert _wait(client, "failed") == 1 and _checks(client, "ok") == 0
            monkeypatch.setattr(sched, "submit_background", lambda *a, **k: None)  # the replica's lane refuses
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert _wait(client, "dropped") == 1 and _checks(client, "ok") == 0
            assert client.get("/health").status_code == 200
    finally:
        sched.drain(5)
