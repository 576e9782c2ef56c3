"""Background write-back of newly computed chunk KV, off the request's critical path.

A miss is submitted with the chunk itself or with a function that computes it; the
function runs on the write-back thread, only once the store has said it would admit the
chunk (``ChunkStore.sighting``) and only once per key in flight, so a document that is
not admitted yet, or is already queued, costs no prefill.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from typing import Callable, NamedTuple, Union

from kvblend.store.base import ChunkStore
from kvblend.store.chunk import ChunkKV
from kvblend.store.keys import ChunkKey

log = logging.getLogger(__name__)
_STOP = object()
EXIT_FLUSH_S = 30.0
OUTCOMES = ("queued", "written", "refused", "not_admitted", "deduplicated", "dropped", "failed")

ChunkSource = Union[ChunkKV, Callable[[], ChunkKV]]


class ComputeRefused(Exception):
    """What a chunk-computing function raises when whoever runs model work would not take
    it now (its queue is full, or it is stopping): the chunk is counted ``dropped``."""


class WriteBackStats(NamedTuple):
    """Counters since the write-back started (for logs and metrics), plus what is pending."""

    queued: int  # accepted for writing
    written: int  # stored by the store
    refused: int  # the store could not store the chunk (too large, backend failed)
    not_admitted: int  # the store's admission said not yet (nothing computed)
    deduplicated: int  # the same key was already pending (nothing computed twice)
    dropped: int  # the queue was full, the write-back closed, or the model's owner refused the computation
    failed: int  # computing or storing raised (logged)
    pending: int  # queued or being written now


class WriteBack:
    """A bounded queue drained by one daemon thread that calls ``store.put``. The thread
    holds the write-back only weakly between chunks, so a forgotten write-back (and its
    store) is collected and its thread ends.

    ``submit`` never blocks on the store's writes: it asks the store's admission first,
    then queues. At most ``max_queue`` keys are pending (queued or being written); beyond
    that, chunks are dropped and counted. A chunk's tensors must not be modified after
    submit (``ChunkKV`` is meant to be immutable); the store copies them when it writes.
    ``flush`` waits for everything submitted so far; ``close`` flushes and stops the thread;
    at interpreter exit pending chunks are flushed (up to ``EXIT_FLUSH_S``) and the thread
    ends (``end_at_exit``). Usable as a
    context manager. Thread-safe.
    """

    def __init__(self, store: ChunkStore, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.store = store
        self.max_queue = max_queue
        self._queue: queue.Queue[object] = queue.Queue()
        self._cond = threading.Condition()
        self._pending: set[ChunkKey] = set()
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._closed = False
        self._thread = threading.Thread(target=_work, args=(weakref.ref(self), self._queue),
                                        name="kvblend-writeback", daemon=True)
        self._thread.start()
        stop = weakref.finalize(self, self._queue.put, _STOP)  # collected: end the thread
        stop.atexit = False  # at exit the blocked daemon thread is simply abandoned
        _LIVE.add(self)

    def submit(self, key: ChunkKey, chunk: ChunkSource, tiers: tuple[str, ...] | None = None) -> bool:
        """Queue ``chunk`` (or a function computing it, called on the write-back thread)
        for ``store.put`` (into the ``tiers`` named, when given: placement, which a
        ``TieredStore`` supports). False, counted, when the key is already pending
        (deduplicated), the store would not admit it yet (not_admitted), or the queue is
        full or closed (dropped)."""
        if self._refusal(key) is None and not self.store.sighting(key):
            return self._count("not_admitted")
        with self._cond:
            refusal = self._refusal(key)
            if refusal is not None:
                self._counts[refusal] += 1
                return False
            self._pending.add(key)
            self._counts["queued"] += 1
            self._queue.put((key, chunk, tiers))
        return True

    def _refusal(self, key: ChunkKey) -> str | None:
        """Why ``key`` cannot be queued now (reads without the lock are only a hint)."""
        if key in self._pending:
            return "deduplicated"
        if self._closed or len(self._pending) >= self.max_queue:
            return "dropped"
        return None

    def _count(self, outcome: str) -> bool:
        with self._cond:
            self._counts[outcome] += 1
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted chunk has been written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then refuse later submits (dropped). Idempotent. False when chunks were
        still pending at ``timeout``."""
        with self._cond:
            closing, self._closed = not self._closed, True
        _LIVE.discard(self)
        flushed = self.flush(timeout)
        if closing:
            self._queue.put(_STOP)
            self._thread.join(timeout)
        return flushed

    def stats(self) -> WriteBackStats:
        with self._cond:
            return WriteBackStats(**self._counts, pending=len(self._pending))

    def __enter__(self) -> WriteBack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, key: ChunkKey, chunk: ChunkSource, tiers: tuple[str, ...] | None) -> str:
        try:
            computed = chunk() if callable(chunk) else chunk
            stored = self.store.put(key, computed) if tiers is None else self.store.put(key, computed, tiers=tiers)
            return "written" if stored else "refused"
        except ComputeRefused:
            return "dropped"
        except Exception as exc:  # the worker must survive any failure; it is counted and logged
            log.warning("write-back of %s failed: %s: %s", key, type(exc).__name__, exc, exc_info=True)
            return "failed"

    def _finish(self, key: ChunkKey, outcome: str) -> None:
        with self._cond:
            self._counts[outcome] += 1
            self._pending.discard(key)
            self._cond.notify_all()


def _work(ref: weakref.ref[WriteBack], items: queue.Queue[object]) -> None:
    """The worker: holds its write-back only while writing one chunk."""
    while True:
        item = items.get()
        wb = ref()
        if item is _STOP or wb is None:
            return
        key, chunk, tiers = item  # type: ignore[misc]
        wb._finish(key, wb._write(key, chunk, tiers))
        del wb, item, chunk


_LIVE: weakref.WeakSet[WriteBack] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """``end_at_exit`` every live write-back."""
    for wb in list(_LIVE):
        end_at_exit(wb)


def end_at_exit(wb: WriteBack) -> None:
    """Write what is pending (up to ``EXIT_FLUSH_S``), then end the thread: a daemon thread
    still alive (blocked in its queue, after torch and safetensors work) while the
    interpreter tears down aborted the process now and then ("terminate called without an
    active exception", exit -6; about one exit in 15 with 16 at once on 2 cores)."""
    if not wb.close(EXIT_FLUSH_S):
        log.warning("write-back: %d chunks not written at exit", wb.stats().pending)
