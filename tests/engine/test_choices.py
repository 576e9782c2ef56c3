"""A request of ``n`` choices on the scheduler: one prefill, ``n`` decodes, each choice's
events told apart by ``index``; ``result()`` is choice 0's."""

from __future__ import annotations

from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import Scheduler
from kvblend.generation import SamplingParams, StreamEvent
from tests.conftest import make_loaded


def test_a_scheduled_request_of_three_choices_prefills_once_and_result_is_choice_0() -> None:
    engine = Engine(make_loaded())
    calls = []
    real = engine.prepare_steps
    engine.prepare_steps = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    scheduler = Scheduler(engine, max_running=2)
    scheduler.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=3, ignore_eos=True)
        handle = scheduler.submit(Request(question="who is the doctor ?", method="full"), params)
        events = [e for e in handle.events() if isinstance(e, StreamEvent)]
        assert len(calls) == 1 and sorted({e.index for e in events}) == [0, 1, 2]
        assert [sum(e.index == i for e in events) for i in range(3)] == [6, 6, 6]
        assert handle.completion_tokens == 18
        again = scheduler.submit(Request(question="who is the doctor ?", method="full"), params).result()
        assert again.token_ids == [e.token_id for e in events if e.index == 0]
    finally:
        scheduler.drain(10)
