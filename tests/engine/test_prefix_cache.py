"""The prefix cache: a radix tree of exact prefixes, scoped by tenant, model and dtype."""

from __future__ import annotations

import random

import torch

from kvblend.engine import Engine, PrefixCache, PrefixScope, Request
from kvblend.models.kv_cache import KVCache
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS

A = PrefixScope("acme", "model-1", "torch.float32")


def cache_of(ids: list[int], layers: int = 2) -> KVCache:
    """A cache whose K at position p is ids[p] * 1000 + p and V its negative: lookups can be
    checked exactly, and a prefix's KV does not depend on what follows it (as in a model)."""
    cache = KVCache(layers, 2, 4, len(ids), torch.float32, "cpu")
    code = torch.tensor([t * 1000 + p for p, t in enumerate(ids)], dtype=torch.float32)
    for layer in range(layers):
        cache.keys[layer][:] = (code + layer)[None, :, None]
        cache.values[layer][:] = -(code + layer)[None, :, None]
    cache.length = len(ids)
    return cache


def put(pc: PrefixCache, ids: list[int], scope: PrefixScope = A) -> None:
    pc.insert(scope, torch.tensor(ids), cache_of(ids), len(ids))


def check_hit(pc: PrefixCache, ids: list[int], expect: int, max_len: int | None = None, scope=A) -> None:
    hit = pc.lookup(scope, torch.tensor(ids), max_len)
    if expect == 0:
        assert hit is None
        return
    assert hit is not None and hit.length == expect
    ref = cache_of(ids[:expect])
    for layer in range(2):
        assert torch.equal(hit.keys[layer], ref.keys[layer]) and torch.equal(hit.values[layer], ref.values[layer])


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_longest_prefix_across_split_edges_is_exact() -> None:
    pc = PrefixCache()
    put(pc, [1, 2, 3, 4, 5, 6])
    put(pc, [1, 2, 3, 9, 9])  # splits the first edge after 3 tokens
    put(pc, [1, 2])  # already inside an edge: nothing new
    check_hit(pc, [1, 2, 3, 4, 5, 6, 7], 6)
    check_hit(pc, [1, 2, 3, 9, 8], 4)
    check_hit(pc, [1, 2, 3, 4, 5, 6, 7], 5, max_len=5)
    check_hit(pc, [1, 2, 7], 2)
    check_hit(pc, [2, 2, 3], 0)
    assert pc.stats()["tokens"] == 8  # 1 2 3 | 4 5 6 | 9 9: shared tokens are stored once


def test_random_inserts_match_a_brute_force_reference() -> None:
    rng, pc, seen = random.Random(0), PrefixCache(), []
    for _ in range(200):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else []
        ids = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
        query = (rng.choice(seen) if seen else ids)[:] + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        best = max((common(s, query) for s in seen), default=0)
        limit = rng.choice([None, rng.randint(0, len(query))])
        check_hit(pc, query, best if limit is None else min(best, limit), max_len=limit)
        put(pc, ids)
        seen.append(ids)


def test_least_recently_used_leaves_go_first_under_the_caps() -> None:
    pc = PrefixCache(max_tokens=12)
    put(pc, [1, 2, 3, 4])
    put(pc, [5, 6, 7, 8])
    put(pc, [9, 10, 11, 12])
    check_hit(pc, [1, 2, 3, 4], 4)  # [5..8] is now the least recently used
    put(pc, [13, 14])
    check_hit(pc, [5, 6, 7, 8], 0)
    check_hit(pc, [1, 2, 3, 4], 4)
    check_hit(pc, [9, 10, 11, 12], 4)
    assert pc.stats()["tokens"] <= 12
    one = cache_of([1]).keys[0].numel() * 4 * 2 * 2  # bytes of one position (K and V, two layers)
    small = PrefixCache(max_bytes=3 * one)
    put(small, [1, 2, 3, 4])  # larger than the whole cap: refused
    check_hit(small, [1, 2, 3, 4], 0)
    put(small, [1, 2, 3])
    put(small, [1, 2, 5])  # splits, then evicts the older leaf [3]
    check_hit(small, [1, 2, 5], 3)
    check_hit(small, [1, 2, 3], 2)
    assert small.stats()["bytes"] <= 3 * one


def test_scopes_never_see_each_other() -> None:
    pc = PrefixCache()
    put(pc, [1, 2, 3, 4])
    for other in (A._replace(tenant="globex"), A._replace(model="model-2"), A._replace(dtype="torch.bfloat16")):
        check_hit(pc, [1, 2, 3, 4], 0, scope=other)
    check_hit(pc, [1, 2, 3, 4], 4)


def _prefix_request(tenant: str, question: str) -> Request:
    return Request(documents=DOCS, question=question, system="answer the question .", method="prefix",
                   tenant=tenant)


def test_a_tenant_never_hits_or_learns_another_tenants_prefix() -> None:
    eng = Engine(make_loaded())
    eng.prepare(_prefix_request("acme", "which city is blue ?"))  # caches acme's whole prompt
    probe = eng.prepare(_prefix_request("globex", "where is the river ?")).stats
    assert probe.prefix_hit_tokens == 0  # not even the shared chat-template tokens: nothing of acme's
    again = eng.prepare(_prefix_request("acme", "where is the river ?")).stats
    assert again.prefix_hit_tokens > sum(len(d.split()) for d in DOCS)
    blend = eng.prepare(Request(documents=DOCS, question="who ?", system="answer the question .", tenant="initech"))
    assert blend.stats.prefix_hit_tokens == 0


def test_engines_of_different_dtypes_sharing_one_cache_do_not_mix() -> None:
    shared = PrefixCache()
    loaded = make_loaded()
    Engine(loaded, prefix_cache=shared).prepare(_prefix_request("acme", "which city is blue ?"))
    other = make_loaded()
    other.model.to(torch.float64)
    stats = Engine(other, prefix_cache=shared).prepare(_prefix_request("acme", "where is the river ?")).stats
    assert stats.prefix_hit_tokens == 0


def test_threads_inserting_looking_up_and_evicting_always_read_exact_kv() -> None:
    import threading

    pc, errors = PrefixCache(max_tokens=60), []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                ids = [rng.randint(0, 2) for _ in range(rng.randint(1, 12))]
                if rng.random() < 0.5:
                    put(pc, ids)
                else:
                    hit = pc.lookup(A, torch.tensor(ids))
                    if hit is not None:  # whatever it matched must be exactly those positions
                        ref = cache_of(ids[: hit.length])
                        for layer in range(2):
                            assert torch.equal(hit.keys[layer], ref.keys[layer])
                            assert torch.equal(hit.values[layer], ref.values[layer])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pc.stats()["tokens"] <= 60


def whole_hit(pc: PrefixCache, ids: list[int], max_len: int | None = None):
    hit = pc.lookup(A, torch.tensor(ids), max_len, whole_entries=True)
    return None if hit is None else (hit.length, hit.entry)


def test_whole_entries_are_found_only_where_an_insert_ended() -> None:
    """KV valid only as a whole sequence (a blend's) is served only to a query that holds
    the whole sequence: never a part of it, wherever the tree's edges happen to be cut."""
    pc = PrefixCache()
    pc.insert(A, torch.tensor([1, 2, 3, 4, 5, 6]), cache_of([1, 2, 3, 4, 5, 6]), 6, entry="long")
    assert whole_hit(pc, [1, 2, 3, 4, 9]) is None  # passes no whole entry
    assert pc.lookup(A, torch.tensor([1, 2, 3, 4, 9])).length == 4  # a plain lookup still would
    pc.insert(A, torch.tensor([1, 2, 3, 4, 5, 6]), cache_of([1, 2, 3, 4, 5, 6]), 3, entry="short")  # inside an edge
    assert whole_hit(pc, [1, 2, 3, 4, 9]) == (3, "short")
    assert whole_hit(pc, [1, 2, 3, 4, 5, 6, 7]) == (6, "long")
    assert whole_hit(pc, [1, 2, 3, 4, 5, 6, 7], max_len=5) == (3, "short")  # the cap cuts the long one off
    put(pc, [1, 2, 8])  # a plain insert splits the edge again: the entries keep their ends
    assert whole_hit(pc, [1, 2, 9]) is None
    assert whole_hit(pc, [1, 2, 3, 7]) == (3, "short")
    hit = pc.lookup(A, torch.tensor([1, 2, 3, 4, 5, 6, 0]), whole_entries=True)
    ref = cache_of([1, 2, 3, 4, 5, 6])
    assert all(torch.equal(hit.keys[layer], ref.keys[layer]) for layer in range(2))


def test_an_evicted_entry_is_no_longer_found_and_its_shorter_one_is() -> None:
    pc = PrefixCache(max_tokens=6)
    pc.insert(A, torch.tensor([1, 2, 3, 4, 5, 6]), cache_of([1, 2, 3, 4, 5, 6]), 6, entry="long")
    pc.insert(A, torch.tensor([1, 2, 3, 4, 5, 6]), cache_of([1, 2, 3, 4, 5, 6]), 2, entry="short")
    put(pc, [7, 8])  # over the cap: the least recently used leaf ([3..6]) goes
    assert whole_hit(pc, [1, 2, 3, 4, 5, 6, 0]) == (2, "short")


def test_dropping_a_scope_frees_its_bytes_and_leaves_eviction_sound() -> None:
    other = PrefixScope("acme", "model-1", "torch.float32|blend:x")
    pc = PrefixCache(max_tokens=12)
    put(pc, [1, 2, 3, 4])
    put(pc, [1, 2, 5, 6], scope=other)
    put(pc, [1, 2, 7], scope=other)
    before = pc.stats()
    assert pc.drop_scopes(lambda s: s == other) == 5  # [1, 2] + [5, 6] + [7]
    assert pc.stats()["tokens"] == before["tokens"] - 5 and pc.stats()["scopes"] == 1
    assert pc.lookup(other, torch.tensor([1, 2, 5])) is None
    for i in range(10):  # eviction over the dropped nodes' stale heap entries never double-counts
        put(pc, [9, i, i + 1])
    assert 0 <= pc.stats()["tokens"] <= 12 and pc.stats()["bytes"] >= 0
    check_hit(pc, [9, 9, 10], 3)
