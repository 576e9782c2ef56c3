"""Eviction policies (small strategy objects) and admission after N sightings.

A policy only orders each tenant's keys; the tier that owns it decides whose entries go
and how many (fair shares across tenants: ``kvblend.store.index.ByteIndex``) and holds
the lock (policies are not thread-safe on their own).
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, defaultdict
from typing import Iterator

from kvblend.store.keys import ChunkKey


class EvictionPolicy(ABC):
    """Orders each tenant's keys for eviction. Calls: ``insert`` once per new key, ``touch``
    on each hit, ``remove`` when a key leaves, ``order(tenant)`` to list victims, first first."""

    @abstractmethod
    def insert(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def touch(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def remove(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def order(self, tenant: str) -> Iterator[ChunkKey]:
        """``tenant``'s keys, the first to evict first. Lazy: do not mutate the policy while
        iterating."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first. Every call is O(1); ``order`` yields lazily, so
    picking victims costs O(victims), not O(entries)."""

    def __init__(self) -> None:
        self._lists: dict[str, OrderedDict[ChunkKey, None]] = defaultdict(OrderedDict)

    def insert(self, key: ChunkKey) -> None:
        lru = self._lists[key.tenant]
        lru[key] = None
        lru.move_to_end(key)

    def touch(self, key: ChunkKey) -> None:
        lru = self._lists.get(key.tenant)
        if lru is not None and key in lru:
            lru.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        lru = self._lists.get(key.tenant)
        if lru is not None:
            lru.pop(key, None)
            if not lru:
                del self._lists[key.tenant]

    def order(self, tenant: str) -> Iterator[ChunkKey]:
        return iter(self._lists.get(tenant, ()))


class LFUPolicy(EvictionPolicy):
    """Fewest hits first; among equals, least recently used first. ``order`` sorts
    (O(n log n) per eviction): use LRU for large tiers."""

    def __init__(self) -> None:
        self._tick = itertools.count()
        self._scores: dict[str, dict[ChunkKey, tuple[int, int]]] = defaultdict(dict)

    def insert(self, key: ChunkKey) -> None:
        self._scores[key.tenant][key] = (0, next(self._tick))

    def touch(self, key: ChunkKey) -> None:
        scores = self._scores.get(key.tenant, {})
        if key in scores:
            scores[key] = (scores[key][0] + 1, next(self._tick))

    def remove(self, key: ChunkKey) -> None:
        scores = self._scores.get(key.tenant)
        if scores is not None:
            scores.pop(key, None)
            if not scores:
                del self._scores[key.tenant]

    def order(self, tenant: str) -> Iterator[ChunkKey]:
        scores = self._scores.get(tenant, {})
        return iter(sorted(scores, key=scores.__getitem__))


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name (``lru`` or ``lfu``)."""
    if name not in POLICIES:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}; got {name!r}")
    return POLICIES[name]()


class SightingsAdmission:
    """Admit a chunk on its ``admit_after``-th sighting. Thread-safe.

    ``sight`` records a miss and says whether the chunk is admitted (it then stays
    admitted until a put uses it); ``admit`` is the put's check: it uses up an admission
    granted by ``sight``, or counts the put itself as a sighting. Sightings are remembered
    for at most ``max_tracked`` keys (least recent forgotten), so the tracker stays
    bounded. ``admit_after=1`` admits everything.
    """

    def __init__(self, admit_after: int = 1, max_tracked: int = 100_000) -> None:
        if admit_after < 1 or max_tracked < 1:
            raise ValueError("admit_after and max_tracked must be >= 1")
        self.admit_after = admit_after
        self._max = max_tracked
        self._seen: OrderedDict[ChunkKey, int] = OrderedDict()
        self._lock = threading.Lock()

    def sight(self, key: ChunkKey) -> bool:
        """Record a sighting of ``key``; True once it has been seen ``admit_after`` times."""
        if self.admit_after == 1:
            return True
        with self._lock:
            count = min(self._seen.pop(key, 0) + 1, self.admit_after)
            self._remember(key, count)
        return count >= self.admit_after

    def admit(self, key: ChunkKey) -> bool:
        """For a put: True (using the admission up) when ``key`` was admitted by ``sight``
        or this sighting admits it; counting then starts over."""
        if self.admit_after == 1:
            return True
        with self._lock:
            count = self._seen.pop(key, 0) + 1  # an admitted key already counts admit_after
            if count >= self.admit_after:
                return True
            self._remember(key, count)
        return False

    def _remember(self, key: ChunkKey, count: int) -> None:
        self._seen[key] = count
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
