"""Many threads, one engine and one store: every result equals the same request run alone.

Mixed full/prefix/reuse/blend requests from two tenants run on four threads against a
memory tier too small for every document (so chunks are evicted while others read them)
with write-back on. A blended result depends on which documents hit the store, so each
result is compared with the request run alone on a fresh engine whose store holds exactly
the documents the concurrent run found: greedy tokens identical, stats consistent. The last
round comes from tenants with one request each: any prefix hit they get is a leak.
"""

from __future__ import annotations

import threading

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request, Result
from kvblend.generation import SamplingParams
from kvblend.store import StoreConfig, build_store
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS

MORE = DOCS + ["the river of oslo was red . the doctor works in rome with the project ."]
QUESTIONS = ["which city is blue ?", "where is the river ?", "who works in lisbon ?"]
METHODS = [("blend", 0.3), ("full", 0.15), ("reuse", 0.0), ("prefix", 0.15), ("blend", 1.0), ("blend", 0.15)]
SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)
THREADS, PER_THREAD = 4, 3


def requests() -> list[Request]:
    out, n = [], THREADS * PER_THREAD
    for i in range(n):
        method, ratio = METHODS[i % len(METHODS)]
        docs = [MORE[(i + 2 * j) % len(MORE)] for j in range(1 + i % 3)]  # four documents: many repeats
        tenant = ("acme", "globex")[i % 2] if i < n - THREADS else f"solo{i}"
        out.append(Request(documents=docs, question=QUESTIONS[i % len(QUESTIONS)], system="answer the question .",
                           method=method, blend=BlendConfig(ratio=ratio), tenant=tenant))
    return out


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prefix_bound(eng: Engine, reqs: list[Request], i: int) -> int:
    """The longest prefix request ``i`` can share with what other requests of its tenant cached."""
    ids, best = eng.layout(reqs[i]).ids, 0
    for j, other in enumerate(reqs):
        if j != i and other.tenant == reqs[i].tenant and other.method != "full":
            layout = eng.layout(other)
            best = max(best, common(ids, layout.ids if other.method == "prefix" else list(layout.prefix)))
    return best


def one_chunk_bytes(loaded) -> int:
    eng = Engine(loaded)
    eng.prepare(Request(documents=MORE[:1], question="x", method="blend"))
    eng.flush()
    return eng.store.stats().bytes


def alone(loaded, request: Request, concurrent: Result) -> Result:
    """``request`` run by itself, on a fresh engine holding the documents the concurrent run hit."""
    eng = Engine(loaded)
    hits = [d for d, s in zip(request.documents, concurrent.stats.docs) if s.hit and s.source != "request"]
    eng.warm(hits, eng.chunk_prefix(request, eng.layout(request)), request.tenant)
    return eng.generate(request, SAMPLING)


def check_same(request: Request, got: Result, ref: Result) -> None:
    assert got.token_ids == ref.token_ids, request
    g, r = got.stats, ref.stats
    assert g.prompt_tokens == r.prompt_tokens
    assert [(d.tokens, d.hit) for d in g.docs] == [(d.tokens, d.hit) for d in r.docs]
    assert g.candidates == r.candidates
    # recompute covers the positions past the prefix hit: their sum is what the method did
    assert [n + g.prefix_hit_tokens for n in g.recomputed_per_layer] == \
           [n + r.prefix_hit_tokens for n in r.recomputed_per_layer]
    if request.method == "full":
        assert g.prefix_hit_tokens == 0


def test_concurrent_mixed_requests_equal_each_request_run_alone() -> None:
    loaded = make_loaded()
    chunk = one_chunk_bytes(loaded)
    eng = Engine(loaded, store=build_store(StoreConfig(tiers=("memory",), memory_bytes=3 * chunk)))
    reqs = requests()
    for tenant in ("acme", "globex"):  # some documents are stored before the threads start
        eng.warm(MORE[:2], eng.chunk_prefix(reqs[0], eng.layout(reqs[0])), tenant)
    results: dict[int, Result] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        start.wait()
        for i in range(t, len(reqs), THREADS):
            try:
                results[i] = eng.generate(reqs[i], SAMPLING)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    eng.close()
    assert not errors, errors
    assert len(results) == len(reqs)
    stats = eng.store.stats()
    assert stats.bytes <= 3 * chunk and stats.evictions + stats.rejected > 0  # the cap held and bit
    assert stats.puts > 4  # write-back stored chunks besides the warmed ones
    for i, request in enumerate(reqs):
        assert results[i].stats.prefix_hit_tokens <= prefix_bound(eng, reqs, i), request.tenant
        check_same(request, results[i], alone(loaded, request, results[i]))
