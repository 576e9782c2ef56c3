"""A disk tier slowed to a fixed read bandwidth: a stand-in for slow media (network disks,
object stores) in tests, profiles and benchmarks. Reads sleep for bytes / bandwidth after
reading, so the loader thread waits as it would on the slow medium, without using CPU."""

from __future__ import annotations

import time
from typing import Any

from kvblend.store.disk import DiskStore
from kvblend.store.entry import Entry
from kvblend.store.keys import ChunkKey
from kvblend.store.tier import LayerRead


class ThrottledDisk(DiskStore):
    """A :class:`DiskStore` whose reads take at least ``bytes / bytes_per_s`` seconds."""

    def __init__(self, root: Any, max_bytes: int, *, bytes_per_s: float, **kw: Any) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        super().__init__(root, max_bytes, **kw)
        self.bytes_per_s = bytes_per_s

    def _pace(self, nbytes: int, start: float) -> None:
        left = nbytes / self.bytes_per_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)

    def _read(self, key: ChunkKey) -> Entry | None:
        start = time.perf_counter()
        entry = super()._read(key)
        if entry is not None:
            self._pace(entry.nbytes, start)
        return entry

    def _read_layer(self, key: ChunkKey, layer: int) -> LayerRead | None:
        start = time.perf_counter()
        read = super()._read_layer(key, layer)
        if read is not None:
            self._pace(sum(t.numel() * t.element_size() for t in read.tensors.values()), start)
        return read
