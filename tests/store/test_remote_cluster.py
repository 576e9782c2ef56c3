"""Redis tier against a real 3-node Redis Cluster on loopback: routing, per-group caps and
fair shares, TTL, and nodes that die or hang mid-run."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from typing import Callable

import pytest
import redis

from kvblend.store import RedisStore
from kvblend.store.config import StoreConfig, build_store
from kvblend.store.localredis import LocalRedisCluster, free_cluster_port

from tests.store.helpers import assert_same_chunk, keyed


def node_keys(cluster: LocalRedisCluster, prefix: str) -> list[set[str]]:
    """The keys of ``prefix`` each running node holds itself (SCAN is node-local)."""
    held = []
    for node in cluster.nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        held.append({k.decode() for k in client.scan_iter(match=f"{{{prefix}:*", count=1000)})
        client.close()
    return held


def group_bytes(cluster: LocalRedisCluster, store: RedisStore, tenant: str | None = None) -> dict[str, int]:
    """Bytes of the entry hashes each group holds on the servers (what the caps bound)."""
    totals: Counter[str] = Counter()
    for node in cluster.nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        for name in client.scan_iter(match=f"{{{store.prefix}:*:{tenant or '*'}:e:*", count=1000):
            base = name.decode().split("}")[0] + "}"
            totals[base] += sum(client.hstrlen(name, f) for f in client.hkeys(name))
        client.close()
    return dict(totals)


def unit_bytes(make: Callable[..., RedisStore]) -> int:
    probe = make()
    key, chunk = keyed(0)
    probe.put(key, chunk)
    unit = probe.stats().bytes
    probe.delete(key)
    return unit


def test_clients_share_entries_and_layers_on_a_cluster(make_cluster_store: Callable[..., RedisStore]) -> None:
    a, b = make_cluster_store(), make_cluster_store()
    pairs = [keyed(i, layers=3) for i in range(12)]
    for key, chunk in pairs:
        assert a.put(key, chunk)
    for key, chunk in pairs:
        assert b.contains(key)
        assert_same_chunk(b.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
        k2, v2 = b.get_layer(key, 2)  # type: ignore[misc]
        assert k2.equal(chunk.keys[2]) and v2.equal(chunk.values[2])
    assert b.get_layer(pairs[0][0], 3) is None  # past the last layer
    assert a.stats().entries == 12 and b.stats("default").entries == 12 and len(b.keys("default")) == 12
    assert b.delete(pairs[0][0]) and not a.contains(pairs[0][0]) and a.stats().entries == 11
    assert a.stats().warnings == b.stats().warnings == 0


def test_each_chunk_lives_on_one_shard_and_chunks_spread_over_all(
        make_cluster_store: Callable[..., RedisStore], redis_cluster: LocalRedisCluster, redis_prefix: str) -> None:
    store = make_cluster_store()
    keys = [keyed(i, tenant=("alice", "bob")[i % 2]) for i in range(24)]
    for key, chunk in keys:
        assert store.put(key, chunk)
    held = node_keys(redis_cluster, redis_prefix)
    entries_per_node = [sum(":e:" in k for k in keys_) for keys_ in held]
    assert all(n > 0 for n in entries_per_node) and sum(entries_per_node) == 24, entries_per_node
    for key, _ in keys:  # an entry and its group's accounting sit on one node, in one slot
        name = store.entry_name(key)
        base = name.split("}")[0] + "}"
        home = [i for i, keys_ in enumerate(held) if name in keys_]
        assert len(home) == 1 and {f"{base}:usage", f"{base}:bytes", f"{base}:{key.tenant}:lru"} <= held[home[0]]
    tags = {k.split("}")[0] + "}" for keys_ in held for k in keys_}
    assert tags <= set(store.bases)  # no key outside a group's hash tag
    groups_per_node = Counter(redis_cluster.nodes.index(n) for n in _owners(redis_cluster, store.bases))
    assert len(groups_per_node) == 3 and min(groups_per_node.values()) >= 4, groups_per_node  # 16 over 3 ranges


def _owners(cluster: LocalRedisCluster, bases: tuple[str, ...]) -> list:
    from redis.crc import key_slot

    return [next(n for i, n in enumerate(cluster.nodes) if key_slot(b.encode()) in cluster.slot_range(i))
            for b in bases]


def test_caps_hold_per_group(make_cluster_store: Callable[..., RedisStore], redis_cluster: LocalRedisCluster) -> None:
    unit = unit_bytes(make_cluster_store)
    cap = 4 * (3 * unit + unit // 2)  # 4 groups of about three entries
    store = make_cluster_store(cap, groups=4)
    assert store.group_bytes == cap // 4
    for i in range(40):
        store.put(*keyed(i))
    held = group_bytes(redis_cluster, store)
    assert set(held) == set(store.bases) and all(b <= store.group_bytes for b in held.values()), held
    stats = store.stats()
    assert stats.bytes == sum(held.values()) <= cap and stats.evictions == 40 - stats.entries > 0
    assert stats.entries == 12  # three per group: each group filled to its own cap


def test_fair_shares_and_tenant_caps_hold_per_group(make_cluster_store: Callable[..., RedisStore],
                                                    redis_cluster: LocalRedisCluster) -> None:
    unit = unit_bytes(make_cluster_store)
    store = make_cluster_store(4 * (4 * unit + unit // 2), groups=4, tenant_bytes=4 * (3 * unit + unit // 2))
    alice, seen = [], set()
    for i in range(200, 260):  # one alice entry per group: within her share (two entries) everywhere
        key, chunk = keyed(i, tenant="alice")
        if store.group_of(key) not in seen:
            seen.add(store.group_of(key))
            alice.append((key, chunk))
            assert store.put(key, chunk)
    assert len(alice) == 4
    for i in range(60):  # bob floods every group
        store.put(*keyed(i, tenant="bob"))
    for key, chunk in alice:
        assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
    assert store.stats("alice").evictions == 0 and store.stats("bob").evictions > 0
    bob = group_bytes(redis_cluster, store, "bob")
    assert all(b <= store.group_tenant_bytes for b in bob.values()), bob  # type: ignore[operator]
    assert store.stats("bob").bytes <= store.tenant_bytes  # type: ignore[operator]
    assert store.stats().bytes <= store.max_bytes


def test_ttl_expires_entries_on_a_cluster(make_cluster_store: Callable[..., RedisStore]) -> None:
    store = make_cluster_store(ttl_s=0.2)
    pairs = [keyed(i) for i in range(6)]
    for key, chunk in pairs:
        store.put(key, chunk)
    time.sleep(0.4)
    assert all(store.get(key) is None for key, _ in pairs)
    assert store.keys("default") == [] and store.stats("default").entries == 0


def test_build_store_selects_the_cluster_client(redis_cluster: LocalRedisCluster, redis_prefix: str) -> None:
    config = StoreConfig(tiers=("redis",), redis_url=redis_cluster.url, redis_cluster=True, redis_prefix=redis_prefix,
                         redis_groups=8)
    store = build_store(config)
    try:
        (tier,) = store.tiers
        assert isinstance(tier, RedisStore) and tier.cluster and len(tier.bases) == 8
        key, chunk = keyed(3)
        assert store.put(key, chunk)
        assert_same_chunk(store.get(key, chunk.token_ids), chunk, atol=4e-3)  # type: ignore[arg-type]  # fp16, the default
    finally:
        store.close()
    with pytest.raises(ValueError, match="redis_cluster"):
        StoreConfig(redis_url=redis_cluster.url)  # several nodes without the cluster flag


def test_cluster_ports_stay_clear_of_source_ports_and_of_each_other() -> None:
    """All of a cluster's ports are picked before any node starts: a port picked for one node
    must not be another's bus port (port + 10000), and none may lie in the kernel's ephemeral
    range, where a connection's source port can take it before the node binds (CI once failed
    on "Failed listening on port ... (cluster)")."""
    from kvblend.store.localredis import _ephemeral_low

    ports = [free_cluster_port() for _ in range(40)]
    taken = [p for port in ports for p in (port, port + 10000)]
    assert len(set(taken)) == len(taken)
    assert max(taken) < _ephemeral_low()


def test_an_unreachable_cluster_is_a_miss_from_the_start() -> None:
    url = f"redis://127.0.0.1:{free_cluster_port()}"
    started = time.monotonic()
    store = RedisStore(url, 1 << 30, cluster=True, timeout_s=0.3, retry_s=0.0)
    key, chunk = keyed(1)
    assert store.get(key) is None and store.put(key, chunk) is False and store.stats().entries == 0
    assert store.stats().warnings >= 3 and time.monotonic() - started < 5.0


def _split(store: RedisStore, cluster: LocalRedisCluster, pairs: list, node: int) -> tuple[list, list]:
    """``pairs`` whose group lives on ``node``, and the others."""
    on = set(b for b, owner in zip(store.bases, _owners(cluster, store.bases)) if owner is cluster.nodes[node])
    mine = [p for p in pairs if store.bases[store.group_of(p[0])] in on]
    return mine, [p for p in pairs if p not in mine]


def test_a_killed_or_hung_node_gives_misses_and_the_rest_keeps_serving() -> None:
    """SIGKILL one node: its chunks miss (in bounded time, counted as warnings) both at once
    and once the cluster marked it failed, the other nodes' chunks still hit with exact
    tensors, nothing raises; it comes back empty and takes puts again. Then SIGSTOP another
    (a hung machine: connections open, no replies): its chunks miss within a few timeouts."""
    with LocalRedisCluster(3, node_timeout_ms=1000) as cluster:
        store = RedisStore(cluster.url, 1 << 30, cluster=True, timeout_s=0.3, retry_s=1.0)
        pairs = [keyed(i) for i in range(30)]
        for key, chunk in pairs:
            assert store.put(key, chunk)
        dead, alive = _split(store, cluster, pairs, 0)
        hung, _ = _split(store, cluster, pairs, 1)
        assert dead and hung and len(alive) > len(hung)
        cluster.nodes[0].kill()
        for phase in ("at once", "after the cluster marked the node failed"):
            _assert_misses(store, dead, phase)
            for key, chunk in alive:
                assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
            assert store.put(*alive[0]) and not store.put(*dead[0])
            assert store.stats().entries == len(alive) and len(store.keys("default")) == len(alive)
            _wait_slots_failed(cluster.nodes[1].port)
        assert store.stats().warnings >= 2 * len(dead) and store.stats().errors == 0
        cluster.nodes[0].start()  # rejoins with its slots (nodes.conf kept), empty
        cluster.wait_ok()
        key, chunk = dead[0]
        assert store.get(key) is None and store.put(key, chunk)
        assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]

        os.kill(cluster.nodes[1].pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            _assert_misses(store, hung, "hung")
            for key, chunk in [p for p in alive if p not in hung]:
                assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
        finally:
            os.kill(cluster.nodes[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
        time.sleep(1.1)  # the tier's back-off
        key, chunk = hung[0]
        assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
        store.close()


def _wait_slots_failed(port: int, within_s: float = 10.0) -> None:
    """Wait until the node on ``port`` counts some slots as failed (a majority agreed)."""
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + within_s
    try:
        while int(client.cluster("info")["cluster_slots_fail"]) == 0:
            assert time.monotonic() < deadline, "the cluster never marked the killed node failed"
            time.sleep(0.1)
    finally:
        client.close()


def _assert_misses(store: RedisStore, pairs: list, phase: str) -> None:
    """Every chunk of ``pairs`` misses, each lookup within a few timeouts (then skipped)."""
    for key, chunk in pairs:
        started = time.monotonic()
        assert store.get(key, chunk.token_ids) is None and store.get_layer(key, 0) is None, phase
        assert not store.contains(key), phase
        assert time.monotonic() - started < 2.5, phase


def test_a_promoted_replica_serves_the_dead_masters_chunks() -> None:
    """A master killed with a replica: its chunks miss until the cluster promotes the
    replica, then hit again with exact tensors (replicated entries pass their checksums),
    its groups' accounting came along, and puts to them land on the new master."""
    with LocalRedisCluster(3, node_timeout_ms=1000, replicas=1) as cluster:
        store = RedisStore(cluster.url, 1 << 30, cluster=True, timeout_s=0.3, retry_s=0.5)
        pairs = [keyed(i) for i in range(30)]
        for key, chunk in pairs:
            assert store.put(key, chunk)
        dead, _ = _split(store, cluster, pairs, 0)
        fresh, _ = _split(store, cluster, [keyed(i) for i in range(100, 130)], 0)
        master = redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port)
        assert master.execute_command("WAIT", 1, 5000) == 1  # the replica has every write
        master.close()
        cluster.nodes[0].kill()
        deadline = time.monotonic() + 15.0
        while not all(store.contains(key) for key, _ in dead):  # misses (never errors) until promoted
            assert time.monotonic() < deadline, "the replica was never promoted"
            time.sleep(0.25)
        for key, chunk in dead:
            assert_same_chunk(store.get(key, chunk.token_ids), chunk)  # type: ignore[arg-type]
        assert store.stats().entries == 30 and store.stats().errors == 0
        assert store.put(*fresh[0]) and store.stats().entries == 31
        store.close()
