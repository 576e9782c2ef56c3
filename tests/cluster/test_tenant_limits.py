"""A tenant's own queue cap and token rate hold across the model replicas: the ingress
(``RemoteScheduler`` with a ``TenantLedger``) refuses what each replica alone would still
take. Two in-process ``ModelReplica`` over real schedulers, no Ray instance."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from kvblend.cluster.remote import RemoteScheduler, tenant_ledger
from kvblend.engine import Engine, Request
from kvblend.engine.fair import TenantLedger, TenantShare
from kvblend.engine.scheduler import DEFAULT_CHUNK_TOKENS, QueueFullError, Scheduler
from kvblend.generation import SamplingParams
from kvblend.settings import Settings
from tests.cluster.test_model_replica import _Method, _replica, _Stream
from tests.conftest import make_loaded

KEY = "metered-key"
BODY = {"max_tokens": 4, "ignore_eos": True, "messages": [{"role": "user", "content": "what ?"}], "kvblend": {"method": "full"}}


class _RoundRobin:
    """The model deployment's handle over in-process replicas, taking turns (no Ray)."""

    def __init__(self, replicas) -> None:
        turn = itertools.cycle(replicas)
        self.generate = _Method(lambda call: _Stream(next(turn).generate(call)))

    def options(self, **_):
        return self


def _replicas(n: int, max_running: int = 2, chunk: int = DEFAULT_CHUNK_TOKENS, **share):
    """``n`` replicas over started schedulers (prefill slices of ``chunk`` tokens); each
    scheduler's ``handles`` lists the requests it took."""
    scheds = [Scheduler(Engine(make_loaded()), max_running=max_running, prefill_chunk_tokens=chunk,
                        shares={"metered": TenantShare(**share)}) for _ in range(n)]
    for s in scheds:
        s.handles = []
        s.submit = lambda *a, _s=s, _submit=s.submit, **k: _s.handles.append(_submit(*a, **k)) or _s.handles[-1]
        s.start()
    replicas = []
    for i, s in enumerate(scheds):
        replica = _replica(s)
        replica.replica = f"r{i}"
        replicas.append(replica)
    return scheds, replicas


def _charged(handle) -> float:
    """What a replica's scheduler charged the tenant for one request (prefill tokens +
    decode_weight x decoded tokens)."""
    return handle.charged_prefill + 2.0 * handle.charged_decode


def _cost_of_one_request(tmp_path) -> float:
    """What a replica charges the tenant for one BODY request on a fresh engine."""
    from starlette.testclient import TestClient

    from kvblend.server import create_app

    (sched,), (replica,) = _replicas(1)
    engine = Engine(make_loaded())
    settings = Settings(state_dir=str(tmp_path / "measure"), store={"tiers": ["memory"]}, api_keys={KEY: "metered"})
    try:
        with TestClient(create_app(engine, settings, scheduler=RemoteScheduler(_RoundRobin([replica]), engine))) as c:
            r = c.post("/v1/chat/completions", json={**BODY, "model": settings.model_id},
                       headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
    finally:
        sched.drain(5)
    (h,) = sched.handles
    assert h.charged_prefill > 0 and h.charged_decode == BODY["max_tokens"] - 1  # the first token came with the prefill
    return _charged(h)


def test_a_tenants_token_rate_holds_across_two_replicas_at_the_ingress(tmp_path) -> None:
    """The tenant's burst holds 1.2 requests: its first request goes to one replica, its
    second to the other (each replica's own bucket still has 0.2 of a request left), and
    its third is refused at the ingress with the 429 and Retry-After one process gives,
    though the replica it would reach would take it."""
    from starlette.testclient import TestClient

    from kvblend.server import create_app

    cost = _cost_of_one_request(tmp_path)
    rate = 1.2 * cost / 10.0  # BURST_S: the bucket holds 10 s of the rate
    settings = Settings(state_dir=str(tmp_path / "state"), store={"tiers": ["memory"]}, api_keys={KEY: "metered"},
                        scheduler={"tenants": {"metered": {"tokens_per_s": rate}}})
    scheds, replicas = _replicas(2, tokens_per_s=rate)
    engine = Engine(make_loaded())
    remote = RemoteScheduler(_RoundRobin(replicas), engine, tenant_ledger(settings))
    charged = []
    real_charge = remote.ledger.charge
    remote.ledger.charge = lambda tenant, p=0.0, d=0: charged.append(p + 2.0 * d) or real_charge(tenant, p, d)
    try:
        with TestClient(create_app(engine, settings, scheduler=remote)) as client:
            body, auth = {**BODY, "model": settings.model_id}, {"Authorization": f"Bearer {KEY}"}
            served = [client.post("/v1/chat/completions", json=body, headers=auth) for _ in range(2)]
            assert [r.status_code for r in served] == [200, 200], served[-1].text
            assert {r.headers.get("x-kvblend-replica") for r in served} == {"r0", "r1"}
            with scheds[0]._cond:
                assert scheds[0]._queue.check("metered") is None  # replica r0 alone would take the third
            r = client.post("/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["message"] == "tenant is over its token rate"
            assert int(r.headers["Retry-After"]) >= 1
        assert [len(s.handles) for s in scheds] == [1, 1]
        assert sum(charged) == pytest.approx(sum(_charged(s.handles[0]) for s in scheds))  # what they charged
        assert sum(charged) == pytest.approx(2 * cost)
        assert len(charged) > 2  # as it came: the prefill, then each decoded token
        assert remote.ledger.waiting("metered") == 0
    finally:
        for s in scheds:
            s.drain(5)


def test_a_tenants_queue_cap_holds_across_two_replicas_at_the_ingress() -> None:
    """max_queued 1, one slot per replica: two long streams run, one on each replica; a
    third waits on one replica; the fourth is refused at the ingress (the other replica's
    queue is empty). Once the waiting one ends (cancelled), its place is free again."""
    scheds, replicas = _replicas(2, max_running=1, max_queued=1)
    engine = Engine(make_loaded())
    remote = RemoteScheduler(_RoundRobin(replicas), engine,
                             TenantLedger({"metered": TenantShare(max_queued=1)}))
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main() -> None:
        request = Request(question="hello there", method="full", tenant="metered")
        streams, readers = [], []
        for _ in range(2):  # the app reads a request's events as they come: so does this
            streams.append(await remote.asubmit(request, long))
            readers.append(streams[-1].aevents())
            await readers[-1].__anext__()  # its stats: it left its replica's queue, and answers
        assert remote.ledger.waiting("metered") == 0
        third = await remote.asubmit(request, long)  # r0 runs a stream: this one waits there
        assert remote.ledger.waiting("metered") == 1
        with scheds[1]._cond:
            assert scheds[1]._queue.check("metered") is None  # r1 alone would take the fourth
        with pytest.raises(QueueFullError, match="tenant has 1 requests waiting, its limit"):
            await remote.asubmit(request, long)
        third.cancel()
        assert remote.ledger.waiting("metered") == 0
        fourth = await remote.asubmit(request, SamplingParams(max_tokens=2))
        for s in (*streams, fourth):
            s.cancel()
        for events in readers:
            await events.aclose()
        await asyncio.sleep(0.2)  # the replicas' generators close (their requests are cancelled there)

    try:
        asyncio.run(main())
        assert remote.num_running == 0
    finally:
        for s in scheds:
            s.drain(5)


def test_each_ingress_gets_its_part_of_the_tenants_limits() -> None:
    """``build_application``'s ingress count reaches the ingresses' settings (a Serve
    application is built, not run: no Ray instance), and each keeps 1/K of the limits."""
    pytest.importorskip("ray.serve")
    from kvblend.cluster.app import build_application

    settings = Settings(scheduler={"tenants": {"t": {"max_queued": 3, "tokens_per_s": 9.0}}})
    app = build_application(settings, replicas=2, router="default", ingress_replicas=3)
    ingress_settings = app._bound_deployment.init_args[1]
    assert ingress_settings.cluster.ingress_replicas == 3 and settings.cluster.ingress_replicas == 1
    assert tenant_ledger(ingress_settings).share("t") == TenantShare(max_queued=1, tokens_per_s=3.0)
    assert tenant_ledger(settings).share("t") == TenantShare(max_queued=3, tokens_per_s=9.0)


def test_a_request_cancelled_in_its_prefill_is_charged_at_the_ingress_what_its_replica_charged() -> None:
    """The ingress took a request's prefill from the tenant's bucket only with ``Answering``,
    sent before its first output: a client that left mid-prefill had the replica's bucket
    charged and the ingress's not at all. Now the replica sends its totals to the ingress's
    inbox once the cancelled request ended there, and the ingress charges the rest."""
    (sched,), (replica,) = _replicas(1, max_running=1, chunk=16, tokens_per_s=1e6)  # a prefill of several slices
    engine = Engine(make_loaded())
    remote = RemoteScheduler(_RoundRobin([replica]), engine, TenantLedger({"metered": TenantShare(tokens_per_s=1e6)}))
    remote.inbox = "ingress-inbox"
    posted, charged = [], []
    replica.post = lambda inbox, item: posted.append(inbox) or remote.settle([item])  # the inbox's thread, in short
    real_charge = remote.ledger.charge
    remote.ledger.charge = lambda tenant, p=0.0, d=0: charged.append(p + 2.0 * d) or real_charge(tenant, p, d)
    request = Request(documents=[tuple(5 + i % 40 for i in range(120))], question="what ?", tenant="metered",
                      method="full")

    async def main() -> None:
        handle = await remote.asubmit(request, SamplingParams(max_tokens=8, ignore_eos=True))
        reader = asyncio.ensure_future(handle.aevents().__anext__())  # the app reads as the items come
        until = time.monotonic() + 30
        while sched.handles[0].charged_prefill == 0 and time.monotonic() < until:
            await asyncio.sleep(0.001)
        reader.cancel()  # the client left: Serve cancels the handler, and the call with it
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        while not posted and time.monotonic() < until:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        (replicas_handle,) = sched.handles
        assert replicas_handle.stats is None, "the request answered before it was cancelled"
        assert _charged(replicas_handle) > 0 and sum(charged) == pytest.approx(_charged(replicas_handle))
        assert posted == ["ingress-inbox"]
        assert not remote._awaiting
    finally:
        sched.drain(5)


def test_the_inbox_hands_over_what_was_posted_once() -> None:
    """``cluster.settle.Inbox``, the ingress's actor, as plain asyncio: a take waits for a
    post (up to its limit) and hands each item over once."""
    from kvblend.cluster.settle import Inbox
    from kvblend.cluster.wire import Settled

    async def main() -> list:
        inbox = Inbox()
        empty = await inbox.take(0.01)
        waiting = asyncio.ensure_future(inbox.take(10.0))
        await asyncio.sleep(0.01)
        await inbox.post(Settled(7, 12.0, 3))
        return [empty, await waiting, await inbox.take(0.01)]

    assert asyncio.run(main()) == [[], [Settled(7, 12.0, 3)], []]
