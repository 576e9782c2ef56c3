"""Shared behaviour of single-medium stores: verification, counters, decoding.

A tier implements a few storage primitives on :class:`Entry` objects; this base turns
them into the :class:`ChunkStore` contract (verify identity and tokens, remove corrupt
entries, count, never raise for an unavailable backend, decode to the compute dtype).
:class:`kvblend.store.tiered.TieredStore` moves entries between tiers with
``load``/``store`` so that promotion neither decodes nor re-encodes.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from typing import Callable, ClassVar, Mapping, NamedTuple, Sequence, TypeVar

import torch

from kvblend.store import codec
from kvblend.store.base import ChunkStore, Counters, EntryInfo, StoreStats
from kvblend.store.chunk import ChunkKV
from kvblend.store.entry import (
    CorruptEntry,
    Entry,
    EntryHeader,
    check_identity,
    decode_entry,
    decode_layer,
    encode_chunk,
    tokens_match,
)
from kvblend.store.index import ByteIndex
from kvblend.store.keys import ChunkKey
from kvblend.store.policy import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")
ADMIN = ""  # counter bucket for store-wide operations (never a valid tenant name)


class TierUnavailable(Exception):
    """The backend could not answer in time (down, slow, I/O error): treat as a miss."""


class LayerRead(NamedTuple):
    """The verified header of an entry and the raw tensors of one layer."""

    header: EntryHeader
    tensors: Mapping[str, torch.Tensor]
    owned: bool = False  # as Entry.owned: private tensors that may be handed out as they are


class WriteOutcome(NamedTuple):
    """Whether a write stored its entry, and the tenant of each entry evicted for it."""

    stored: bool
    evicted: tuple[str, ...] = ()


class Tier(ChunkStore):
    """Base of the memory, disk and Redis tiers (see the module docstring).

    Subclasses implement ``_read``/``_read_layer`` (raise CorruptEntry for bad data,
    TierUnavailable for an unreachable backend, return None when absent), ``_write``,
    ``_remove``, ``_occupancy``, ``entries`` and ``_evict``.
    """

    name: ClassVar[str] = "tier"
    immediate: ClassVar[bool] = False  # reads cost no I/O (process memory): never worth pipelining

    def __init__(self, *, kv_dtype: str = "fp32", compute_dtype: str = "fp32") -> None:
        codec.storage_dtype(kv_dtype)
        self.kv_dtype = kv_dtype
        self.compute_dtype = codec.compute_dtype(compute_dtype)
        self.counters = Counters()

    @property
    def capacity_bytes(self) -> int | None:
        """The tier's byte cap (None: it has none)."""
        return None

    @abstractmethod
    def _read(self, key: ChunkKey) -> Entry | None: ...

    @abstractmethod
    def _read_layer(self, key: ChunkKey, layer: int) -> LayerRead | None: ...

    @abstractmethod
    def _write(self, entry: Entry) -> WriteOutcome: ...

    @abstractmethod
    def _remove(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def _occupancy(self, tenant: str | None) -> tuple[int, int]:
        """(entries, bytes) of one tenant or of the whole tier."""

    @abstractmethod
    def _evict(self, tenant: str, target_bytes: int) -> int: ...

    @abstractmethod
    def entries(self, tenant: str) -> list[EntryInfo]:
        """``tenant``'s entries with size and last use (empty when the backend is down)."""

    # -- entry-level API used by TieredStore ---------------------------------------------

    def load(self, key: ChunkKey, token_ids: Sequence[int] | None = None) -> Entry | None:
        """The verified stored entry, or None (miss, corrupt: removed, tokens differ)."""
        entry = self._guarded(key, lambda: self._checked(key, self._read(key)))
        if entry is None or not tokens_match(entry.header, token_ids):
            self.counters.add(key.tenant, "misses")
            return None
        self.counters.add(key.tenant, "hits")
        return entry

    def store(self, entry: Entry) -> bool:
        """Write an encoded entry (evicting entries to fit: see ``ChunkStore.put``); False if
        refused. Each eviction is counted for the tenant that lost the entry."""
        tenant = entry.header.tenant
        try:
            outcome = self._write(entry)
        except (TierUnavailable, OSError) as exc:
            self.counters.add(tenant, "warnings")
            log.warning("%s tier: write of %s/%s failed: %s", self.name, tenant, entry.header.digest, exc)
            return False
        for victim_tenant in outcome.evicted:
            self.counters.add(victim_tenant, "evictions")
        self.counters.add(tenant, "puts" if outcome.stored else "rejected")
        return outcome.stored

    # -- ChunkStore --------------------------------------------------------------------

    def get(self, key: ChunkKey, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        entry = self.load(key, token_ids)
        return None if entry is None else decode_entry(entry, self.compute_dtype)

    def get_layer(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        read = self.read_layer(key, layer)
        return None if read is None else decode_layer(read.header, read.tensors, layer, self.compute_dtype,
                                                      owned=read.owned)

    def read_layer(self, key: ChunkKey, layer: int, token_ids: Sequence[int] | None = None) -> LayerRead | None:
        """The verified header and stored tensors of one layer, reading only that layer;
        None on a miss, a corrupt entry (removed), an out-of-range layer or other token ids.
        Counted as a layer hit or miss."""
        read = self._guarded(key, lambda: self._checked_layer(key, layer))
        if read is None or not tokens_match(read.header, token_ids):
            self.counters.add(key.tenant, "layer_misses")
            return None
        self.counters.add(key.tenant, "layer_hits")
        return read

    def put(self, key: ChunkKey, chunk: ChunkKV) -> bool:
        return self.store(encode_chunk(key, chunk, self.kv_dtype))

    def delete(self, key: ChunkKey) -> bool:
        return bool(self._guarded(key, lambda: self._remove(key)))

    def keys(self, tenant: str) -> list[ChunkKey]:
        return [info.key for info in self.entries(tenant)]

    def stats(self, tenant: str | None = None) -> StoreStats:
        try:
            entries, nbytes = self._occupancy(tenant)
        except TierUnavailable:
            self.counters.add(tenant or ADMIN, "warnings")
            entries, nbytes = 0, 0
        return self.counters.stats(tenant, entries, nbytes)

    def evict(self, tenant: str, target_bytes: int = 0) -> int:
        try:
            evicted = self._evict(tenant, max(0, target_bytes))
        except TierUnavailable:
            self.counters.add(tenant, "warnings")
            return 0
        self.counters.add(tenant, "evictions", evicted)
        return evicted

    # -- helpers -----------------------------------------------------------------------

    def _checked(self, key: ChunkKey, entry: Entry | None) -> Entry | None:
        if entry is not None:
            check_identity(entry.header, key)
        return entry

    def _checked_layer(self, key: ChunkKey, layer: int) -> LayerRead | None:
        if layer < 0:
            return None
        read = self._read_layer(key, layer)
        if read is not None:
            check_identity(read.header, key)
        return read

    def _guarded(self, key: ChunkKey, fn: Callable[[], T]) -> T | None:
        """Run a read; corrupt entries are removed and counted, unavailability is counted."""
        try:
            return fn()
        except CorruptEntry as exc:
            self.counters.add(key.tenant, "errors")
            log.warning("%s tier: removing corrupt entry %s: %s", self.name, key, exc)
            self._discard(key)
        except TierUnavailable as exc:
            self.counters.add(key.tenant, "warnings")
            log.debug("%s tier unavailable for %s: %s", self.name, key, exc)
        return None

    def _discard(self, key: ChunkKey) -> None:
        try:
            self._remove(key)
        except (TierUnavailable, OSError) as exc:
            log.warning("%s tier: could not remove %s: %s", self.name, key, exc)


class IndexedTier(Tier):
    """A tier whose sizes and eviction order live in a local ``ByteIndex`` (memory, disk).

    Occupancy, listing and eviction are answered from the index under one lock;
    subclasses say how to delete an entry's data in ``_delete_locked`` (called with the lock held).
    """

    def __init__(self, max_bytes: int, *, policy: EvictionPolicy | None, tenant_bytes: int | None,
                 kv_dtype: str, compute_dtype: str) -> None:
        super().__init__(kv_dtype=kv_dtype, compute_dtype=compute_dtype)
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._index = ByteIndex(policy or LRUPolicy(), max_bytes, tenant_bytes)
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._index.max_bytes

    @abstractmethod
    def _delete_locked(self, key: ChunkKey) -> None:
        """Delete one entry and its index record; the caller holds the lock."""

    def entries(self, tenant: str) -> list[EntryInfo]:
        with self._lock:
            return self._index.infos(tenant)

    def _occupancy(self, tenant: str | None) -> tuple[int, int]:
        with self._lock:
            if tenant is None:
                return len(self._index.keys(None)), self._index.total
            return len(self._index.keys(tenant)), self._index.tenant_total(tenant)

    def _evict(self, tenant: str, target_bytes: int) -> int:
        with self._lock:
            victims = self._index.over_target(tenant, target_bytes)
            for victim in victims:
                self._delete_locked(victim)
        return len(victims)
