"""Store fixtures: a real redis-server on a loopback port (no mocks)."""

from __future__ import annotations

import uuid
from typing import Callable, Iterator

import pytest

from kvblend.store import RedisStore
from kvblend.store.localredis import LocalRedis, RedisServerMissing


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One real redis-server for the session (each test uses its own key prefix)."""
    try:
        server = LocalRedis().start()
    except RedisServerMissing as exc:
        pytest.fail(f"{exc} (the Redis tier is tested against a real server)")
    yield server
    server.close()


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
