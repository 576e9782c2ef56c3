"""Layer-pipelined loading: a loader thread fetches layer i+1 while fusion computes layer i.

One :class:`LayerFeed` per request owns one loader thread. The thread reads the request's
slow-tier chunks (:class:`kvblend.store.layers.LayeredChunk`) layer by layer, every
document's layer i before any layer i+1, and marks each layer ready. Fusion reads a layer
through :class:`PendingChunk.layer`, whose first call for a layer is the one
synchronisation point: it blocks until the layer is ready (or ``timeout_s`` passed) and
records how long the worker waited. Documents served by the memory tier never go through
a feed: their tensors are lent at lookup, so loading never holds the worker for them.

A document whose layer cannot be read (missing, corrupt, slow past the timeout, or an
entry that is not the chunk expected) is marked failed from that layer on; the loader
skips it afterwards and fusion recomputes it (``kvblend.blend.fusion.fuse_or_drop``).

On CUDA the loader copies each layer into pinned memory and then to the device on its own
stream, recording an event that the worker's stream waits on: the copy of layer i+1
overlaps layer i's kernels. On CPU the tensors are handed over as read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import torch

from kvblend.store.layers import LayeredChunk

log = logging.getLogger(__name__)
KV = tuple[torch.Tensor, torch.Tensor]


class LoadFailure(NamedTuple):
    """A document whose cached KV stopped at ``layer`` (``reason``: missing, timeout, error)."""

    slot: int
    tier: str
    layer: int
    reason: str


class LoadStats(NamedTuple):
    """What pipelined loading cost one request. ``wait_s``: seconds the worker blocked on
    loads, per layer; ``read_s``: seconds the loader spent reading (hidden or not);
    ``failures``: documents that fell back to recompute (by request document index)."""

    pipelined: bool
    documents: int
    wait_s: tuple[float, ...]
    read_s: float
    failures: tuple[LoadFailure, ...] = ()

    @property
    def total_wait_s(self) -> float:
        return sum(self.wait_s)

    def to_dict(self) -> dict[str, object]:
        return {"pipelined": self.pipelined, "documents": self.documents, "wait_s": list(self.wait_s),
                "total_wait_s": self.total_wait_s, "read_s": self.read_s,
                "failures": [f._asdict() for f in self.failures]}


class _Device:
    """Moves loaded layers to the compute device (a no-op on CPU); see the module docstring."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def put(self, kv: KV) -> tuple[KV, torch.cuda.Event | None]:
        if not self.cuda:
            return kv, None
        with torch.cuda.stream(self.stream):
            moved = tuple(self._pinned(t).to(self.device, self.dtype, non_blocking=True) for t in kv)
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event  # type: ignore[return-value]

    @staticmethod
    def _pinned(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else torch.empty_like(t, pin_memory=True).copy_(t)

    def take(self, kv: KV, event: torch.cuda.Event | None) -> KV:
        """Make the worker's stream wait for the copy and keep the memory alive for it."""
        if event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(event)
            for t in kv:
                t.record_stream(main)
        return kv


class LayerFeed:
    """Loads the slow-tier chunks of one request in layer order on a background thread.

    ``add`` registers a chunk (before ``start``) and returns the :class:`PendingChunk` that
    fusion places; ``close`` stops the thread and drops every loaded tensor. Loaded layers
    are kept until ``close`` so that a fusion restarted after a failure reads nothing twice.
    """

    def __init__(self, n_layers: int, device: torch.device, dtype: torch.dtype,
                 timeout_s: float | None = None) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError("timeout_s must be > 0 or None")
        self.n_layers = n_layers
        self.timeout_s = timeout_s
        self._chunks: list[LayeredChunk] = []
        self._slots: list[list[tuple[KV, torch.cuda.Event | None] | None]] = [[] for _ in range(n_layers)]
        self._failed: dict[int, LoadFailure] = {}
        self._ready = [threading.Event() for _ in range(n_layers)]
        self._waited = [False] * n_layers
        self.wait_s = [0.0] * n_layers
        self.read_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._device = _Device(device, dtype)
        self._thread: threading.Thread | None = None

    def add(self, chunk: LayeredChunk) -> PendingChunk:
        if self._thread is not None:
            raise RuntimeError("add chunks before start()")
        self._chunks.append(chunk)
        for row in self._slots:
            row.append(None)
        return PendingChunk(self, len(self._chunks) - 1, chunk)

    def __len__(self) -> int:
        return len(self._chunks)

    def start(self) -> LayerFeed:
        self._thread = threading.Thread(target=self._run, name="kvblend-loader", daemon=True)
        self._thread.start()
        return self

    # -- the loader thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            for layer in range(self.n_layers):
                for slot, chunk in enumerate(self._chunks):
                    if self._stop.is_set():
                        return
                    if slot not in self._failed:
                        self._load(slot, chunk, layer)
                self._ready[layer].set()
            self._promote()
        except Exception:  # never leave the worker waiting: the rest counts as failed
            log.exception("loader thread failed")
            with self._lock:
                for slot, chunk in enumerate(self._chunks):
                    self._failed.setdefault(slot, LoadFailure(slot, chunk.tier_name, -1, "error"))
        finally:
            for event in self._ready:
                event.set()

    def _load(self, slot: int, chunk: LayeredChunk, layer: int) -> None:
        start = time.perf_counter()
        kv = chunk.read(layer)
        moved = None if kv is None else self._device.put(kv)
        self.read_s += time.perf_counter() - start
        with self._lock:
            if slot in self._failed or self._stop.is_set():
                return  # given up on meanwhile (timeout, request done)
            if moved is None:
                self._failed[slot] = LoadFailure(slot, chunk.tier_name, layer, "missing or corrupt")
            else:
                self._slots[layer][slot] = moved

    def _promote(self) -> None:
        """Complete entries go to the faster tiers (after the last layer: off the worker's
        path; also after ``close``, since every layer was read and verified)."""
        for slot, chunk in enumerate(self._chunks):
            if slot not in self._failed:
                chunk.promote()

    # -- the worker's side ---------------------------------------------------------------

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is loaded for every document (once per layer; timed). After
        ``timeout_s`` the documents still missing the layer are marked failed."""
        if self._waited[layer]:
            return
        start = time.perf_counter()
        if not self._ready[layer].wait(self.timeout_s):
            with self._lock:
                for slot, chunk in enumerate(self._chunks):
                    if self._slots[layer][slot] is None and slot not in self._failed:
                        self._failed[slot] = LoadFailure(slot, chunk.tier_name, layer, "timeout")
        self.wait_s[layer] += time.perf_counter() - start
        self._waited[layer] = True

    def get(self, slot: int, layer: int) -> KV | None:
        self.wait(layer)
        with self._lock:
            failure = self._failed.get(slot)
            loaded = self._slots[layer][slot]
        if loaded is None or (failure is not None and failure.layer <= layer):
            return None
        return self._device.take(*loaded)

    def failure(self, slot: int) -> LoadFailure | None:
        with self._lock:
            return self._failed.get(slot)

    def close(self) -> None:
        """Drop every loaded layer and stop the loader. Does not wait for it: a read stuck
        on a slow tier finishes in the background and its result is discarded."""
        with self._lock:
            self._stop.set()
            self._slots = [[None] * len(self._chunks) for _ in range(self.n_layers)]


class PendingChunk:
    """One document's cached KV as fusion sees it while a :class:`LayerFeed` loads it."""

    def __init__(self, feed: LayerFeed, slot: int, chunk: LayeredChunk) -> None:
        self.feed, self.slot, self.source = feed, slot, chunk

    @property
    def n_tokens(self) -> int:
        return self.source.n_tokens

    @property
    def base_position(self) -> int:
        return self.source.base_position

    def layer(self, layer: int) -> KV | None:
        return self.feed.get(self.slot, layer)

    def failure(self) -> LoadFailure | None:
        return self.feed.failure(self.slot)

