"""Byte accounting and cap enforcement for a local tier (memory, disk).

Not thread-safe: the owning tier calls it under its own lock.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Iterator

from kvblend.store.base import EntryInfo
from kvblend.store.keys import ChunkKey
from kvblend.store.policy import EvictionPolicy


class ByteIndex:
    """Sizes of a tier's entries, totals per tenant, and each tenant's eviction order.

    ``max_bytes`` caps the tier, ``tenant_bytes`` (optional) caps each tenant. Capacity is
    shared fairly (``victims_for``): a tenant's fair share is ``max_bytes`` divided by the
    number of tenants holding entries; when the cap binds, a put evicts the putting
    tenant's own entries while it would hold more than its share, else those of the
    tenant holding the most, and never those of a tenant holding at most its share. A
    lone tenant can fill the tier.
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
        if self._tenant_totals[key.tenant] <= 0:
            del self._tenant_totals[key.tenant]  # only tenants holding entries count for shares
        self.total -= nbytes
        self.policy.remove(key)
        return nbytes

    def touch(self, key: ChunkKey) -> None:
        if key in self._sizes:
            self._used[key] = time.time()
            self.policy.touch(key)

    def size(self, key: ChunkKey) -> int:
        return self._sizes[key]

    def tenant_total(self, tenant: str) -> int:
        return self._tenant_totals.get(tenant, 0)

    def tenant_totals(self) -> dict[str, int]:
        """Bytes held by each tenant holding entries (a copy)."""
        return dict(self._tenant_totals)

    def keys(self, tenant: str | None) -> list[ChunkKey]:
        return [k for k in self._sizes if tenant is None or k.tenant == tenant]

    def infos(self, tenant: str) -> list[EntryInfo]:
        return [EntryInfo(k, self._sizes[k], self._used[k]) for k in self.keys(tenant)]

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` can be stored at all (within both caps)."""
        return nbytes <= self.max_bytes and (self.tenant_bytes is None or nbytes <= self.tenant_bytes)

    def victims_for(self, key: ChunkKey, nbytes: int) -> list[ChunkKey] | None:
        """Keys to evict, in order, so that ``key`` (``nbytes``, replacing any old entry)
        fits both caps: first ``key``'s tenant's own entries while it is over
        ``tenant_bytes``, then, while the tier is over its cap, one entry at a time from the
        tenant ``_fair_victim`` names. None when the entry is larger than a cap, or fits only
        by evicting a tenant within its fair share. Costs O(victims × tenants) with LRU."""
        if not self.fits(nbytes):
            return None
        draft = _Draft(self, key)
        tenant = key.tenant
        while self.tenant_bytes is not None and draft.held(tenant) + nbytes > self.tenant_bytes:
            if not draft.take(tenant):
                return None
        while draft.total + nbytes > self.max_bytes:
            victim = self._fair_victim(draft, tenant, nbytes)
            if victim is None or not draft.take(victim):
                return None
        return draft.victims

    def _fair_victim(self, draft: _Draft, tenant: str, nbytes: int) -> str | None:
        """Whose entry goes next for ``tenant``'s put of ``nbytes``: ``tenant`` itself while
        it holds entries and would exceed its fair share (cap / tenants holding entries,
        itself included); else the other tenant holding the most, if it exceeds its share;
        else None (everyone else is within their share)."""
        holders = len(draft.totals) + (tenant not in draft.totals)
        if draft.held(tenant) > 0 and (draft.held(tenant) + nbytes) * holders > self.max_bytes:
            return tenant
        most, other = max(((held, t) for t, held in draft.totals.items() if t != tenant), default=(0, None))
        return other if most * holders > self.max_bytes else None

    def over_cap(self) -> list[ChunkKey]:
        """Keys to evict, in order, to bring the tier within its cap (when the cap shrank):
        the first entry of the tenant holding the most, one at a time (that tenant always
        exceeds its fair share while the tier is over its cap)."""
        draft = _Draft(self, None)
        while draft.total > self.max_bytes and draft.totals:
            if not draft.take(max(draft.totals, key=lambda t: (draft.totals[t], t))):
                break
        return draft.victims

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


class _Draft:
    """The victims chosen so far for one eviction and the totals they would leave (the
    index itself is not changed; ``totals`` lists only tenants still holding entries)."""

    def __init__(self, index: ByteIndex, key: ChunkKey | None) -> None:
        """``key``: the entry being put, if any: its old size is already freed and it is never
        chosen."""
        self._index, self._key = index, key
        self._orders: dict[str, Iterator[ChunkKey]] = {}
        self.totals = index.tenant_totals()
        self.total = index.total
        self.victims: list[ChunkKey] = []
        if key is not None and key in index:
            self._free(key)

    def held(self, tenant: str) -> int:
        return self.totals.get(tenant, 0)

    def take(self, tenant: str) -> bool:
        """Choose ``tenant``'s next entry in eviction order; False when it has none left."""
        order = self._orders.setdefault(tenant, self._index.policy.order(tenant))
        for victim in order:
            if victim != self._key:
                self.victims.append(victim)
                self._free(victim)
                return True
        return False

    def _free(self, key: ChunkKey) -> None:
        nbytes = self._index.size(key)
        self.total -= nbytes
        left = self.totals.pop(key.tenant, 0) - nbytes
        if left > 0:
            self.totals[key.tenant] = left
