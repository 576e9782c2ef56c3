"""The scheduler's low-priority lane (``submit_background``): a job's steps run only while
no request waits, running streams get a decode step between any two of them, the lane is
bounded, drain drops it without waiting, and a failing job ends alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import Scheduler, SchedulerObserver
from kvblend.generation import SamplingParams
from tests.conftest import make_loaded

REQ = Request(documents=["the doctor works in paris ."], question="who is the doctor ?", method="full")
LONG = SamplingParams(max_tokens=12, ignore_eos=True)


class Order(SchedulerObserver):
    """What the worker did, in order: ("admit", id), ("decode", batch size), and the fake
    jobs' ("bg", name, i)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def on_admitted(self, handle) -> None:
        self.log.append(("admit", handle.id))

    def on_step(self, batch_size, seconds) -> None:
        self.log.append(("decode", batch_size))


def job(log: list, name: str, n: int, at=None):
    """A fake job of ``n`` steps recording each; ``at``: {step: callable} run in that step."""
    for i in range(n):
        log.append(("bg", name, i))
        if at and i in at:
            at[i]()
        yield
    return f"{name} done"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(make_loaded())


def test_a_waiting_request_is_admitted_before_the_next_background_step(engine: Engine) -> None:
    order = Order()
    sched = Scheduler(engine, observer=order)
    box = {}
    future = sched.submit_background(job(order.log, "a", 6, {1: lambda: box.setdefault("h", sched.submit(REQ, LONG))}))
    sched.start()
    assert future.result(30) == "a done"
    handle = box["h"]
    assert handle.result().token_ids
    sched.drain(5)
    log = order.log
    arrived = log.index(("bg", "a", 1))  # the request was queued inside this step
    assert log[arrived + 1] == ("admit", handle.id)  # the very next thing the worker did
    assert sched.background_stats() == (0, 1, 0, 0)


def test_running_streams_decode_between_background_steps(engine: Engine) -> None:
    alone = engine.generate(REQ, LONG).token_ids  # the answer with no background work
    order = Order()
    sched = Scheduler(engine, observer=order)
    handle = sched.submit(REQ, LONG)
    future = sched.submit_background(job(order.log, "a", 8))
    sched.start()
    assert handle.result().token_ids == alone
    future.result(30)
    sched.drain(5)
    log = order.log
    bg = [i for i, e in enumerate(log) if e[0] == "bg"]
    decode = [i for i, e in enumerate(log) if e[0] == "decode"]
    assert log[0] == ("admit", handle.id) and bg[0] > decode[0]  # the request came first
    between = [sum(1 for d in decode if a < d < b) for a, b in zip(bg, bg[1:]) if b < decode[-1]]
    assert len(between) >= 7 and all(n == 1 for n in between)  # one decode step between any two
    assert len(decode) == LONG.max_tokens - 1  # the first token came from the prefill


def test_the_lane_is_bounded(engine: Engine) -> None:
    sched = Scheduler(engine, max_background=1)  # not started: nothing leaves the lane
    first = sched.submit_background(job([], "a", 1))
    assert first is not None and sched.submit_background(job([], "b", 1)) is None
    assert sched.num_background == 1 and sched.background_stats().dropped == 1
    sched.start()
    assert first.result(30) == "a done"
    sched.drain(5)


def test_drain_drops_background_jobs_within_its_deadline(engine: Engine) -> None:
    closed = []

    def endless(name):
        try:
            while True:
                time.sleep(0.005)
                yield
        finally:
            closed.append(name)

    sched = Scheduler(engine)
    running = sched.submit_background(endless("a"))
    queued = sched.submit_background(endless("b"))
    sched.start()
    handle = sched.submit(REQ, SamplingParams(max_tokens=3, ignore_eos=True))
    time.sleep(0.1)
    t = time.monotonic()
    sched.drain(2.0)
    assert time.monotonic() - t < 2.0  # endless jobs did not hold the drain
    assert handle.result().finish_reason == "length"  # requests still finish
    assert running.cancelled() and queued.cancelled() and closed == ["a"]  # b never began: nothing to close
    assert sched.background_stats() == (0, 0, 0, 2)
    assert sched.submit_background(job([], "late", 1)) is None and sched.background_stats().dropped == 3
    with pytest.raises(CancelledError):
        running.result()


def test_a_failing_job_ends_alone(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    def broken():
        yield
        raise RuntimeError("shadow blew up")

    sched = Scheduler(engine)
    sched.start()
    failed = sched.submit_background(broken(), name="shadow check")
    with pytest.raises(RuntimeError, match="blew up"):
        failed.result(30)
    assert sched.alive and sched.submit(REQ, SamplingParams(max_tokens=3)).result().token_ids
    assert sched.submit_background(job([], "next", 2)).result(30) == "next done"
    sched.drain(5)
    assert sched.background_stats() == (0, 1, 1, 0)
    assert any("shadow check" in r.getMessage() for r in caplog.records)


def test_background_jobs_run_on_the_model_worker(engine: Engine) -> None:
    threads = []

    def where():
        threads.append(threading.current_thread().name)
        yield

    sched = Scheduler(engine)
    sched.start()
    sched.submit_background(where()).result(30)
    sched.drain(5)
    assert threads == ["kvblend-worker"]
