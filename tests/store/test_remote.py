"""Redis tier against a real redis-server: sharing, TTL, corruption, outages, slowness."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import redis

from kvblend.store import RedisStore
from kvblend.store.localredis import LocalRedis

from tests.store.helpers import assert_same_chunk, hammer_in_processes, keyed



def test_two_machines_share_one_cache(make_redis: Callable[..., RedisStore]) -> None:
    a, b = make_redis(), make_redis()
    key, chunk = keyed(1)
    assert a.put(key, chunk)
    assert b.contains(key)
    assert_same_chunk(b.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
    assert b.delete(key) and not a.contains(key)


def test_each_layer_is_its_own_field(make_redis: Callable[..., RedisStore], redis_server: LocalRedis,
                                     redis_prefix: str) -> None:
    store = make_redis(kv_dtype="int8")
    key, chunk = keyed(1, layers=3)
    store.put(key, chunk)
    client = redis.Redis.from_url(redis_server.url)
    fields = {f.decode() for f in client.hkeys(f"{redis_prefix}:default:e:{key.digest}")}
    assert {"k.2", "v.2", "k.2.scale", "v.2.scale", "header", "header_xxh3", "format"} <= fields
    client.close()


def test_ttl_expires_entries_and_their_accounting(make_redis: Callable[..., RedisStore]) -> None:
    store = make_redis(ttl_s=0.2)
    key, chunk = keyed(1)
    store.put(key, chunk)
    assert store.get(key) is not None
    time.sleep(0.4)
    assert store.get(key) is None and not store.contains(key)
    assert store.keys("default") == [] and store.stats("default").entries == 0


def test_expired_entries_make_room_for_new_ones(make_redis: Callable[..., RedisStore]) -> None:
    probe = make_redis()
    key, chunk = keyed(0)
    probe.put(key, chunk)
    unit = probe.stats("default").bytes
    probe.delete(key)
    store = make_redis(2 * unit + unit // 2, ttl_s=0.2)
    store.put(*keyed(1, tenant="bob"))
    store.put(*keyed(2, tenant="bob"))
    time.sleep(0.4)
    assert store.put(*keyed(3))
    assert store.stats().evictions == 0  # bob's expired entries were swept, not evicted
    assert store.stats().entries == 1 and store.keys("bob") == []


def _calls(client: redis.Redis, *commands: str) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands)


def test_a_put_touches_only_the_entries_it_evicts(make_redis: Callable[..., RedisStore],
                                                  redis_server: LocalRedis) -> None:
    """A put into a full tier runs O(evicted) commands, not a sweep over every entry."""
    probe = make_redis()
    key, chunk = keyed(0)
    probe.put(key, chunk)
    unit = probe.stats("default").bytes
    probe.delete(key)
    store = make_redis(60 * unit, ttl_s=3600)
    for i in range(60):
        assert store.put(*keyed(i, tenant=f"t{i % 6}"))
    client = redis.Redis.from_url(redis_server.url)
    before = _calls(client, "exists", "zrange", "smembers")
    assert store.put(*keyed(99, tenant="newcomer"))
    assert _calls(client, "exists", "zrange", "smembers") - before < 10
    assert 1 <= store.stats().evictions <= 2  # entry sizes differ by a few header bytes
    client.close()


def test_corrupt_field_is_a_miss_and_is_removed(make_redis: Callable[..., RedisStore], redis_server: LocalRedis,
                                               redis_prefix: str) -> None:
    store = make_redis()
    client = redis.Redis.from_url(redis_server.url)
    name = f"{redis_prefix}:default:e:{keyed(1)[0].digest}"
    for field, value in (("v.1", "flip"), ("k.0.short", b"\0" * 8), ("k.0", None), ("header", b"{not json")):
        key, chunk = keyed(1)
        store.put(key, chunk)
        if value is None:
            client.hdel(name, field)
        elif value == "flip":  # same length, one bit off: only the checksum can tell
            data = bytearray(client.hget(name, field))
            data[5] ^= 0x10
            client.hset(name, field, bytes(data))
        else:
            client.hset(name, field.removesuffix(".short"), value)
        assert store.get(key, chunk.token_ids) is None, field
        assert not client.exists(name) and store.stats("default").entries == 0
    assert store.stats().errors == 4
    client.close()


def test_redis_stopped_mid_run_gives_misses_and_warnings_never_errors(tmp_path: Path) -> None:
    server = LocalRedis().start()
    try:
        store = RedisStore(server.url, 1 << 30, timeout_s=0.3, retry_s=0.0)
        key, chunk = keyed(1)
        assert store.put(key, chunk)
        server.stop()
        started = time.monotonic()
        assert store.get(key) is None and store.get_layer(key, 0) is None
        assert store.put(*keyed(2)) is False and store.delete(key) is False and not store.contains(key)
        assert store.keys("default") == [] and store.evict("default") == 0
        assert store.stats().warnings >= 7
        assert time.monotonic() - started < 5.0  # each call gave up quickly
        server.start()  # comes back empty (no persistence)
        assert store.put(key, chunk) and store.get(key) is not None
    finally:
        server.close()


def test_back_off_skips_a_down_server_without_waiting(tmp_path: Path) -> None:
    server = LocalRedis().start()
    try:
        store = RedisStore(server.url, 1 << 30, timeout_s=0.3, retry_s=30.0)
        server.stop()
        store.get(keyed(1)[0])
        started = time.monotonic()
        for i in range(20):
            assert store.get(keyed(i)[0]) is None
        assert time.monotonic() - started < 0.5
        assert store.stats().warnings == 22  # 21 lookups, and this stats call could not read occupancy
    finally:
        server.close()


def test_a_slow_server_times_out_into_a_miss(redis_server: LocalRedis, make_redis: Callable[..., RedisStore]) -> None:
    store = make_redis(timeout_s=0.2, retry_s=0.0)
    key, chunk = keyed(1)
    store.put(key, chunk)
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    try:
        started = time.monotonic()
        assert store.get(key) is None
        assert time.monotonic() - started < 1.0 and store.counters.stats(None, 0, 0).warnings == 1
    finally:
        time.sleep(1.6)
        admin.close()
    assert store.get(key) is not None


def test_many_threads_put_under_one_cap(make_redis: Callable[..., RedisStore], redis_server: LocalRedis,
                                       redis_prefix: str) -> None:
    probe = make_redis()
    key, chunk = keyed(0)
    probe.put(key, chunk)
    unit = probe.stats("default").bytes
    probe.delete(key)
    cap = 5 * unit
    stores = [make_redis(cap) for _ in range(4)]

    def writer(n: int) -> None:
        for i in range(10):
            stores[n].put(*keyed(10 * n + i))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = stores[0].stats()
    assert stats.bytes <= cap and stats.evictions + sum(s.stats().evictions for s in stores[1:]) >= 30
    client = redis.Redis.from_url(redis_server.url)  # the accounting matches what the server holds
    names = client.keys(f"{redis_prefix}:default:e:*")
    held = sum(client.hstrlen(n, f) for n in names for f in client.hkeys(n))
    client.close()
    assert len(names) == stats.entries == len(stores[0].keys("default")) and held == stats.bytes


def test_concurrent_processes_never_see_torn_entries(redis_server: LocalRedis, redis_prefix: str) -> None:
    results = hammer_in_processes(f"RedisStore({redis_server.url!r}, 1 << 30, prefix={redis_prefix!r}, timeout_s=5.0)", read_layers=True)
    assert all(torn == 0 and errors == 0 for torn, _, errors in results), results
    assert sum(hits for _, hits, _ in results) > 0


def test_per_tenant_usage_matches_what_the_server_holds(make_redis: Callable[..., RedisStore],
                                                        redis_server: LocalRedis, redis_prefix: str) -> None:
    """The byte counts the Lua scripts keep for fair shares stay exact under puts that
    evict, replacements, deletes and evictions by several tenants."""
    cap = 8000  # about seven entries
    store = make_redis(cap)
    rng = random.Random(3)
    tenants = ("alice", "bob", "carol")
    for _ in range(150):
        key, chunk = keyed(rng.randrange(15), tenant=rng.choice(tenants), n_tokens=rng.choice([2, 4]))
        op = rng.random()
        if op < 0.8:
            store.put(key, chunk)
        elif op < 0.95:
            store.delete(key)
        else:
            store.evict(key.tenant, 1500)
    client = redis.Redis.from_url(redis_server.url)
    held = {}
    for tenant in tenants:
        names = client.keys(f"{redis_prefix}:{tenant}:e:*")
        held[tenant] = sum(client.hstrlen(n, f) for n in names for f in client.hkeys(n))
        assert store.stats(tenant).bytes == held[tenant] and store.stats(tenant).entries == len(names)
    usage = {t.decode(): int(b) for t, b in client.zrange(f"{redis_prefix}:usage", 0, -1, withscores=True)}
    client.close()
    assert usage == {t: b for t, b in held.items() if b > 0}
    assert store.stats().bytes == sum(held.values()) <= cap and store.stats().evictions > 0


def test_entries_of_the_older_layout_are_reported(make_redis: Callable[..., RedisStore], redis_server: LocalRedis,
                                                  redis_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """The per-tenant usage accounting cannot see entries an older version counted in a global
    LRU: a tier opened on such a prefix says so instead of refusing puts unexplained."""
    make_redis()
    assert not [r for r in caplog.records if "older kvblend" in r.getMessage()]
    redis.Redis.from_url(redis_server.url).zadd(f"{redis_prefix}:lru", {"old-entry": 1.0})
    make_redis()
    assert [r for r in caplog.records if "older kvblend" in r.getMessage() and r.levelname == "WARNING"]


def test_a_full_server_refuses_puts_and_still_serves_reads() -> None:
    """With Redis' ``maxmemory`` reached (noeviction): a put is refused (one warning; before,
    the script's first write, a delete, let the entry through past the limit), a read's
    recency update is refused too but the entry still hits, and the node is not backed
    off (before, that refusal failed the read and skipped the tier for retry_s)."""
    with LocalRedis() as server:
        store = RedisStore(server.url, 1 << 30, timeout_s=2.0, retry_s=30.0)
        key, chunk = keyed(1)
        assert store.put(key, chunk)
        admin = redis.Redis.from_url(server.url)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] // 2)  # already over it
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.zadd(f"{store.prefix}:default:lru", {key.digest: 1.0}, xx=True)
        assert store.put(*keyed(2)) is False and store.stats().warnings == 1
        for _ in range(2):
            assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
            assert store.get_layer(key, 1) is not None and store.contains(key)
        assert store.stats().warnings == 1 and store.stats().entries == 1
        admin.close()
