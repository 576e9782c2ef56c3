"""Fair shares of a capped tier, on every tier (memory, disk, a real Redis) and composed.

The guarantee: with default settings, a tenant holding no more than its fair share of a
tier (cap / number of tenants holding entries there, the putting tenant included) never
loses an entry to another tenant's put; a lone tenant can use the whole tier.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from kvblend.store import StoreConfig, build_store
from kvblend.store.tier import Tier

from tests.store.helpers import entry_bytes, keyed

DOCS = range(10, 99)  # indexes whose entries all have the same size (4-digit token ids)


def unit_of(make_tier: Callable[..., Tier]) -> int:
    """Bytes one test entry takes in this tier."""
    return entry_bytes(make_tier, DOCS[-1])


def fill(tier: Tier, tenant: str, docs: range) -> list:
    """Put one entry per index of ``docs`` for ``tenant``; their keys."""
    pairs = [keyed(i, tenant=tenant) for i in docs]
    for key, chunk in pairs:
        assert tier.put(key, chunk)
    return [key for key, _ in pairs]


def held(tier: Tier, keys: list) -> list[bool]:
    return [tier.contains(k) for k in keys]


def test_fourteen_documents_of_one_tenant_do_not_evict_another(make_tier: Callable[..., Tier]) -> None:
    """The reported incident: one tenant's 14 documents pushed every chunk of another out."""
    unit = unit_of(make_tier)
    tier = make_tier(8 * unit + unit // 2)
    bob = fill(tier, "bob", range(10, 13))  # 3 entries: under half the tier
    fill(tier, "alice", range(20, 34))
    assert held(tier, bob) == [True] * 3
    assert tier.stats("bob").evictions == 0 and tier.stats("alice").evictions == 14 - 5
    assert tier.stats().bytes <= 8 * unit + unit // 2


def test_a_lone_tenant_can_use_the_whole_tier(make_tier: Callable[..., Tier]) -> None:
    unit = unit_of(make_tier)
    tier = make_tier(8 * unit + unit // 2)
    keys = fill(tier, "alice", range(10, 22))
    assert held(tier, keys) == [False] * 4 + [True] * 8


def test_a_tenant_over_its_share_is_evicted_down_to_it_lru_first(make_tier: Callable[..., Tier]) -> None:
    """A newcomer takes the tier's holder's least recently used entries until both hold a
    half; past its half, the newcomer evicts its own."""
    unit = unit_of(make_tier)
    tier = make_tier(8 * unit + unit // 2)
    alice = fill(tier, "alice", range(10, 18))
    assert tier.get(alice[0]) is not None  # alice[1] is now her least recently used
    bob = fill(tier, "bob", range(30, 36))
    assert held(tier, alice) == [True, False, False, False, False, True, True, True]
    assert held(tier, bob) == [False, False, True, True, True, True]
    assert tier.stats("alice").evictions == 4 and tier.stats("bob").evictions == 2


def test_the_tenant_most_over_its_share_pays(make_tier: Callable[..., Tier]) -> None:
    """A third tenant's puts evict the biggest holder, not the globally oldest entries."""
    unit = unit_of(make_tier)
    tier = make_tier(9 * unit + unit // 2)
    bob = fill(tier, "bob", range(10, 13))  # the oldest entries, but within a third of the tier
    alice = fill(tier, "alice", range(20, 26))
    carol = fill(tier, "carol", range(40, 42))
    assert held(tier, bob) == [True] * 3 and held(tier, carol) == [True] * 2
    assert held(tier, alice) == [False, False, True, True, True, True]


def test_an_entry_larger_than_a_share_cannot_evict_a_tenant_within_its_share(
        make_tier: Callable[..., Tier]) -> None:
    unit = unit_of(make_tier)
    big = entry_bytes(make_tier, DOCS[-1], n_tokens=64)
    assert big >= 3 * unit  # so bob's two entries stay within half of the tier
    tier = make_tier(big + unit)  # alone, the big entry would fit
    bob = fill(tier, "bob", range(10, 12))
    key, chunk = keyed(50, tenant="alice", n_tokens=64)
    assert not tier.put(key, chunk) and tier.stats("alice").rejected == 1
    assert held(tier, bob) == [True, True] and tier.stats("bob").evictions == 0


def test_tenant_bytes_still_caps_a_lone_tenant(make_tier: Callable[..., Tier]) -> None:
    unit = unit_of(make_tier)
    tier = make_tier(8 * unit + unit // 2, tenant_bytes=2 * unit + unit // 2)
    keys = fill(tier, "alice", range(10, 15))
    assert held(tier, keys) == [False, False, False, True, True]


def test_no_put_evicts_a_tenant_within_its_share(make_tier: Callable[..., Tier]) -> None:
    """Random puts, reads and deletes of four tenants: after every put by one tenant, every
    other tenant that held at most its share before it still holds all its entries."""
    unit = unit_of(make_tier)
    cap = 7 * unit + unit // 3
    tier = make_tier(cap)
    tenants = ["alice", "bob", "carol", "dave"]
    rng = random.Random(11)
    for step in range(120):
        tenant = rng.choice(tenants[:1] * 3 + tenants)  # alice floods
        key, chunk = keyed(rng.choice(DOCS[:30]), tenant=tenant)
        op = rng.random()
        if op < 0.2:
            tier.get(key) if op < 0.15 else tier.delete(key)
            continue
        before = {t: set(tier.keys(t)) for t in tenants}
        sizes = {t: tier.stats(t).bytes for t in tenants}
        holders = sum(1 for t in tenants if sizes[t] > 0 or t == tenant)
        tier.put(key, chunk)
        for other in tenants:
            if other != tenant and sizes[other] * holders <= cap:
                assert set(tier.keys(other)) == before[other], (step, other)
        assert tier.stats().bytes <= cap
    assert tier.stats("alice").evictions > 0


def test_a_tiered_store_with_default_settings_shares_memory_and_disk(tmp_path: Path) -> None:
    """Built as a server builds it: 14 documents of one tenant leave another's chunks in
    both tiers."""
    probe = build_store(StoreConfig(tiers=("memory", "disk"), disk_dir=str(tmp_path / "probe"), disk_fsync=False))
    key, chunk = keyed(DOCS[-1], tenant="bob")
    probe.put(key, chunk)
    units = {t.name: t.stats().bytes for t in probe.tiers}
    probe.close()
    config = StoreConfig(tiers=("memory", "disk"), memory_bytes=8 * units["memory"] + units["memory"] // 2,
                         disk_dir=str(tmp_path / "disk"), disk_bytes=8 * units["disk"] + units["disk"] // 2,
                         disk_fsync=False)
    store = build_store(config)
    bob = fill(store, "bob", range(10, 13))  # type: ignore[arg-type]
    fill(store, "alice", range(20, 34))  # type: ignore[arg-type]
    for tier in store.tiers:
        assert held(tier, bob) == [True] * 3, tier.name
        assert tier.stats("alice").entries == 5, tier.name
    store.close()
