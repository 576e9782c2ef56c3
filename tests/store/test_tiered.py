"""Tiered store: lookup order, promotion, admission, config and the factory."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from kvblend.store import DiskStore, MemoryStore, RedisStore, StoreConfig, TieredStore, build_store
from kvblend.store.localredis import LocalRedis

from tests.store.helpers import assert_same_chunk, keyed


def three_tiers(tmp_path: Path, make_redis: Callable[..., RedisStore], **kw: object) -> TieredStore:
    return TieredStore([MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False), make_redis()], **kw)  # type: ignore[arg-type]


def test_hits_are_served_by_the_fastest_tier_and_promoted(tmp_path: Path,
                                                          make_redis: Callable[..., RedisStore]) -> None:
    store = three_tiers(tmp_path, make_redis)
    memory, disk, remote = store.tiers
    key, chunk = keyed(1)
    assert store.put(key, chunk)
    assert all(t.contains(key) for t in store.tiers)  # written through
    memory.delete(key)
    disk.delete(key)
    found = store.lookup(key, chunk.token_ids)
    assert found.tier == "redis" and found.chunk is not None
    assert_same_chunk(found.chunk, chunk)
    assert memory.contains(key) and disk.contains(key)  # promoted on the hit
    assert store.lookup(key).tier == "memory"
    assert store.lookup(keyed(2)[0]) == (None, None)
    s = store.stats()
    assert (s.hits, s.misses, s.puts) == (2, 1, 1)


def test_promoted_tensors_are_not_shared_with_the_caller(tmp_path: Path) -> None:
    store = TieredStore([MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False)])
    key, chunk = keyed(1)
    store.put(key, chunk)
    store.tiers[0].delete(key)
    first = store.get(key)  # from disk, promoted into memory
    assert first is not None
    first.keys[0].fill_(123.0)
    second = store.get(key)  # from memory
    assert second is not None and torch.equal(second.keys[0], chunk.keys[0])


def test_borrowing_lends_the_memory_tiers_tensors_and_get_still_copies() -> None:
    store = TieredStore([MemoryStore(1 << 30)])
    key, chunk = keyed(1)
    store.put(key, chunk)
    lent = store.lookup(key, borrow=True).chunk
    again = store.lookup(key, borrow=True).chunk
    copied = store.get(key)
    assert lent is not None and again is not None and copied is not None
    assert lent.keys[0].data_ptr() == again.keys[0].data_ptr()  # the tier's own tensors, no copy
    assert copied.keys[0].data_ptr() != lent.keys[0].data_ptr()
    assert_same_chunk(lent, chunk)


def test_corrupt_lower_copy_is_skipped_and_removed(tmp_path: Path) -> None:
    store = TieredStore([MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False)])
    key, chunk = keyed(1)
    store.put(key, chunk)
    disk = store.tiers[1]
    assert isinstance(disk, DiskStore)
    store.tiers[0].delete(key)
    path = disk.path(key)
    path.write_bytes(path.read_bytes()[:-4])
    assert store.get(key) is None and not path.exists() and store.stats().errors == 1


def test_get_layer_falls_through_without_promotion(tmp_path: Path) -> None:
    store = TieredStore([MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False)])
    key, chunk = keyed(1)
    store.put(key, chunk)
    store.tiers[0].delete(key)
    k, v = store.get_layer(key, 1)  # type: ignore[misc]
    assert torch.equal(k, chunk.keys[1]) and torch.equal(v, chunk.values[1])
    assert not store.tiers[0].contains(key) and store.get_layer(keyed(2)[0], 0) is None


def test_admission_after_n_sightings(tmp_path: Path) -> None:
    store = build_store(StoreConfig(memory_bytes=1 << 20, admit_after=3))
    key, chunk = keyed(1)
    assert [store.put(key, chunk) for _ in range(3)] == [False, False, True]
    assert store.get(key) is not None and store.stats().rejected == 2


def test_build_store_picks_tiers_by_name(tmp_path: Path, redis_server: LocalRedis, redis_prefix: str) -> None:
    config = StoreConfig(memory_bytes=1 << 20, disk_dir=str(tmp_path), redis_url=redis_server.url,
                         redis_prefix=redis_prefix, kv_dtype="fp16", compute_dtype="fp32", eviction="lfu")
    store = build_store(config)
    assert [t.name for t in store.tiers] == ["memory", "disk", "redis"]
    assert all(t.kv_dtype == "fp16" for t in store.tiers)
    key, chunk = keyed(1, kv_dtype="fp16")
    store.put(key, chunk)
    got = store.get(key)
    assert got is not None and got.keys[0].dtype == torch.float32
    assert_same_chunk(got, chunk, atol=5e-3)
    reordered = build_store(StoreConfig(tiers=("disk", "memory"), disk_dir=str(tmp_path)))
    assert [t.name for t in reordered.tiers] == ["disk", "memory"]
    assert [t.name for t in build_store(StoreConfig()).tiers] == ["memory"]
    store.close()


@pytest.mark.parametrize(
    "kwargs",
    [{"tiers": ("memory", "tape")}, {"tiers": ("memory", "memory")}, {"memory_bytes": -1}, {"kv_dtype": "fp8"},
     {"compute_dtype": "int8"}, {"eviction": "random"}, {"admit_after": 0}, {"writeback_queue": 0},
     {"redis_timeout_s": 0}, {"redis_ttl_s": -1.0}, {"memory_bytes": 0}, {"redis_prefix": "a:b"},
     {"tenant_bytes": -5}],
)
def test_invalid_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StoreConfig(**kwargs)


def test_config_is_frozen() -> None:
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        StoreConfig().memory_bytes = 5  # type: ignore[misc]


def test_tenant_scoped_listing_and_clear(tmp_path: Path, make_redis: Callable[..., RedisStore]) -> None:
    store = three_tiers(tmp_path, make_redis)
    for i in range(3):
        store.put(*keyed(i, tenant="alice"))
    store.put(*keyed(9, tenant="bob"))
    assert len(store.keys("alice")) == 3 and len(store.keys("bob")) == 1
    assert {name: len(infos) for name, infos in store.entries("bob").items()} == {"memory": 1, "disk": 1, "redis": 1}
    assert store.clear("alice") == 3 and store.keys("alice") == []
    assert store.get(keyed(9, tenant="bob")[0]) is not None
    assert store.stats("alice").entries == 0 and store.stats("bob").entries == 3  # one copy per tier


def test_a_hit_no_faster_tier_kept_is_handed_out_without_a_copy(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Promotion is judged by whether a faster tier stored the entry, not by there being one."""
    import kvblend.store.tiered as tiered

    seen: list[bool] = []
    real = tiered.decode_entry
    monkeypatch.setattr(tiered, "decode_entry", lambda entry, *a: seen.append(entry.owned) or real(entry, *a))
    store = TieredStore([MemoryStore(10), DiskStore(tmp_path, 1 << 30, fsync=False)])  # memory refuses all
    key, chunk = keyed(1)
    assert store.put(key, chunk)
    got = store.get(key)
    assert got is not None and not store.tiers[0].contains(key)
    assert seen == [True]  # the disk read is private: no defensive copy
    roomy = TieredStore([MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False)])
    assert roomy.get(key) is not None and roomy.tiers[0].contains(key)
    assert seen == [True, False]  # the memory tier keeps these tensors now: readers must copy
