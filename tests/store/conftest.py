"""Store fixtures: a real redis-server on a loopback port (no mocks)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvblend.store import DiskStore, MemoryStore, RedisStore
from kvblend.store.localredis import LocalRedis, LocalRedisCluster, RedisServerMissing
from kvblend.store.tier import Tier

TIERS = ("memory", "disk", "redis")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One real redis-server for the session (each test uses its own key prefix)."""
    try:
        server = LocalRedis().start()
    except RedisServerMissing as exc:
        pytest.fail(f"{exc} (the Redis tier is tested against a real server)")
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """One real 3-node Redis Cluster on loopback for the session (each test its own prefix)."""
    try:
        cluster = LocalRedisCluster(3)
    except RedisServerMissing as exc:
        pytest.fail(f"{exc} (the Redis Cluster tier is tested against real servers)")
    with cluster:
        yield cluster


@pytest.fixture
def make_cluster_store(redis_cluster: LocalRedisCluster, redis_prefix: str) -> Iterator[Callable[..., RedisStore]]:
    """Factory of cluster-mode RedisStore clients on the session cluster, sharing this test's prefix."""
    made: list[RedisStore] = []

    def factory(max_bytes: int = 1 << 30, **kw: object) -> RedisStore:
        kw.setdefault("prefix", redis_prefix)
        store = RedisStore(redis_cluster.url, max_bytes, cluster=True, **kw)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def redis_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_redis(redis_server: LocalRedis, redis_prefix: str) -> Iterator[Callable[..., RedisStore]]:
    """Factory of RedisStore clients on the session server, sharing this test's prefix."""
    made: list[RedisStore] = []

    def factory(max_bytes: int = 1 << 30, **kw: object) -> RedisStore:
        kw.setdefault("prefix", redis_prefix)
        store = RedisStore(kw.pop("url", redis_server.url), max_bytes, **kw)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture(params=TIERS)
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Tier]:
    """Factory of one tier per parameter: memory, disk (under tmp_path) or the session Redis."""
    def factory(max_bytes: int = 1 << 30, **kw: object) -> Tier:
        if request.param == "memory":
            return MemoryStore(max_bytes, **kw)  # type: ignore[arg-type]
        if request.param == "disk":
            return DiskStore(tmp_path / "disk", max_bytes, fsync=False, **kw)  # type: ignore[arg-type]
        return request.getfixturevalue("make_redis")(max_bytes, **kw)

    return factory
