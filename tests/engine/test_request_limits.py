"""Sizes and inputs a client controls are bounded or refused before any work is done."""

from __future__ import annotations

import pytest

from kvblend.engine import Engine, Request
from kvblend.errors import InvalidRequestError
from kvblend.generation import SamplingParams
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION


@pytest.fixture(scope="module")
def recording() -> tuple[Engine, list[int]]:
    """An engine whose model records the capacity of every cache it allocates."""
    eng, sizes = Engine(make_loaded(max_position_embeddings=96)), []
    new_cache = eng.model.new_cache

    def recorded(capacity: int):
        sizes.append(capacity)
        return new_cache(capacity)

    eng.model.new_cache = recorded
    return eng, sizes


def test_absurd_max_tokens_is_a_named_error() -> None:
    for bad in (2**40, 0, 1.5, True):
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            SamplingParams(max_tokens=bad)
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=("x" * 10_000,))


@pytest.mark.parametrize("method", ["full", "prefix", "blend"])
def test_cache_is_sized_by_the_context_not_by_max_tokens(recording, method: str) -> None:
    eng, sizes = recording
    sizes.clear()
    context = eng.loaded.config.context_length
    res = eng.generate(Request(documents=DOCS[:1], question=QUESTION, method=method),
                       SamplingParams(max_tokens=10**6, ignore_eos=True))
    assert sizes and max(sizes) <= context
    assert res.finish_reason == "length" and res.stats.prompt_tokens + len(res.token_ids) == context
    prepared = eng.prepare(Request(documents=DOCS, question=QUESTION, method=method), extra_capacity=10**6)
    assert prepared.cache.capacity <= context


def test_an_empty_prompt_is_refused_not_crashed() -> None:
    loaded = make_loaded()
    loaded.tokenizer.bos_token = None  # no BOS, and no chat template below: nothing but the request
    eng = Engine(loaded)
    for method in ("full", "prefix", "reuse", "blend"):
        with pytest.raises(InvalidRequestError, match="empty"):
            eng.prepare(Request(documents=["", ""], question="", use_chat_template=False, method=method))


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": 5}],
    [{"role": "wizard", "content": "hi"}],
    ["just a string"],
    [],
    "user: hi",
])
def test_bad_chat_messages_are_refused_when_the_request_is_made(messages) -> None:
    with pytest.raises(InvalidRequestError, match="message"):
        Request(documents=DOCS[:1], messages=messages)


def test_request_fields_have_the_right_types() -> None:
    for bad in ({"question": 5}, {"question": QUESTION, "system": ["x"]}, {"question": QUESTION, "tenant": ""},
                {"question": QUESTION, "documents": [3.5]}, {"question": QUESTION, "documents": [["a"]]}):
        with pytest.raises(InvalidRequestError):
            Request(**{"documents": DOCS[:1], **bad})
    assert Request(documents=[range(3)], question=QUESTION).documents == ((0, 1, 2),)


def test_close_lets_a_request_in_flight_finish_and_refuses_later_ones() -> None:
    import threading

    from kvblend.errors import EngineClosedError

    eng = Engine(make_loaded())
    inside, closed = threading.Event(), threading.Event()
    store_close, new_cache = eng.store.close, eng.model.new_cache

    def slow_new_cache(capacity: int):  # the request pauses between chunk lookup and write-back
        inside.set()
        closed.wait(timeout=1.0)  # long enough for an unguarded close to shut the writer down
        return new_cache(capacity)

    def closing_store() -> None:
        closed.set()
        store_close()

    eng.model.new_cache, eng.store.close = slow_new_cache, closing_store
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(_run(eng)))
    worker.start()
    inside.wait(timeout=30)
    eng.close()
    worker.join(timeout=60)
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert eng.store.stats().entries == 3  # its misses were written back before the store closed
    with pytest.raises(EngineClosedError):
        eng.prepare(Request(documents=DOCS, question=QUESTION))
    eng.close()  # twice is fine


def _run(eng: Engine) -> object:
    try:
        return eng.prepare(Request(documents=DOCS, question=QUESTION))
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc
