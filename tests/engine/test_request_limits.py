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
