"""The engine over a real Redis tier: shared across engines, and Redis dying mid-run
turns into recomputation with the right answer, never an error."""

from __future__ import annotations

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.store import StoreConfig, build_store
from kvblend.store.localredis import LocalRedis
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION


def redis_engine(loaded, url: str) -> Engine:
    return Engine(loaded, store=build_store(StoreConfig(tiers=("redis",), redis_url=url, redis_timeout_s=0.3)))


def test_two_engines_share_chunks_and_survive_redis_going_away() -> None:
    loaded = make_loaded()
    with LocalRedis() as server:
        writer = redis_engine(loaded, server.url)
        writer.prepare(Request(documents=DOCS, question=QUESTION))
        writer.flush()
        reader = redis_engine(loaded, server.url)  # another "serving machine"
        shared = reader.prepare(Request(documents=DOCS[::-1], question=QUESTION))
        assert [d.source for d in shared.stats.docs] == ["redis"] * 3
        server.stop()
        req = Request(documents=DOCS, question=QUESTION, blend=BlendConfig(ratio=0.0, recompute_misses=True))
        degraded = reader.prepare(req)
        assert [d.source for d in degraded.stats.docs] == ["computed"] * 3
        full = reader.prepare(Request(documents=DOCS, question=QUESTION, method="full"))
        assert (degraded.logits - full.logits).abs().max().item() <= 1e-3
        assert reader.store.stats().warnings >= 1  # the unavailable tier is counted, not raised
