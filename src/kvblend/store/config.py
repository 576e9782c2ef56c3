"""Store configuration and the factory that builds tiers by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvblend.store import codec
from kvblend.store.disk import DiskStore
from kvblend.store.keys import validate_tenant
from kvblend.store.memory import MemoryStore
from kvblend.store.policy import POLICIES, SightingsAdmission, make_policy
from kvblend.store.remote import MAX_GROUPS, RedisStore, cluster_nodes
from kvblend.store.tier import Tier
from kvblend.store.tiered import TieredStore

GiB = 1024**3
TIER_NAMES = ("memory", "disk", "redis")


@dataclass(frozen=True)
class StoreConfig:
    """Which tiers to use and their caps. ``tiers`` is the lookup order; a named tier is
    used only when enabled: memory when ``memory_bytes > 0``, disk when ``disk_dir`` is
    set, redis when ``redis_url`` is set. Sizes are bytes.

    Redis calls give up after ``redis_timeout_s`` (a miss) and the tier is then skipped for
    ``redis_retry_s``; ``redis_ttl_s`` expires entries (None: never); ``redis_prefix``
    namespaces the keys of one deployment. ``redis_cluster``: ``redis_url`` names a Redis
    Cluster (one or more comma-separated node URLs, ``redis://10.0.0.1:6379,redis://10.0.0.2:6379``),
    whose entries and caps are split into ``redis_groups`` hash-tag groups (caps and fair
    shares hold per group: ``kvblend.store.remote``); every client of one prefix must use
    the same ``redis_groups``. ``eviction`` names the policy (lru, lfu).
    ``kv_dtype`` is how KV is stored (fp16 by default: half fp32's bytes, for a next-token
    KL to fp32 storage measured in docs/results.md; fp32 is exact); loaded KV comes back
    as CPU tensors in ``compute_dtype``. ``tenant_bytes`` optionally caps each tenant in every tier.
    ``admit_after``: store a chunk on its N-th sighting (a miss or a put attempt); the
    engine computes a missed chunk's KV only once it is admitted. ``writeback_queue``:
    how many chunks the engine's background write-back holds pending at most.
    ``tier_costs``: (tier, price per GB) pairs; when set, new chunks go to the cheapest
    tier whose loading hides behind recompute (placement) instead of to every tier.
    """

    tiers: tuple[str, ...] = TIER_NAMES
    memory_bytes: int = 1 * GiB
    disk_dir: str | None = None
    disk_bytes: int = 10 * GiB
    disk_fsync: bool = True
    redis_url: str | None = None
    redis_bytes: int = 10 * GiB
    redis_ttl_s: float | None = None
    redis_timeout_s: float = 0.5
    redis_retry_s: float = 5.0
    redis_prefix: str = "kvblend"
    redis_cluster: bool = False
    redis_groups: int = 16
    tenant_bytes: int | None = None
    kv_dtype: str = "fp16"
    compute_dtype: str = "fp32"
    eviction: str = "lru"
    admit_after: int = 1
    writeback_queue: int = 64
    tier_costs: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in TIER_NAMES]
        if unknown or len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers must be distinct names from {TIER_NAMES}; got {self.tiers}")
        for name in ("memory_bytes", "disk_bytes", "redis_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        self._check_redis()
        codec.storage_dtype(self.kv_dtype)
        codec.compute_dtype(self.compute_dtype)
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {sorted(POLICIES)}; got {self.eviction!r}")
        if self.admit_after < 1 or self.writeback_queue < 1:
            raise ValueError("admit_after and writeback_queue must be >= 1")
        if self.tenant_bytes is not None and self.tenant_bytes < 0:
            raise ValueError("tenant_bytes must be >= 0")
        object.__setattr__(self, "tier_costs", tuple((str(t), float(c)) for t, c in self.tier_costs))
        if any(t not in TIER_NAMES or c < 0 for t, c in self.tier_costs):
            raise ValueError(f"tier_costs must pair tier names from {TIER_NAMES} with costs >= 0")
        if not self.enabled_tiers:
            raise ValueError("no tier enabled: set memory_bytes > 0, disk_dir or redis_url")

    def _check_redis(self) -> None:
        if self.redis_timeout_s <= 0 or self.redis_retry_s < 0:
            raise ValueError("redis_timeout_s must be > 0 and redis_retry_s >= 0")
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise ValueError("redis_ttl_s must be > 0 or None")
        validate_tenant(self.redis_prefix)
        if not 1 <= self.redis_groups <= MAX_GROUPS:
            raise ValueError(f"redis_groups must be in 1..{MAX_GROUPS}")
        if self.redis_url is not None and self.redis_cluster:
            cluster_nodes(self.redis_url)
        elif self.redis_url is not None and "," in self.redis_url:
            raise ValueError("several Redis URLs name the nodes of a cluster: set redis_cluster")

    @property
    def enabled_tiers(self) -> tuple[str, ...]:
        enabled = {"memory": self.memory_bytes > 0, "disk": self.disk_dir is not None,
                   "redis": self.redis_url is not None}
        return tuple(t for t in self.tiers if enabled[t])


def _memory(c: StoreConfig) -> Tier:
    return MemoryStore(c.memory_bytes, policy=make_policy(c.eviction), tenant_bytes=c.tenant_bytes,
                       kv_dtype=c.kv_dtype, compute_dtype=c.compute_dtype)


def _disk(c: StoreConfig) -> Tier:
    assert c.disk_dir is not None
    return DiskStore(c.disk_dir, c.disk_bytes, policy=make_policy(c.eviction), tenant_bytes=c.tenant_bytes,
                     kv_dtype=c.kv_dtype, compute_dtype=c.compute_dtype, fsync=c.disk_fsync)


def _redis(c: StoreConfig) -> Tier:
    assert c.redis_url is not None
    return RedisStore(c.redis_url, c.redis_bytes, ttl_s=c.redis_ttl_s, timeout_s=c.redis_timeout_s,
                      retry_s=c.redis_retry_s, prefix=c.redis_prefix, tenant_bytes=c.tenant_bytes,
                      cluster=c.redis_cluster, groups=c.redis_groups, kv_dtype=c.kv_dtype,
                      compute_dtype=c.compute_dtype)


TIER_BUILDERS: dict[str, Callable[[StoreConfig], Tier]] = {"memory": _memory, "disk": _disk, "redis": _redis}


def build_store(config: StoreConfig) -> TieredStore:
    """A TieredStore over the enabled tiers, in ``config.tiers`` order."""
    tiers = [TIER_BUILDERS[name](config) for name in config.enabled_tiers]
    return TieredStore(tiers, kv_dtype=config.kv_dtype, compute_dtype=config.compute_dtype,
                       admission=SightingsAdmission(config.admit_after), writeback_queue=config.writeback_queue,
                       costs=dict(config.tier_costs))
