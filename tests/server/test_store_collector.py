"""The store's Prometheus families read at scrape time, against real tiers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvblend.server.metrics import StoreCollector
from kvblend.store import MemoryStore, RedisStore, TieredStore
from kvblend.store.localredis import free_port

from tests.store.helpers import keyed


def test_an_unreachable_tier_is_counted_per_tier() -> None:
    """A Redis tier that cannot be reached (here: nothing listens) shows up as
    ``kvblend:store_unavailable_total{tier="redis"}``; the memory tier keeps serving."""
    redis_tier = RedisStore(f"redis://127.0.0.1:{free_port()}/0", 1 << 30, timeout_s=0.2, retry_s=0.0)
    store = TieredStore([MemoryStore(1 << 20), redis_tier])
    key, chunk = keyed(1)
    store.put(key, chunk)
    redis_tier.get(key)
    reg = CollectorRegistry()
    reg.register(StoreCollector(store.tier_stats, "m"))
    value = reg.get_sample_value
    assert value("kvblend:store_unavailable_total", {"model_name": "m", "tier": "redis"}) >= 2  # the put, the get
    assert value("kvblend:store_unavailable_total", {"model_name": "m", "tier": "memory"}) == 0
    assert value("kvblend:store_entries", {"model_name": "m", "tier": "memory"}) == 1
    store.close()
