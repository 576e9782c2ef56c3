"""Process-memory tier: a byte-capped LRU (or other policy) of encoded entries."""

from __future__ import annotations

from kvblend.store.entry import Entry
from kvblend.store.keys import ChunkKey
from kvblend.store.policy import EvictionPolicy
from kvblend.store.tier import IndexedTier, LayerRead, WriteOutcome


class MemoryStore(IndexedTier):
    """Entries kept in this process, in storage dtype, at most ``max_bytes`` of tensors.

    Entries are private copies that are never modified, so reads need no checksum: a
    hit checks identity and tokens and decodes into fresh tensors (a copy the caller owns). Thread-safe (one lock
    around the index; decoding happens outside it).
    """

    name = "memory"
    immediate = True

    def __init__(self, max_bytes: int, *, policy: EvictionPolicy | None = None,
                 tenant_bytes: int | None = None, kv_dtype: str = "fp32", compute_dtype: str = "fp32") -> None:
        super().__init__(max_bytes, policy=policy, tenant_bytes=tenant_bytes, kv_dtype=kv_dtype,
                         compute_dtype=compute_dtype)
        self._entries: dict[ChunkKey, Entry] = {}

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def resident_keys(self) -> list[ChunkKey]:
        """Every tenant's keys held now (a key names its tenant): what a Ray Serve replica
        reports to the document-affinity router."""
        with self._lock:
            return list(self._entries)

    def _read(self, key: ChunkKey) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._index.touch(key)
        return None if entry is None else entry.shared()  # kept here: readers must copy

    def _read_layer(self, key: ChunkKey, layer: int) -> LayerRead | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._index.touch(key)
        if entry is None or layer >= entry.header.n_layers:
            return None
        names = entry.header.tensor_names(layer)
        return LayerRead(entry.header, {n: entry.tensors[n] for n in names})

    def _write(self, entry: Entry) -> WriteOutcome:
        key = ChunkKey(entry.header.tenant, entry.header.digest)
        nbytes = entry.nbytes
        if not self._index.fits(nbytes):
            return WriteOutcome(False)
        owned = entry.owned_copy()  # outside the lock
        with self._lock:
            victims = self._index.victims_for(key, nbytes)
            if victims is None:
                return WriteOutcome(False)
            for victim in victims:
                self._delete_locked(victim)
            self._entries[key] = owned
            self._index.add(key, nbytes)
        return WriteOutcome(True, tuple(v.tenant for v in victims))

    def _delete_locked(self, key: ChunkKey) -> None:
        self._entries.pop(key, None)
        self._index.remove(key)

    def _remove(self, key: ChunkKey) -> bool:
        with self._lock:
            existed = key in self._entries
            self._delete_locked(key)
        return existed
