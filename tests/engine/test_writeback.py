"""The engine's write-back of missed chunks: admission before compute, one computation
per key in flight, failures counted and logged, honest per-document sources (#10)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import kvblend.engine.engine as engine_module
from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, PrefixCache, Request
from kvblend.store import StoreConfig, build_store
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION


class CountingCompute:
    """Wraps ``compute_chunk_steps`` (the write-back's chunk computation): counts calls,
    optionally waits for a gate or raises."""

    def __init__(self, real, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.real, self.gate, self.fail = real, gate, fail
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("out of memory (test)")
        return self.real(*args, **kwargs)


def _no_prefix() -> PrefixCache:
    """No prefix cache: a repeated request must reach the store (an exact prompt would serve it whole)."""
    return PrefixCache(0)


@pytest.fixture
def loaded():
    return make_loaded()


def _install(monkeypatch: pytest.MonkeyPatch, **kw) -> CountingCompute:
    spy = CountingCompute(engine_module.compute_chunk_steps, **kw)
    monkeypatch.setattr(engine_module, "compute_chunk_steps", spy)
    return spy


def _prepare(eng: Engine, docs=DOCS, **blend):
    """Misses computed in the prompt and written back (``recompute_misses``), unless ``blend`` says otherwise."""
    return eng.prepare(Request(documents=docs, question=QUESTION, blend=BlendConfig(**{"recompute_misses": True, **blend})))


def test_admission_is_checked_before_a_chunk_is_computed(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine(loaded, store=build_store(StoreConfig(admit_after=3)), prefix_cache=_no_prefix())
    spy = _install(monkeypatch)
    for _ in range(2):
        _prepare(eng, DOCS[:1])
        eng.flush()
    assert spy.calls == 0 and eng.store.stats().entries == 0  # not admitted yet: nothing computed
    _prepare(eng, DOCS[:1])
    eng.flush()
    assert spy.calls == 1 and eng.store.stats().entries == 1
    assert eng.writeback_stats().not_admitted == 2 and eng.writeback_stats().written == 1
    assert [d.source for d in _prepare(eng, DOCS[:1]).stats.docs] == ["memory"]


def test_a_pending_document_is_computed_once(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine(loaded, prefix_cache=_no_prefix())
    gate = threading.Event()
    spy = _install(monkeypatch, gate=gate)
    _prepare(eng)  # three misses; the first computation waits at the gate
    _prepare(eng)  # the same three documents miss again while they are pending
    gate.set()
    eng.flush()
    assert spy.calls == 3 and eng.store.stats().entries == 3
    stats = eng.writeback_stats()
    assert stats.queued == 3 and stats.deduplicated == 3 and stats.written == 3 and stats.pending == 0


def test_failed_write_backs_are_counted_and_logged(loaded, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    eng = Engine(loaded, prefix_cache=_no_prefix())
    _install(monkeypatch, fail=True)
    with caplog.at_level(logging.WARNING, logger="kvblend.store.writeback"):
        _prepare(eng)
        eng.flush()
    assert eng.writeback_stats().failed == 3 and eng.writeback_stats().written == 0
    failures = [r for r in caplog.records if "write-back of default/" in r.getMessage()]
    assert len(failures) == 3 and "out of memory (test)" in failures[0].getMessage()
    monkeypatch.undo()
    _prepare(eng)  # the write-back thread survived
    eng.flush()
    assert eng.store.stats().entries == 3


def test_the_queue_bound_comes_from_the_store_config(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine(loaded, store=build_store(StoreConfig(writeback_queue=1)))
    gate = threading.Event()
    _install(monkeypatch, gate=gate)
    _prepare(eng)  # three misses, room for one pending chunk
    gate.set()
    eng.flush()
    assert eng.writeback.max_queue == 1
    assert eng.writeback_stats().dropped == 2 and eng.store.stats().entries == 1


def test_chunks_computed_in_the_request_and_empty_documents_are_not_hits(loaded) -> None:
    eng = Engine(loaded)
    docs = [DOCS[0], "", DOCS[0], DOCS[1]]
    stats = _prepare(eng, docs, recompute_misses=False).stats
    assert [(d.hit, d.source) for d in stats.docs] == [
        (False, "chunk"), (False, "empty"), (False, "request"), (False, "chunk")]
    eng.flush()
    again = _prepare(eng, docs).stats
    assert [(d.hit, d.source) for d in again.docs] == [
        (True, "memory"), (False, "empty"), (True, "request"), (True, "memory")]


def test_warm_computes_only_what_the_store_admits(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine(loaded, store=build_store(StoreConfig(admit_after=2)))
    spy = _install(monkeypatch)
    prefix = eng.layout(Request(documents=DOCS[:1], question=QUESTION)).prefix[:1]
    eng.warm(DOCS[:1], prefix)
    assert spy.calls == 0 and eng.store.stats().entries == 0
    eng.warm(DOCS[:1], prefix)
    assert spy.calls == 1 and eng.store.stats().entries == 1


def test_misses_computed_alone_are_the_model_owners_slices_and_stored_at_once(loaded,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``recompute_misses`` a missed document is computed alone inside the request's
    step generator, in the scheduler's slices (so streams keep decoding beside it), once, and
    put in the store then: no second computation by the jobs lane."""
    from kvblend.generation.chunked import run_steps

    req = Request(documents=DOCS[:2], question=QUESTION, blend=BlendConfig(recompute_misses=False))
    whole = Engine(loaded).prepare(req)
    spy = _install(monkeypatch)
    eng, sizes = Engine(loaded), []

    def model(ids, cache, logits_for):  # the driver's forward, recording each slice's size
        sizes.append(ids.shape[0])
        return loaded.model(ids, cache, logits_for)

    prepared = run_steps(eng.prepare_steps(req, 0, slice_tokens=3), model)
    assert spy.calls == 2 and sizes and max(sizes) <= 3  # both documents, in slices of 3 tokens
    assert torch.allclose(prepared.logits, whole.logits, atol=1e-4)
    eng.flush()
    assert eng.store.stats().entries == 2 and spy.calls == 2
    assert [d.source for d in _prepare(eng, DOCS[:2]).stats.docs] == ["memory", "memory"]
