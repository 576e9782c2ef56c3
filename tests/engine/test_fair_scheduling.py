"""Issue #20: the scheduler interleaves long prefills with decoding (slices batched with
decode tokens, or chunks a few layers per turn in place; fusion in layer groups), shares
the worker fairly between tenants (Virtual Token Counter, per-tenant queue caps) and runs
model jobs in their own lane."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvblend.blend.chunks import compute_chunk_kv, compute_chunk_steps
from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.engine.fair import FairQueue, TenantShare
from kvblend.engine.scheduler import QueueFullError, Scheduler, SchedulerObserver
from kvblend.generation import SamplingParams
from tests.conftest import WORDS, make_loaded

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


class Timeline(SchedulerObserver):
    """The order of admissions, first tokens and tokens, per request id."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def _add(self, kind: str, handle) -> None:
        with self.lock:
            self.events.append((kind, handle.id))

    def on_admitted(self, handle) -> None:
        self._add("admitted", handle)

    def on_first_token(self, handle, stats) -> None:
        self._add("first", handle)

    def on_token(self, handle, event, now) -> None:
        self._add("token", handle)

    def between(self, rid: str, start: tuple[str, str], end: tuple[str, str]) -> int:
        """Tokens of ``rid`` between two events."""
        a, b = self.events.index(start), self.events.index(end)
        return sum(1 for kind, who in self.events[a:b] if kind == "token" and who == rid)


def _long_question(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


def _stream_then(sched: Scheduler, second: Request, sampling: SamplingParams):
    """Start a long stream, wait for its first tokens, then submit ``second``."""
    stream = sched.submit(Request(documents=(), question="hello", method="full", tenant="a"), LONG)
    events = stream.events()
    next(events), next(events)
    other = sched.submit(second, sampling)
    return stream, other


@pytest.mark.parametrize("interleave", ["slices", "layers"])
@pytest.mark.parametrize("method", ["full", "blend"])
def test_a_long_prefill_lets_a_running_stream_decode_and_keeps_its_answer(method: str, interleave: str) -> None:
    loaded = make_loaded(num_hidden_layers=4, max_position_embeddings=512)
    docs = [_long_question(40), _long_question(50)]
    request = Request(documents=docs, question=_long_question(60), method=method, tenant="b")
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    eng = Engine(loaded)
    eng.generate(request, sampling)  # stores the documents (blend then hits them)
    eng.flush()
    eng.prefix_cache.clear()  # a blend's prompt remembered whole would serve the repeats: fuse each time
    want = eng.generate(request, sampling).token_ids
    eng.prefix_cache.clear()
    timeline = Timeline()
    sched = Scheduler(eng, max_running=4, observer=timeline, prefill_chunk_tokens=8, interleave=interleave)
    sched.start()
    stream, other = _stream_then(sched, request, sampling)
    assert other.result().token_ids == want
    stream.cancel()
    sched.drain(5)
    during = timeline.between(stream.id, ("admitted", other.id), ("first", other.id))
    if method == "full":  # ~170 prompt tokens, a slice or chunk of 8 per turn at most: a decode step each turn
        assert during >= 15
    else:  # fusion: two passes of 4 layers, a group of layers per turn
        assert during >= 2


def test_unsliced_prefill_stalls_the_stream() -> None:
    """The control: without slices the stream waits for the whole prefill."""
    eng = Engine(make_loaded(num_hidden_layers=4, max_position_embeddings=512))
    timeline = Timeline()
    sched = Scheduler(eng, max_running=4, observer=timeline, prefill_chunk_tokens=None)
    sched.start()
    stream, other = _stream_then(sched, Request(documents=(), question=_long_question(150), method="full"),
                                 SamplingParams(max_tokens=2, ignore_eos=True))
    other.result()
    stream.cancel()
    sched.drain(5)
    assert timeline.between(stream.id, ("admitted", other.id), ("first", other.id)) <= 1


# ----- the fair queue -----------------------------------------------------------------------
def test_the_tenant_with_the_least_service_goes_first() -> None:
    q: FairQueue[str] = FairQueue(64)
    for i in range(5):
        q.push("heavy", f"h{i}")
    started = [q.pop()]  # heavy alone: served
    q.charge("heavy", prefill_tokens=100)
    q.push("light", "l0")
    assert q.counter("light") == pytest.approx(100.0)  # lifted to heavy's level: no debt, no credit
    started.append(q.pop())  # a tie: light, with nothing in flight, before heavy (with one)
    q.charge("light", prefill_tokens=10)
    started.append(q.pop())  # light is ahead now (and has nothing more waiting)
    assert [t for t, _ in started] == ["heavy", "light", "heavy"]
    q.charge("heavy", prefill_tokens=100)
    q.push("light", "l1")  # light still busy: keeps its counter
    assert q.pop() == ("light", "l1")  # 110 < 200: light again, until it catches up


def test_weights_divide_service_and_decode_tokens_weigh_more() -> None:
    q: FairQueue[str] = FairQueue(64, {"gold": TenantShare(weight=4.0)}, decode_weight=2.0)
    q.push("gold", "g")
    q.push("plain", "p")
    q.charge("gold", prefill_tokens=100, decode_tokens=10)
    q.charge("plain", prefill_tokens=40)
    assert q.counter("gold") == pytest.approx(30.0) and q.counter("plain") == pytest.approx(40.0)
    assert q.pop() == ("gold", "g")


def test_an_idle_tenant_earns_no_credit() -> None:
    q: FairQueue[str] = FairQueue(64)
    q.push("a", "a0")
    q.pop()
    q.charge("a", prefill_tokens=1000)
    q.ended("a")
    q.push("b", "b0")  # b was never served: it enters at a's level, not at 0
    assert q.counter("b") == pytest.approx(1000.0)


def test_a_flooding_tenant_gets_the_refusals_and_another_is_admitted() -> None:
    q: FairQueue[str] = FairQueue(4, {"capped": TenantShare(max_queued=1)})
    for i in range(4):
        assert q.check("flood") is None
        q.push("flood", f"f{i}")
    assert q.check("flood") is not None  # the total is full and flood holds all of it
    assert q.check("light") is None  # below its fair part (4 / 2 tenants)
    q.push("light", "l0")
    q.push("light", "l1")
    assert q.check("light") is not None  # now at its part
    q.push("capped", "c0")
    assert "limit" in q.check("capped").message


def test_a_token_rate_refuses_until_the_bucket_refills(monkeypatch) -> None:
    import kvblend.engine.fair as fair

    now = [100.0]
    monkeypatch.setattr(fair.time, "monotonic", lambda: now[0])
    q: FairQueue[str] = FairQueue(64, {"metered": TenantShare(tokens_per_s=10.0)})
    assert q.check("metered") is None
    q.charge("metered", prefill_tokens=150)  # a 100-token burst, 50 over
    refusal = q.check("metered")
    assert refusal is not None and refusal.retry_after_s == pytest.approx(5.0)
    now[0] += 6.0
    assert q.check("metered") is None


@pytest.mark.parametrize("bad", [dict(weight=0.0), dict(weight=float("nan")), dict(max_queued=0),
                                 dict(tokens_per_s=-1.0)])
def test_invalid_shares_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        FairQueue(8, {"t": TenantShare(**bad)})


def test_a_light_tenant_is_served_before_a_heavy_backlog() -> None:
    """One worker slot, tenant "heavy" queues 8 requests, then "light" one: light's starts
    second (after the request already running), not ninth as FCFS would have it."""
    timeline = Timeline()
    sched = Scheduler(Engine(make_loaded()), max_running=1, observer=timeline)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    heavy = [sched.submit(Request(documents=(), question=f"hello {i}", tenant="heavy"), sampling) for i in range(8)]
    light = sched.submit(Request(documents=(), question="hello", tenant="light"), sampling)
    sched.start()
    for h in heavy + [light]:
        h.result()
    sched.drain(5)
    admitted = [who for kind, who in timeline.events if kind == "admitted"]
    assert admitted.index(light.id) <= 2
    with pytest.raises(QueueFullError):  # per-tenant cap through the scheduler
        capped = Scheduler(Engine(make_loaded()), shares={"t": TenantShare(max_queued=1)})
        capped.submit(Request(documents=(), question="a", tenant="t"), sampling)
        capped.submit(Request(documents=(), question="b", tenant="t"), sampling)


# ----- the jobs lane ------------------------------------------------------------------------
def test_a_job_computes_chunk_kv_on_the_worker_while_a_stream_decodes() -> None:
    eng = Engine(make_loaded())
    timeline = Timeline()
    sched = Scheduler(eng, max_running=2, observer=timeline, prefill_chunk_tokens=4)
    sched.start()
    stream = sched.submit(Request(documents=(), question="hello", tenant="a"), LONG)
    events = stream.events()
    next(events)
    ids = tuple(range(5, 45))
    seen = []
    steps = compute_chunk_steps(eng.model, (1,), ids, 4)

    def watched():
        seen.append(threading.current_thread().name)
        return (yield from steps)

    chunk = sched.submit_job(watched(), "test").result(timeout=30)
    want = compute_chunk_kv(eng.model, (1,), ids)
    assert seen == ["kvblend-worker"]
    for a, b in zip(chunk.keys + chunk.values, want.keys + want.values):
        assert torch.allclose(a, b, atol=1e-4)
    assert stream.completion_tokens > 1  # the stream kept going
    stream.cancel()
    sched.drain(5)
    assert sched.job_stats().ok == 1


def test_the_jobs_lane_is_bounded_and_write_back_goes_through_it() -> None:
    eng = Engine(make_loaded())
    sched = Scheduler(eng, max_jobs=1)  # not started: jobs wait

    def idle():
        yield None
        return 1

    first = sched.submit_job(idle())
    with pytest.raises(QueueFullError):
        sched.submit_job(idle())
    assert sched.job_stats().dropped == 1 and eng.model_owner is None  # not the owner before it runs
    sched.start()
    assert eng.model_owner == sched.run_job
    assert first.result(timeout=10) == 1
    docs = ["the city river is in paris .", "the doctor led the project ."]
    sched.submit(Request(documents=docs, question="who ?", method="blend", blend=BlendConfig(recompute_misses=True)),
                 SamplingParams(max_tokens=2)).result()
    sched.drain(10)  # waits for the write-back, whose chunks the worker computed
    assert eng.writeback_stats().written == 2 and sched.job_stats().ok == 3


def test_a_scheduler_never_started_leaves_write_back_to_the_engine() -> None:
    """Made but not started, a scheduler must not own the model: the engine's own requests
    still write their missed chunks back (they used to wait for a worker that never ran)."""
    eng = Engine(make_loaded())
    Scheduler(eng)
    eng.generate(Request(documents=["the doctor led the project ."], question="who ?"), SamplingParams(max_tokens=2))
    assert eng.writeback.flush(10) and eng.writeback_stats().written == 1


# ----- a long prefill steps aside for a tenant with less service -------------------------------
class _SubmitOnAdmission(Timeline):
    """Submits ``second`` from the worker the moment ``first`` is admitted (so it surely
    arrives while ``first`` is still prefilling)."""

    def __init__(self, sched_box: list, second: Request, sampling: SamplingParams) -> None:
        super().__init__()
        self.box, self.second, self.sampling, self.handles = sched_box, second, sampling, []

    def on_admitted(self, handle) -> None:
        super().on_admitted(handle)
        if not self.handles:
            self.handles.append(self.box[0].submit(self.second, self.sampling))


@pytest.mark.parametrize("preempt", [True, False])
def test_a_light_request_does_not_wait_for_another_tenants_long_prefill(preempt: bool) -> None:
    loaded = make_loaded(num_hidden_layers=4, max_position_embeddings=512)
    eng = Engine(loaded)
    heavy = Request(documents=(), question=_long_question(300), method="full", tenant="heavy")
    light = Request(documents=(), question="hello", method="full", tenant="light" if preempt else "heavy")
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    want_heavy, want_light = eng.generate(heavy, sampling).token_ids, eng.generate(light, sampling).token_ids
    box: list = []
    timeline = _SubmitOnAdmission(box, light, sampling)
    sched = Scheduler(eng, max_running=4, observer=timeline, prefill_chunk_tokens=8)
    box.append(sched)
    first = sched.submit(heavy, sampling)
    sched.start()
    assert first.result().token_ids == want_heavy  # paused and resumed: the same answer
    second = timeline.handles[0]
    assert second.result().token_ids == want_light
    sched.drain(5)
    order = [who for kind, who in timeline.events if kind == "first"]
    if preempt:  # another tenant: the short prompt goes ahead of the ~300-token one
        assert order == [second.id, first.id]
    else:  # the same tenant: its own requests keep their order
        assert order == [first.id, second.id]
    assert sched.num_running == 0 and not sched._paused


def test_a_paused_prefill_can_be_cancelled() -> None:
    from kvblend.engine.scheduler import RequestCancelledError

    eng = Engine(make_loaded(num_hidden_layers=4, max_position_embeddings=512))
    heavy = Request(documents=(), question=_long_question(300), method="full", tenant="heavy")
    light = Request(documents=(), question="hello", method="full", tenant="light")
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    box: list = []

    class CancelPaused(_SubmitOnAdmission):
        def on_admitted(self, handle) -> None:
            super().on_admitted(handle)
            if self.handles and handle is self.handles[0]:  # light admitted: heavy is paused now
                box[1].cancel()

    timeline = CancelPaused(box, light, sampling)
    sched = Scheduler(eng, max_running=4, observer=timeline, prefill_chunk_tokens=8)
    box.append(sched)
    box.append(sched.submit(heavy, sampling))
    sched.start()
    with pytest.raises(RequestCancelledError):
        box[1].result()
    assert timeline.handles[0].result().token_ids
    sched.drain(5)
    assert sched.num_running == 0 and not sched._paused


# ----- fair parts of the decode slots ----------------------------------------------------------
def _wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the scheduler never reached the state the test needs"
        time.sleep(0.005)


def test_a_tenant_holding_every_slot_parks_a_decode_for_a_waiting_tenant() -> None:
    """Two slots, both decoding long answers of tenant heavy: light's short request is served
    before either heavy stream ends (a heavy decode is parked for it, not waited for), and
    the parked stream resumes to the same tokens it gets alone (its cache and state kept)."""
    eng = Engine(make_loaded())
    # 160 tokens: the stream that is not parked must outlast light's prefill and 3 tokens on any host
    sampling, short = SamplingParams(max_tokens=160, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)
    heavy = [Request(documents=(), question=f"hello {i}", method="full", tenant="heavy") for i in range(2)]
    light = Request(documents=(), question="hello", method="full", tenant="light")
    want = [eng.generate(r, sampling).token_ids for r in heavy]
    timeline = Timeline()
    sched = Scheduler(eng, max_running=2, observer=timeline)
    sched.start()
    streams = [sched.submit(r, sampling) for r in heavy]
    _wait_for(lambda: sum(kind == "first" for kind, _ in timeline.events) >= 2)
    quick = sched.submit(light, short)
    assert len(quick.result().token_ids) == 3
    assert not any(h.done for h in streams), "light waited for a heavy stream to end"
    assert [h.result().token_ids for h in streams] == want
    sched.drain(5)
    assert sched.num_parked == 0 and sched.num_running == 0


def test_a_tenant_within_its_part_parks_nothing() -> None:
    """Slots split evenly: a waiting request of a tenant already at its part waits for a
    slot; nobody is parked (no thrash between two tenants at their parts)."""
    eng = Engine(make_loaded())
    sampling = SamplingParams(max_tokens=160, ignore_eos=True)
    sched = Scheduler(eng, max_running=2, observer=Timeline())
    sched.start()
    a = sched.submit(Request(documents=(), question="hello a", method="full", tenant="a"), sampling)
    b = sched.submit(Request(documents=(), question="hello b", method="full", tenant="b"), sampling)
    _wait_for(lambda: len(sched._running) == 2)
    third = sched.submit(Request(documents=(), question="hello c", method="full", tenant="b"), sampling)
    parked = []
    while not third.done:
        parked.append(sched.num_parked)
        time.sleep(0.005)
    assert max(parked) == 0 and a.result().token_ids and b.result().token_ids
    sched.drain(5)


def test_a_prefill_within_its_part_is_not_sliced_for_streams_over_theirs() -> None:
    """Slices beside streams keep the streams' pace, unless every stream's tenant holds more
    than its part of the slots and the prefilling tenant is within its own."""
    from types import SimpleNamespace

    sched = Scheduler(Engine(make_loaded()), max_running=4, prefill_chunk_tokens=1024, interleave="slices")
    sched._decode_s, sched._token_s, sched._last_slice = 0.07, 0.0035, 10_000
    stream = lambda t: SimpleNamespace(handle=SimpleNamespace(tenant=t))  # noqa: E731
    sched._prefill = SimpleNamespace(handle=SimpleNamespace(tenant="light"))
    sched._running = [stream("heavy")] * 3
    assert sched.slice_tokens("light") == 1024  # heavy holds 3 of 4 slots, its part is 2
    assert sched.slice_tokens("heavy") == 40 and sched.slice_tokens(None) == 40  # its own streams / a job
    sched._running = [stream("heavy")] * 2 + [stream("other")]
    assert sched.slice_tokens("light") == 40  # "other" holds 1, within its part of 4/3
    sched._running = [stream("heavy")]  # heavy within its part of 2 ...
    assert sched.slice_tokens("light") == 40
    sched._queue.push("heavy", object())  # ... but asking for more than it is served
    assert sched.slice_tokens("light") == 1024
    sched._queue.push("light", object())  # unless light has more waiting too
    assert sched.slice_tokens("light") == 40


def test_a_newcomers_prefill_is_not_paused_by_the_other_tenants_backlog() -> None:
    """A newcomer's prefill pauses another tenant's and then runs to its end: the other
    tenant's queued requests wait until it is PAUSE_QUANTUM_TOKENS behind, instead of
    pausing the newcomer as soon as its first slices made it the more served (its prompt
    then waited for a whole prefill of theirs, again and again under a flood)."""
    eng = Engine(make_loaded(num_hidden_layers=4, max_position_embeddings=1024))
    heavy = Request(documents=(), question=_long_question(300), method="full", tenant="heavy")
    light = Request(documents=(), question=_long_question(200), method="full", tenant="light")
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    box: list = []
    timeline = _SubmitOnAdmission(box, light, sampling)
    sched = Scheduler(eng, max_running=4, observer=timeline, prefill_chunk_tokens=8)
    box.append(sched)
    owners: list[str] = []
    real_step = sched._step

    def step(forward, owner):
        if forward is not None:
            owners.append(owner.handle.tenant)
        real_step(forward, owner)

    sched._step = step
    first, backlog = sched.submit(heavy, sampling), sched.submit(heavy, sampling)
    sched.start()
    first.result(), backlog.result(), timeline.handles[0].result()
    sched.drain(5)
    runs = [t for i, t in enumerate(owners) if i == 0 or owners[i - 1] != t]
    assert runs in (["light", "heavy"], ["heavy", "light", "heavy"]), runs[:12]
