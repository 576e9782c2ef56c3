"""The scheduler: batched requests equal one-at-a-time requests; queue, cancel, deadline,
drain and worker death behave as the contract says."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from kvblend.engine import Engine, Request, RequestStats
from kvblend.engine import scheduler as scheduler_mod
from kvblend.engine.scheduler import (
    DeadlineExceededError, DrainingError, Outcome, QueueFullError, RequestCancelledError, RequestHandle, Scheduler,
    SchedulerObserver, WorkerDeadError,
)
from kvblend.errors import ContextLengthError, InvalidRequestError, KvblendError, NonFiniteLogitsError
from kvblend.generation import SamplingParams
from kvblend.generation.chunked import InPlace
from tests.conftest import make_loaded

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def _requests() -> list[Request]:
    """Different prompt lengths and methods, sharing some documents."""
    docs = ["the city river is in paris .", "alpha beta gamma delta " * 3, "the doctor led the project ."]
    return [
        Request(documents=docs[:1], question="where is the river ?", method="full"),
        Request(documents=docs, question="who led the project ?", method="blend"),
        Request(documents=docs[1:], question="what was approved ?", method="prefix"),
        Request(documents=docs[::-1] * 2, question="who works in rome ?", method="blend"),
        Request(documents=(), question="hello", method="full"),
    ]


class Recorder(SchedulerObserver):
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.outcomes: dict[str, Outcome] = {}
        self.batch_sizes: list[int] = []
        self.tokens = 0

    def on_token(self, handle, event, now) -> None:
        self.tokens += 1
        time.sleep(self.delay_s)

    def on_step(self, batch_size, seconds) -> None:
        self.batch_sizes.append(batch_size)

    def on_finish(self, handle, outcome) -> None:
        assert handle.id not in self.outcomes
        self.outcomes[handle.id] = outcome


def _reference(engine: Engine, requests: list[Request], sampling: SamplingParams):
    """One-at-a-time results once the chunk store and prefix cache hold everything (so a
    later run hits exactly as this one did)."""
    for r in requests:
        engine.generate(r, sampling)
    return [engine.generate(r, sampling) for r in requests]


@pytest.fixture(params=["llama", "qwen2"])
def engine(request) -> Engine:
    return Engine(make_loaded(request.param))


def _started(engine: Engine, **kw) -> Scheduler:
    sched = Scheduler(engine, **kw)
    sched.start()
    return sched


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.2, top_p=0.9, seed=3, stop=("river",)),
])
def test_batched_requests_equal_one_at_a_time(engine: Engine, sampling: SamplingParams) -> None:
    requests = _requests()
    expected = _reference(engine, requests, sampling)
    rec = Recorder()
    sched = _started(engine, max_running=3, observer=rec)  # 5 requests: later ones join running batches
    handles = [sched.submit(r, sampling) for r in requests]
    results = [h.result() for h in handles]
    for got, want in zip(results, expected):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert got.stats.docs == want.stats.docs and got.stats.prompt_tokens == want.stats.prompt_tokens
    sched.drain(5)  # joins the worker: every hook has run
    assert max(rec.batch_sizes) == 3 and min(rec.batch_sizes) < 3
    assert all(o.status == "ok" for o in rec.outcomes.values()) and len(rec.outcomes) == 5
    assert rec.tokens == sum(len(r.token_ids) for r in results)


def test_stats_precede_the_first_token_and_count_the_queue(engine: Engine) -> None:
    sched = _started(engine, max_running=1)
    first, second = (sched.submit(r, SamplingParams(max_tokens=5, ignore_eos=True)) for r in _requests()[:2])
    items = list(second.events())
    assert isinstance(items[0], RequestStats) and sum(isinstance(i, RequestStats) for i in items) == 1
    assert second.queue_s > 0 and items[0].ttft_s >= second.queue_s
    assert first.result().finish_reason == "length"
    sched.drain(5)


def test_cancel_frees_the_slot_within_one_step(engine: Engine) -> None:
    rec = Recorder(delay_s=0.001)
    sched = _started(engine, max_running=1, observer=rec)
    long, waiting = sched.submit(_requests()[0], LONG), sched.submit(_requests()[1], SamplingParams(max_tokens=4))
    events = long.events()
    next(events)
    long.cancel()
    at_cancel = long.completion_tokens
    with pytest.raises(RequestCancelledError):
        list(events)
    assert long.completion_tokens <= at_cancel + 1
    assert waiting.result().token_ids  # the freed slot served the next request
    sched.drain(5)
    assert rec.outcomes[long.id].status == "cancelled"
    assert sched.num_running == 0 and sched.num_waiting == 0


def test_cancel_while_queued_never_runs() -> None:
    eng = Engine(make_loaded())
    rec = Recorder()
    sched = Scheduler(eng, observer=rec)
    handle = sched.submit(_requests()[0], LONG)
    handle.cancel()
    sched.start()
    with pytest.raises(RequestCancelledError):
        handle.result()
    sched.drain(5)
    assert rec.outcomes[handle.id].completion_tokens == 0 and rec.tokens == 0


def test_full_queue_refuses_with_retry_after_then_serves() -> None:
    sched = Scheduler(Engine(make_loaded()), max_running=2, max_queued=3)  # not started: nothing leaves the queue
    handles = [sched.submit(_requests()[0], SamplingParams(max_tokens=3)) for _ in range(3)]
    with pytest.raises(QueueFullError) as err:
        sched.submit(_requests()[0], SamplingParams(max_tokens=3))
    assert err.value.retry_after_s >= 1 and sched.num_waiting == 3
    sched.start()
    assert all(h.result().token_ids for h in handles)
    sched.submit(_requests()[0], SamplingParams(max_tokens=3)).result()  # room again
    sched.drain(5)


def test_deadline_ends_running_and_queued_requests() -> None:
    rec = Recorder(delay_s=0.004)  # >= 0.8 s for 200 tokens
    sched = _started(Engine(make_loaded()), max_running=1, observer=rec)
    running = sched.submit(_requests()[0], LONG, deadline_s=0.3)
    queued = sched.submit(_requests()[1], SamplingParams(max_tokens=4), deadline_s=0.05)
    other = sched.submit(_requests()[2], SamplingParams(max_tokens=4))
    with pytest.raises(DeadlineExceededError):
        running.result()
    with pytest.raises(DeadlineExceededError):
        queued.result()
    assert other.result().token_ids
    sched.drain(5)
    assert rec.outcomes[running.id].status == "deadline" and rec.outcomes[running.id].completion_tokens < 200
    assert rec.outcomes[queued.id].completion_tokens == 0


def test_drain_finishes_accepted_work_then_refuses() -> None:
    eng = Engine(make_loaded())
    sched = _started(eng, max_running=2)
    blend = Request(documents=["north south east west city"], question="where ?", method="blend")
    handles = [sched.submit(r, SamplingParams(max_tokens=6)) for r in (*_requests(), blend)]
    sched.drain(timeout_s=30)
    assert all(h.result().token_ids for h in handles)
    assert not sched.alive and sched.draining
    with pytest.raises(DrainingError):
        sched.submit(_requests()[0], SamplingParams())
    assert eng.writeback.stats().pending == 0  # background chunk writes were flushed


def test_drain_timeout_ends_what_is_left() -> None:
    rec = Recorder(delay_s=0.002)
    sched = _started(Engine(make_loaded()), max_running=1, observer=rec)
    handles = [sched.submit(r, LONG) for r in _requests()[:3]]
    next(handles[0].events())
    t = time.perf_counter()
    sched.drain(timeout_s=0.05)
    assert time.perf_counter() - t < 2
    for h in handles:
        with pytest.raises(DrainingError):
            h.result()
    assert {o.status for o in rec.outcomes.values()} == {"drained"}


def test_a_request_error_ends_only_that_request() -> None:
    sched = _started(Engine(make_loaded(max_position_embeddings=64)))
    too_long = sched.submit(Request(documents=["the city river " * 30], question="?"), SamplingParams())
    fine = sched.submit(_requests()[4], SamplingParams(max_tokens=3))
    with pytest.raises(ContextLengthError):
        too_long.result()
    assert fine.result().token_ids and sched.alive
    sched.drain(5)


POISON = 77  # max_tokens that marks the request a fault is injected into (its cache's capacity)


def _fault_setup(monkeypatch, eng: Engine, fault: str) -> tuple[Scheduler, Recorder]:
    """A scheduler whose batched forward misbehaves for the one request with max_tokens
    POISON: it raises (the whole batch fails), or its logits come back NaN."""
    real = scheduler_mod.forward_batch

    def faulty(model, members):
        bad = [m.cache.capacity >= POISON and m.ids.shape[0] == 1 and m.cache.length > 0 for m in members]
        if fault == "raise" and any(bad):
            raise RuntimeError("simulated kernel failure")
        outs = real(model, members)
        return [torch.full_like(o, float("nan")) if b and fault == "nan" else o for o, b in zip(outs, bad)]

    monkeypatch.setattr(scheduler_mod, "forward_batch", faulty)
    rec = Recorder()
    # whole prefills: a slice sized from measured step times could be one token long and
    # look like a decode step to ``faulty`` (the fault then hit the prefill: a flaky stage)
    return _started(eng, max_running=4, observer=rec, prefill_chunk_tokens=None), rec


@pytest.mark.parametrize("fault,stage,error", [
    ("raise", "decode", scheduler_mod.InternalRequestError),
    ("nan", "sample", NonFiniteLogitsError),
])
def test_a_fault_in_one_decoding_request_ends_it_alone(monkeypatch, fault, stage, error) -> None:
    """A batched forward that fails (or yields NaN logits) for one request: that request
    ends with its error, the others get the tokens they get alone, the worker lives."""
    eng = Engine(make_loaded())
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [r.token_ids for r in _reference(eng, _requests()[:3], sampling)]
    sched, rec = _fault_setup(monkeypatch, eng, fault)
    good = [sched.submit(r, sampling) for r in _requests()[:3]]
    bad = sched.submit(_requests()[4], SamplingParams(max_tokens=POISON, ignore_eos=True))
    with pytest.raises(error):
        bad.result()
    assert [h.result().token_ids for h in good] == want
    assert sched.alive and sched.restarts == 0
    out = rec.outcomes[bad.id]
    assert out.status == "error" and out.stage == stage and out.completion_tokens >= 1
    sched.drain(5)


@pytest.mark.parametrize("temperature", [1e-36, 1e-37, 1e-38])
def test_a_tiny_temperature_is_answered_and_the_next_request_too(temperature) -> None:
    """Issue #20: temperature 1e-37 made the logits overflow, multinomial raised inside the
    batched step and the worker died for every request."""
    sched = _started(Engine(make_loaded()))
    tiny = sched.submit(_requests()[0], SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True))
    assert len(tiny.result().token_ids) == 8
    assert sched.submit(_requests()[4], SamplingParams(max_tokens=3)).result().token_ids and sched.alive
    sched.drain(5)


def test_the_supervisor_restarts_a_failed_worker_loop(monkeypatch) -> None:
    """A failure outside any one request (here the loop's own bookkeeping) ends the requests
    in flight as internal errors, keeps the queued ones, and the worker serves on."""
    eng = Engine(make_loaded())
    rec = Recorder()
    restarts = []
    rec.on_restart = restarts.append
    sched = Scheduler(eng, max_running=1, observer=rec)
    real, calls = sched._expire, []

    def fails_once() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated bookkeeping bug")
        real()

    monkeypatch.setattr(sched, "_expire", fails_once)
    first = sched.submit(_requests()[0], SamplingParams(max_tokens=20, ignore_eos=True))
    queued = sched.submit(_requests()[4], SamplingParams(max_tokens=3))
    sched.start()
    with pytest.raises(scheduler_mod.InternalRequestError):
        first.result()
    assert queued.result().token_ids and sched.alive
    assert sched.restarts == 1 and len(restarts) == 1 and rec.outcomes[first.id].stage == "worker"
    sched.drain(5)


def test_the_supervisor_gives_up_on_a_loop_that_keeps_failing(monkeypatch) -> None:
    sched = Scheduler(Engine(make_loaded()), max_running=1)

    def broken() -> None:
        raise RuntimeError("simulated persistent failure")

    monkeypatch.setattr(sched, "_expire", broken)
    handles = [sched.submit(r, SamplingParams(max_tokens=5, ignore_eos=True)) for r in _requests()[:3]]
    sched.start()
    for h in handles:
        with pytest.raises(WorkerDeadError):
            h.result()
    sched._thread.join(5)
    assert not sched.alive and sched.restarts == scheduler_mod.MAX_RESTARTS
    with pytest.raises(WorkerDeadError):
        sched.submit(_requests()[0], SamplingParams())


def test_async_events_equal_blocking_events() -> None:
    eng = Engine(make_loaded())
    sched = _started(eng, max_running=4)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [r.token_ids for r in _reference(eng, _requests()[:3], sampling)]

    async def read(handle) -> list[int]:
        return [i.token_id async for i in handle.aevents() if not isinstance(i, RequestStats)]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(read(sched.submit(r, sampling)) for r in _requests()[:3]))

    assert asyncio.run(main()) == expected
    sched.drain(5)


def test_a_handle_reports_its_admission_on_request_and_what_its_tenant_was_charged() -> None:
    """A model replica tells its ingress when a request leaves the queue and what its
    tenant was charged for it (``cluster.wire``): ``aevents(admissions=True)`` gives an
    ``Admitted`` before the request's items (other readers never see it), and the handle
    keeps the fair queue's charges."""
    from kvblend.engine.scheduler import Admitted

    sched = _started(Engine(make_loaded()), max_running=2)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    request = Request(question="where is the river ?", method="full", tenant="t")

    handles = []

    async def read(admissions: bool) -> list:
        handles.append(sched.submit(request, sampling))
        return [item async for item in handles[-1].aevents(admissions=admissions)]

    try:
        seen = asyncio.run(read(True))
        assert isinstance(seen[0], Admitted) and seen[0].queue_s >= 0
        assert isinstance(seen[1], RequestStats) and not any(isinstance(i, Admitted) for i in seen[1:])
        assert not any(isinstance(i, Admitted) for i in asyncio.run(read(False)))
        handles.append(sched.submit(request, sampling))
        assert not any(isinstance(i, Admitted) for i in handles[-1].events())
        for h in handles:
            assert h.charged_prefill > 0 and h.charged_decode == 4  # the first token came with the prefill
        assert sched.tenant_counter("t") == pytest.approx(sum(h.charged_prefill + 2.0 * h.charged_decode
                                                              for h in handles))
    finally:
        sched.drain(5)


def test_on_end_calls_back_once_the_request_ended_with_its_final_charges() -> None:
    """A model replica whose call was cancelled stops reading its request, and sends its
    ingress what the tenant was charged once the scheduler ended it (``cluster.model``):
    ``on_end`` calls back then, on the worker thread, or at once for a request that ended;
    a failing callback is logged, not raised into the worker."""
    sched = _started(Engine(make_loaded()), max_running=1, prefill_chunk_tokens=16)
    request = Request(documents=[tuple(5 + i % 40 for i in range(100))], question="where is the river ?",
                      method="full", tenant="t")
    seen = []
    try:
        handle = sched.submit(request, SamplingParams(max_tokens=120, ignore_eos=True))
        handle.on_end(lambda h: 1 / 0)
        handle.on_end(lambda h: seen.append((threading.current_thread().name, h.done, h.charged_prefill)))
        until = time.monotonic() + 30
        while handle.charged_prefill == 0 and time.monotonic() < until:
            time.sleep(0.001)
        handle.cancel()  # in its prefill or its first decode steps
        with pytest.raises(KvblendError, match="cancelled"):
            handle.result()
        while not seen and time.monotonic() < until:  # called right after the end reached the reader
            time.sleep(0.001)
        ((thread, done, charged),) = seen
        assert thread != threading.current_thread().name and done and charged == handle.charged_prefill > 0
        handle.on_end(lambda h: seen.append(h.charged_decode))  # ended already: at once
        assert seen[1:] == [handle.charged_decode]
        assert sched.alive
    finally:
        sched.drain(5)


def test_submitters_on_many_threads_all_get_their_answers() -> None:
    eng = Engine(make_loaded())
    sched = _started(eng, max_running=4, max_queued=64)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want = {i: r.token_ids for i, r in enumerate(_reference(eng, _requests(), sampling))}
    got: dict[int, list[int]] = {}

    def client(i: int) -> None:
        got[i] = sched.submit(_requests()[i % 5], sampling).result().token_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(15)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {i: want[i % 5] for i in range(15)}
    sched.drain(5)


def test_invalid_scheduler_settings_and_deadlines_are_refused() -> None:
    eng = Engine(make_loaded())
    for bad in (dict(max_running=0), dict(max_queued=-1), dict(deadline_s=0)):
        with pytest.raises(ValueError):
            Scheduler(eng, **bad)
    sched = Scheduler(eng)
    assert not sched.started and not sched.alive
    with pytest.raises(InvalidRequestError):
        sched.submit(_requests()[0], SamplingParams(), deadline_s=-1)
    assert sched.num_waiting == 0


def test_an_internal_prefill_failure_ends_that_request_as_internal(monkeypatch) -> None:
    eng = Engine(make_loaded())
    real = eng.prepare_steps

    def flaky(request, extra_capacity=0, slice_tokens=None):
        if request.question == "hello":
            raise RuntimeError("simulated bug")
        return (yield from real(request, extra_capacity, slice_tokens))

    monkeypatch.setattr(eng, "prepare_steps", flaky)
    rec = Recorder()
    sched = _started(eng, observer=rec)
    bad, good = sched.submit(_requests()[4], SamplingParams()), sched.submit(_requests()[0], SamplingParams(max_tokens=3))
    with pytest.raises(scheduler_mod.InternalRequestError):
        bad.result()
    assert good.result().token_ids and sched.alive
    sched.drain(5)
    assert rec.outcomes[bad.id].status == "error" and not isinstance(rec.outcomes[bad.id].error, KvblendError)
    assert rec.outcomes[bad.id].stage == "prepare"


def test_slices_beside_streams_are_sized_to_the_stall_asked_for() -> None:
    """A step carrying a slice should take about ``stall_steps`` decode steps: (g - 1) d / c
    tokens, from the measured decode step d and per-token slice time c, grown at most 2x."""
    def sized(stall_steps: float, last: int) -> int:
        sched = Scheduler(Engine(make_loaded()), prefill_chunk_tokens=1024, stall_steps=stall_steps,
                          interleave="slices")
        sched._running = [object()]  # a stream decodes
        sched._decode_s, sched._token_s, sched._last_slice = 0.07, 0.0035, last
        return sched.slice_tokens()

    assert sized(3.0, 10_000) == 40 and sized(5.0, 10_000) == 80 and sized(61.0, 10_000) == 1024
    assert sized(5.0, 20) == 40  # one step's measure cannot make a long stall at once
    with pytest.raises(ValueError, match="stall_steps"):
        Scheduler(Engine(make_loaded()), stall_steps=1.0)


def test_in_place_work_beside_streams_stops_before_the_turn_is_spent(monkeypatch) -> None:
    """Beside a decoding stream, in-place work stops before its next step (predicted to take
    what the last one did) would pass (stall_steps - 1) decode steps, but always makes one
    step; without streams, ``prefill_chunk_tokens`` token-layers per layer bound a turn. The
    chunk asked for next has layers of about a fifth of the turn, at their measured cost."""
    from kvblend.models.transformer import LayerDone

    now, units = [0.0], [0]
    monkeypatch.setattr(scheduler_mod, "_clock", lambda: now[0])

    def work(seconds: float, outer_s: float | None = None):
        """Layers of 10 tokens taking ``seconds``; with ``outer_s``, every other one is a
        first or last layer (not inner: it also embeds or makes logits) taking that."""
        while True:
            inner = outer_s is None or units[0] % 2 == 1
            now[0] += seconds if inner else outer_s
            units[0] += 1
            yield LayerDone(10, inner=inner)

    def turn(sched: Scheduler, seconds: float, outer_s: float | None = None) -> int:
        units[0] = 0
        assert sched._advance(scheduler_mod._Task(work(seconds, outer_s))) is None
        return units[0]

    sched = Scheduler(Engine(make_loaded()), prefill_chunk_tokens=128, stall_steps=3.0, interleave="layers")
    layers = len(sched.engine.model.layers)
    sched._running = [object()]  # a stream decodes
    assert turn(sched, 0.01, outer_s=0.5) == -(-64 * layers // 10)  # no decode step measured: 64 token-layers per layer
    assert sched._layer_s == pytest.approx(0.001)  # the inner layers' cost only
    assert sched.slice_tokens() == InPlace(128)  # nor the turn: the first chunk's size
    sched._decode_s = 0.05  # the turn's in-place budget: (3 - 1) x 50 ms
    assert sched.slice_tokens() == InPlace(int(0.1 / (scheduler_mod.UNITS_PER_TURN * 0.001)))
    assert turn(sched, 0.03) == 3  # 90 ms; a fourth step would end at 120
    assert turn(sched, 0.15) == 1  # a step longer than the budget still runs, alone
    sched._running = []
    assert turn(sched, 0.03) == -(-128 * layers // 10)  # nothing decodes: 128 token-layers per layer
    assert sched.slice_tokens() == 128


def test_a_prefill_is_charged_its_in_place_work_to_the_fraction_and_in_its_last_turn(monkeypatch) -> None:
    """The fair queue counts a prefill's in-place layers as token-layers over the layer count,
    fractions kept, and the layers of the turn in which the prefill ends count too."""
    from kvblend.models.transformer import LayerDone

    sched = Scheduler(Engine(make_loaded()), interleave="layers")
    layers = len(sched.engine.model.layers)
    assert layers > 1

    def work():
        for _ in range(3):
            yield LayerDone(1, inner=True)
        yield None  # other work in place: the turn ends here
        yield LayerDone(1, inner=True)
        return "prepared"

    task = scheduler_mod._Prefill(RequestHandle(Request(question="q", tenant="t"), SamplingParams(), None), work())
    ended = []
    monkeypatch.setattr(sched, "_completed", lambda t, value: ended.append(value))
    sched._prefill = task
    assert sched._slice() == (None, task)
    assert sched.tenant_counter("t") == pytest.approx(3 / layers)
    assert sched._slice() == (None, None) and ended == ["prepared"]
    assert sched.tenant_counter("t") == pytest.approx(4 / layers)


def test_closing_a_prefill_between_two_layers_leaves_its_cache_as_before() -> None:
    """A request cancelled or failed between two layers of an in-place chunk: the cache's
    length never moved, and prefilling again from it equals one forward."""
    from kvblend.generation.chunked import forward_chunks

    model = make_loaded().model
    ids = torch.randint(3, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))  # (20,)
    cache = model.new_cache(20)
    model(ids[:8], cache, logits_for="none")
    steps = forward_chunks(model, ids[8:], cache, lambda: InPlace(6))
    next(steps)  # one layer of the first chunk done
    steps.close()
    assert cache.length == 8
    want = model(ids, model.new_cache(20))
    assert torch.allclose(model(ids[8:], cache), want, atol=1e-4, rtol=0)


def test_interleave_auto_runs_in_place_on_a_cpu() -> None:
    assert Scheduler(Engine(make_loaded())).in_place
    assert not Scheduler(Engine(make_loaded()), interleave="slices").in_place
    with pytest.raises(ValueError, match="interleave"):
        Scheduler(Engine(make_loaded()), interleave="sideways")
