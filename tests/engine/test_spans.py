"""Runs of stored chunks as documents (issue 41): a prompt that holds part of a stored
chunk reuses that part of the chunk's KV. Exact at the ends of the ratio range on every
model family: ratio 1 equals a full prefill of the same prompt, ratio 0 places the stored
slice re-rotated to its new position (keys) and unchanged (values)."""

from __future__ import annotations

import pytest
import torch

from kvblend import rope as rope_lib
from kvblend.blend.config import BlendConfig
from kvblend.blend.layout import tokenize_document
from kvblend.engine import Engine, Request
from kvblend.engine.request import SpanSource
from kvblend.errors import InvalidRequestError
from kvblend.store.keys import chunk_key
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, FAMILIES, QUESTION

SYSTEM = "answer the question ."


def _parents(eng: Engine) -> list[tuple[int, ...]]:
    return [tokenize_document(eng.tokenizer, d) for d in DOCS[:2]]


def span_request(eng: Engine, method: str = "blend", **blend) -> Request:
    """Tokens 3..12 of the first chunk and 2..10 of the second, in that order."""
    a, b = _parents(eng)
    return Request(documents=[a[3:12], b[2:10]], sources=[SpanSource(a, 3), SpanSource(b, 2)],
                   question=QUESTION, system=SYSTEM, method=method, blend=BlendConfig(**blend))


def stored(eng: Engine) -> Engine:
    eng.warm(list(_parents(eng)), eng.sink_prefix)
    return eng


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_run_at_ratio_one_is_a_full_prefill(family: str) -> None:
    eng = stored(Engine(make_loaded(**FAMILIES[family])))
    blended = eng.prepare(span_request(eng, ratio=1.0))
    full = eng.prepare(span_request(eng, "full"))
    assert [(d.hit, d.source, d.tokens) for d in blended.stats.docs] == [(True, "memory", 9), (True, "memory", 8)]
    assert (blended.logits - full.logits).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_run_at_ratio_zero_is_the_stored_slice_moved(family: str) -> None:
    eng = stored(Engine(make_loaded(**FAMILIES[family])))
    req = span_request(eng, "reuse")
    prepared = eng.prepare(req)
    layout = eng.layout(req)
    ctx = eng.key_context(eng.sink_prefix, "default")
    for (parent, offset), start, n in zip([(s.chunk_ids, s.offset) for s in req.sources], layout.doc_starts,
                                          map(len, layout.docs)):
        chunk = eng.store.get(chunk_key(parent, ctx), parent)
        for i, layer in enumerate(eng.model.layers):
            k, v = chunk.keys[i][:, offset : offset + n], chunk.values[i][:, offset : offset + n]
            moved = rope_lib.rotate(k, start - (chunk.base_position + offset), layer.rope)
            assert torch.allclose(prepared.cache.keys[i][:, start : start + n], moved, atol=1e-4)
            assert torch.equal(prepared.cache.values[i][:, start : start + n], v)
    whole = eng.prepare(Request(documents=[d for d in req.documents], question=QUESTION, system=SYSTEM,
                                method="full"))
    assert (prepared.logits - whole.logits).abs().max().item() > 1e-3  # the slices' KV really is reused


def test_a_run_whose_chunk_is_not_stored_computes_the_chunk_once_and_stores_it() -> None:
    eng = Engine(make_loaded())
    first = eng.prepare(span_request(eng, ratio=1.0))
    assert [(d.hit, d.source) for d in first.stats.docs] == [(False, "chunk"), (False, "chunk")]
    assert (first.logits - eng.prepare(span_request(eng, "full")).logits).abs().max().item() <= 1e-3
    eng.flush()
    ctx = eng.key_context(eng.sink_prefix, "default")
    assert all(eng.store.contains(chunk_key(p, ctx)) for p in _parents(eng))  # the chunks, not the runs
    again = eng.prepare(span_request(eng))
    assert [(d.hit, d.source) for d in again.stats.docs] == [(True, "memory"), (True, "memory")]


def test_two_runs_of_one_chunk_share_its_lookup() -> None:
    eng = stored(Engine(make_loaded()))
    a, _ = _parents(eng)
    req = Request(documents=[a[0:6], a[4:14]], sources=[SpanSource(a, 0), SpanSource(a, 4)], question=QUESTION,
                  blend=BlendConfig(ratio=1.0))
    prepared = eng.prepare(req)
    assert [(d.hit, d.source) for d in prepared.stats.docs] == [(True, "memory"), (True, "request")]
    full = eng.prepare(Request(documents=req.documents, question=QUESTION, method="full"))
    assert (prepared.logits - full.logits).abs().max().item() <= 1e-3


def test_a_source_that_is_not_the_document_is_refused() -> None:
    eng = Engine(make_loaded())
    a, b = _parents(eng)
    with pytest.raises(InvalidRequestError, match="document 0 is not the run"):
        Request(documents=[a[3:12]], sources=[SpanSource(a, 4)], question=QUESTION)
    with pytest.raises(InvalidRequestError, match="one entry per document"):
        Request(documents=[a[3:12], b], sources=[SpanSource(a, 3)], question=QUESTION)
    with pytest.raises(InvalidRequestError, match="document 0 is not the run"):
        Request(documents=["text"], sources=[SpanSource(a, 0)], question=QUESTION)
