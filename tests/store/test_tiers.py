"""The ChunkStore contract, checked on every tier (memory, disk, a real Redis)."""

from __future__ import annotations

import random
import threading
from typing import Callable

import pytest
import torch

from kvblend.store.keys import ChunkKey
from kvblend.store.tier import Tier

from tests.store.helpers import assert_same_chunk, entry_bytes, keyed

TOL = {"fp32": 0.0, "fp16": 5e-3, "bf16": 3e-2, "int8": 3e-2}


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "int8"])
def test_round_trip_whole_and_per_layer(make_tier: Callable[..., Tier], kv_dtype: str) -> None:
    tier = make_tier(kv_dtype=kv_dtype)
    key, chunk = keyed(1, kv_dtype=kv_dtype, layers=3)
    assert tier.put(key, chunk) and tier.contains(key)
    got = tier.get(key, chunk.token_ids)
    assert got is not None and got.keys[0].dtype == torch.float32
    assert_same_chunk(got, chunk, atol=TOL[kv_dtype] * 4)
    for layer in range(3):
        k, v = tier.get_layer(key, layer)  # type: ignore[misc]
        assert torch.equal(k, got.keys[layer]) and torch.equal(v, got.values[layer])
    assert tier.get_layer(key, 3) is None and tier.get_layer(key, -1) is None


def test_compute_dtype_conversion(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(kv_dtype="fp16", compute_dtype="bf16")
    key, chunk = keyed(1, kv_dtype="fp16")
    tier.put(key, chunk)
    got = tier.get(key)
    assert got is not None and got.keys[1].dtype == torch.bfloat16
    assert tier.get_layer(key, 0)[0].dtype == torch.bfloat16  # type: ignore[index]


def test_miss_delete_and_stats(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier()
    key, chunk = keyed(1)
    assert tier.get(key) is None and not tier.contains(key)
    tier.put(key, chunk)
    assert tier.get(key) is not None
    s = tier.stats("default")
    assert (s.hits, s.misses, s.puts, s.entries) == (1, 1, 1, 1) and s.bytes > 0
    assert tier.delete(key) and not tier.delete(key)
    assert tier.get(key) is None and tier.stats().entries == 0 and tier.stats().bytes == 0


def test_token_mismatch_is_a_miss_that_keeps_the_entry(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier()
    key, chunk = keyed(1)
    tier.put(key, chunk)
    assert tier.get(key, (1, 2, 3, 4)) is None
    assert tier.get(key, chunk.token_ids) is not None and tier.stats().errors == 0


def test_returned_tensors_belong_to_the_caller(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier()
    key, chunk = keyed(1)
    tier.put(key, chunk)
    chunk.keys[0].fill_(7.0)  # the caller's tensors were copied on put
    first = tier.get(key)
    assert first is not None and not torch.equal(first.keys[0], chunk.keys[0])
    first.values[1].fill_(9.0)
    tier.get_layer(key, 0)[0].fill_(9.0)  # type: ignore[index]
    again = tier.get(key)
    assert again is not None and not (again.values[1] == 9.0).all() and not (again.keys[0] == 9.0).all()


def test_tenants_are_isolated(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier()
    key_a, chunk_a = keyed(1, tenant="alice")
    key_b, chunk_b = keyed(1, tenant="bob")  # same text, other tenant
    assert key_a.digest != key_b.digest
    tier.put(key_a, chunk_a)
    tier.put(key_b, chunk_b)
    assert tier.get(ChunkKey("bob", key_a.digest)) is None  # alice's digest under bob's name
    assert tier.keys("alice") == [key_a] and tier.keys("bob") == [key_b]
    assert tier.stats("alice").entries == 1 and tier.stats("carol").entries == 0
    assert tier.evict("alice", 0) == 1
    assert tier.get(key_b) is not None and tier.keys("alice") == []


def test_caps_hold_under_a_random_workload(make_tier: Callable[..., Tier]) -> None:
    unit = entry_bytes(make_tier, n_tokens=6)
    cap, tenant_cap = 6 * unit, 4 * unit
    tier = make_tier(cap, tenant_bytes=tenant_cap)
    rng = random.Random(7)
    for step in range(80):
        tenant = rng.choice(["alice", "bob"])
        key, chunk = keyed(rng.randrange(20), tenant=tenant, n_tokens=rng.choice([2, 4, 6, 9]))
        op = rng.random()
        if op < 0.6:
            tier.put(key, chunk)
        elif op < 0.9:
            tier.get(key)
        else:
            tier.delete(key)
        total = tier.stats()
        assert total.bytes <= cap, step
        assert max(tier.stats(t).bytes for t in ("alice", "bob")) <= tenant_cap, step
    assert tier.stats().evictions > 0


def test_eviction_is_lru_within_the_tenant(make_tier: Callable[..., Tier]) -> None:
    unit = entry_bytes(make_tier)
    tier = make_tier(3 * unit + unit // 2)
    pairs = [keyed(i) for i in range(4)]
    for key, chunk in pairs[:3]:
        assert tier.put(key, chunk)
    assert tier.get(pairs[0][0]) is not None  # 0 is now more recent than 1
    assert tier.put(*pairs[3])
    assert not tier.contains(pairs[1][0])
    assert all(tier.contains(k) for k, _ in (pairs[0], pairs[2], pairs[3]))


def test_an_entry_larger_than_the_cap_is_refused(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(100)
    key, chunk = keyed(1, n_tokens=32)
    assert not tier.put(key, chunk) and tier.stats().rejected == 1 and tier.stats().entries == 0


def test_one_tenant_cannot_hold_a_full_tier_against_another(make_tier: Callable[..., Tier]) -> None:
    """A tenant that filled the tier alone is over its share once another tenant puts: it
    loses its least recently used entry."""
    unit = entry_bytes(make_tier)
    tier = make_tier(2 * unit + unit // 2)
    bob = [keyed(i, tenant="bob") for i in range(2)]
    for key, chunk in bob:
        assert tier.put(key, chunk)
    assert tier.get(bob[0][0]) is not None  # bob[1] is now the least recently used
    alice = keyed(5, tenant="alice")
    assert tier.put(*alice)
    assert tier.contains(alice[0]) and tier.contains(bob[0][0]) and not tier.contains(bob[1][0])
    assert tier.stats("bob").evictions == 1 and tier.stats("alice").evictions == 0  # counted for the loser
    assert tier.stats().bytes <= 2 * unit + unit // 2


def test_a_tenant_over_its_cap_loses_its_own_entries_first(make_tier: Callable[..., Tier]) -> None:
    unit = entry_bytes(make_tier)
    tier = make_tier(4 * unit + unit // 2, tenant_bytes=2 * unit + unit // 2)
    bob = [keyed(i, tenant="bob") for i in range(2)]
    alice = [keyed(10 + i, tenant="alice") for i in range(3)]
    for key, chunk in bob + alice:  # bob's entries are the globally oldest
        assert tier.put(key, chunk)
    assert all(tier.contains(k) for k, _ in bob)
    assert [tier.contains(k) for k, _ in alice] == [False, True, True]
    assert tier.stats("alice").bytes <= 2 * unit + unit // 2


def test_concurrent_readers_and_writers_never_see_torn_entries(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier()
    key, base = keyed(1, layers=3, heads=2, head_dim=16, n_tokens=16)
    versions = [type(base)(base.token_ids, base.base_position, tuple(torch.full_like(k, float(v)) for k in base.keys),
                           tuple(torch.full_like(x, float(v)) for x in base.values)) for v in range(1, 5)]
    tier.put(key, versions[0])
    errors: list[str] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(15):
            tier.put(key, rng.choice(versions))

    def reader() -> None:
        for _ in range(30):
            got = tier.get(key, base.token_ids)
            if got is None:
                continue
            if torch.cat([t.reshape(-1) for t in (*got.keys, *got.values)]).unique().numel() != 1:
                errors.append("torn read: values of two versions in one chunk")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and tier.stats().errors == 0
