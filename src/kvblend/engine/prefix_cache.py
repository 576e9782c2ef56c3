"""Exact prefix reuse (the vLLM/SGLang baseline): the longest cached prefix of a token
sequence is reused losslessly, since a prefix's KV does not depend on what follows it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from kvblend.models.kv_cache import KVCache


class PrefixHit(NamedTuple):
    length: int
    keys: list[torch.Tensor]  # per layer (Hkv, length, d)
    values: list[torch.Tensor]


class _Entry(NamedTuple):
    ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """Byte-capped LRU of prompt KVs, matched token by token. Thread-safe.

    ``lookup`` never mutates cached tensors (callers copy what they read into their own
    cache); ``insert`` stores a copy of the first ``length`` positions of a cache.
    """

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()

    @staticmethod
    def _common(a: torch.Tensor, b: torch.Tensor) -> int:
        m = min(a.shape[0], b.shape[0])
        diff = (a[:m] != b[:m]).nonzero()
        return int(diff[0]) if diff.numel() else m

    def lookup(self, ids: torch.Tensor, max_len: int | None = None) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` (at most ``max_len`` tokens), or None."""
        ids = ids.cpu()
        with self._lock:
            best, best_len = None, 0
            for key, entry in self._entries.items():
                n = self._common(entry.ids, ids)
                if n > best_len:
                    best, best_len = key, n
            best_len = min(best_len, max_len if max_len is not None else best_len)
            if best is None or best_len == 0:
                return None
            self._entries.move_to_end(best)
            e = self._entries[best]
            return PrefixHit(best_len, [k[:, :best_len] for k in e.keys], [v[:, :best_len] for v in e.values])

    def insert(self, ids: torch.Tensor, cache: KVCache, length: int) -> None:
        """Remember the KV of ``ids[:length]`` taken from ``cache`` (positions 0..length-1)."""
        entry = _Entry(ids[:length].cpu().clone(), [cache.keys[i][:, :length].clone() for i in range(cache.num_layers)],
                       [cache.values[i][:, :length].clone() for i in range(cache.num_layers)])
        if entry.nbytes > self.max_bytes or length == 0:
            return
        with self._lock:
            if any(self._common(e.ids, entry.ids) == length == e.ids.shape[0] for e in self._entries.values()):
                return
            self._entries[self._next] = entry
            self._next += 1
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
