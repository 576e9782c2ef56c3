"""Byte accounting and cap enforcement for a local tier (memory, disk).

Not thread-safe: the owning tier calls it under its own lock.
"""

from __future__ import annotations

import time
from collections import defaultdict

from kvblend.store.base import EntryInfo
from kvblend.store.keys import ChunkKey
from kvblend.store.policy import EvictionPolicy


class ByteIndex:
    """Sizes of a tier's entries, totals per tenant, and the eviction order.

    ``max_bytes`` caps the tier, ``tenant_bytes`` (optional) caps each tenant. Fair by
    default: when the tier's cap binds, the policy's globally first entries go, whichever
    tenant owns them (one tenant's old entries cannot lock the others out); a tenant over
    its own cap loses its own first entries.
    """

    def __init__(self, policy: EvictionPolicy, max_bytes: int, tenant_bytes: int | None = None) -> None:
        self.policy = policy
        self.max_bytes = max_bytes
        self.tenant_bytes = None if tenant_bytes is None else min(tenant_bytes, max_bytes)
        self._sizes: dict[ChunkKey, int] = {}
        self._used: dict[ChunkKey, float] = {}
        self._tenant_totals: dict[str, int] = defaultdict(int)
        self.total = 0

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._sizes

    def add(self, key: ChunkKey, nbytes: int, last_used: float | None = None) -> None:
        """Insert or replace ``key``; the policy sees it as most recent."""
        self.remove(key)
        self._sizes[key] = nbytes
        self._used[key] = time.time() if last_used is None else last_used
        self._tenant_totals[key.tenant] += nbytes
        self.total += nbytes
        self.policy.insert(key)

    def remove(self, key: ChunkKey) -> int | None:
        """Forget ``key``; its size, or None when absent."""
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return None
        del self._used[key]
        self._tenant_totals[key.tenant] -= nbytes
        self.total -= nbytes
        self.policy.remove(key)
        return nbytes

    def touch(self, key: ChunkKey) -> None:
        if key in self._sizes:
            self._used[key] = time.time()
            self.policy.touch(key)

    def tenant_total(self, tenant: str) -> int:
        return self._tenant_totals.get(tenant, 0)

    def keys(self, tenant: str | None) -> list[ChunkKey]:
        return [k for k in self._sizes if tenant is None or k.tenant == tenant]

    def infos(self, tenant: str) -> list[EntryInfo]:
        return [EntryInfo(k, self._sizes[k], self._used[k]) for k in self.keys(tenant)]

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` can be stored at all (within both caps)."""
        return nbytes <= self.max_bytes and (self.tenant_bytes is None or nbytes <= self.tenant_bytes)

    def victims_for(self, key: ChunkKey, nbytes: int) -> list[ChunkKey] | None:
        """Keys to evict, in order, so that ``key`` (``nbytes``, replacing any old entry)
        fits both caps: first ``key``'s tenant's own entries while it is over its cap, then
        the globally first entries of any tenant while the tier is over its cap. None when
        the entry is larger than a cap. Costs O(victims) with LRU."""
        if not self.fits(nbytes):
            return None
        freed = self._sizes.get(key, 0)
        total, tenant_total = self.total - freed, self.tenant_total(key.tenant) - freed
        victims: list[ChunkKey] = []
        if self.tenant_bytes is not None:
            for victim in self.policy.order(key.tenant):
                if tenant_total + nbytes <= self.tenant_bytes:
                    break
                if victim != key:
                    victims.append(victim)
                    tenant_total -= self._sizes[victim]
                    total -= self._sizes[victim]
        chosen = set(victims)
        for victim in self.policy.order(None):
            if total + nbytes <= self.max_bytes:
                break
            if victim != key and victim not in chosen:
                victims.append(victim)
                total -= self._sizes[victim]
        if total + nbytes > self.max_bytes:
            return None  # the index and the policy disagree; never overfill
        return victims

    def over_target(self, tenant: str, target_bytes: int) -> list[ChunkKey]:
        """``tenant``'s keys to evict, in order, to bring it down to ``target_bytes``."""
        excess = self.tenant_total(tenant) - target_bytes
        victims: list[ChunkKey] = []
        for victim in self.policy.order(tenant):
            if excess <= 0:
                break
            victims.append(victim)
            excess -= self._sizes[victim]
        return victims
