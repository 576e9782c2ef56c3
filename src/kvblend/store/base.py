"""The narrow interface every chunk KV store implements, and its statistics."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Iterable, NamedTuple, Sequence

import torch

from kvblend.store.chunk import ChunkKV
from kvblend.store.keys import ChunkKey

COUNTERS = ("hits", "misses", "layer_hits", "layer_misses", "puts", "rejected", "evictions", "errors", "warnings")


class StoreStats(NamedTuple):
    """Counters since the store object was created, plus current occupancy.

    hits/misses: whole-chunk lookups; layer_hits/layer_misses: per-layer reads; puts:
    entries written; rejected: puts (or sightings) not admitted, or puts too large;
    evictions: the tenant's entries removed to respect a cap (counted for the tenant that
    lost them, whoever's put caused it); errors: corrupt or unreadable entries (each counted as a miss and
    removed); warnings: a tier was unavailable or too slow (counted as a miss).
    entries/bytes: what the store holds now.
    """

    hits: int = 0
    misses: int = 0
    layer_hits: int = 0
    layer_misses: int = 0
    puts: int = 0
    rejected: int = 0
    evictions: int = 0
    errors: int = 0
    warnings: int = 0
    entries: int = 0
    bytes: int = 0


def merge_stats(stats: Iterable[StoreStats]) -> StoreStats:
    """Field-wise sum."""
    return StoreStats(*(sum(column) for column in zip(StoreStats(), *stats)))


class EntryInfo(NamedTuple):
    """One stored entry as listed by ``entries(tenant)``; ``last_used`` is a Unix time."""

    key: ChunkKey
    nbytes: int
    last_used: float


class Counters:
    """Thread-safe per-tenant event counters (the mutable half of StoreStats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))

    def add(self, tenant: str, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[tenant][name] += n

    def stats(self, tenant: str | None, entries: int, nbytes: int) -> StoreStats:
        """Counters of one tenant (or all when None) with the given occupancy."""
        with self._lock:
            rows = [c for t, c in self._counts.items() if tenant is None or t == tenant]
            totals = {name: sum(r[name] for r in rows) for name in COUNTERS}
        return StoreStats(**totals, entries=entries, bytes=nbytes)


class ChunkStore(ABC):
    """A store of chunk KV addressed by :class:`ChunkKey`.

    Contract shared by all implementations:
    - Thread-safe: any method may be called from several threads at once.
    - Never returns wrong data: a read verifies the entry (identity, tokens, checksums
      where the medium can corrupt); a corrupt entry is removed and reported as a miss.
    - Lookups never raise for an unavailable backend: they miss and count a warning.
    - Tenant-scoped: a key names its tenant; ``keys``/``stats``/``evict`` take a tenant and
      never touch or reveal another tenant's entries. Capacity is shared fairly: a
      tenant's fair share of a capped store is its cap divided by the number of tenants
      holding entries there. When the cap binds, a put evicts its own tenant's least
      valuable entries while that tenant would exceed its share, else those of the tenant
      holding the most; a tenant holding at most its share never loses an entry to another
      tenant's put (such a put is refused instead). A lone tenant can fill the store. An
      optional per-tenant cap makes a tenant over it lose its own entries first.
    - Returned tensors are fresh CPU tensors in the store's compute dtype; the caller may
      modify them. Tensors passed to ``put`` are copied, never kept or modified.
    """

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether an entry exists for ``key`` (not verified; no counters, no recency update)."""

    @abstractmethod
    def get(self, key: ChunkKey, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        """The verified chunk, or None on a miss, a corrupt entry (removed) or when
        ``token_ids`` is given and differs from the stored ids. Updates recency and counters."""

    @abstractmethod
    def get_layer(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) of one layer, each (heads, tokens, head_dim), reading only that layer;
        None on a miss or a corrupt entry (removed) or an out-of-range layer."""

    @abstractmethod
    def put(self, key: ChunkKey, chunk: ChunkKV) -> bool:
        """Store ``chunk`` under ``key`` (made by ``chunk_key``; replaces an existing entry),
        evicting entries to fit (see the class docstring). False when not admitted, larger
        than a cap, or the backend failed; ValueError when ``chunk`` does not match ``key``."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove the entry; True when one existed."""

    @abstractmethod
    def keys(self, tenant: str) -> list[ChunkKey]:
        """Keys of ``tenant``'s entries (only that tenant's), in no particular order."""

    @abstractmethod
    def stats(self, tenant: str | None = None) -> StoreStats:
        """Counters and occupancy of one tenant, or of the whole store when None (admin)."""

    @abstractmethod
    def evict(self, tenant: str, target_bytes: int = 0) -> int:
        """Evict ``tenant``'s entries in eviction order until it holds at most
        ``target_bytes``; returns how many were removed."""

    def sighting(self, key: ChunkKey) -> bool:
        """Record that ``key`` was wanted and missed; True when a ``put`` of it would be
        admitted now, so a caller computes a chunk's KV only then. The admission it grants
        is used up by the next ``put`` of ``key``. Stores without admission always say True."""
        return True

    def clear(self, tenant: str) -> int:
        """Delete all of ``tenant``'s entries; returns how many were removed."""
        return sum(self.delete(key) for key in self.keys(tenant))

    def close(self) -> None:
        """Release connections and files. The store must not be used afterwards."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
