"""Background write-back of newly computed chunk KV, off the request's critical path."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import NamedTuple

from kvblend.store.base import ChunkStore
from kvblend.store.chunk import ChunkKV
from kvblend.store.keys import ChunkKey

log = logging.getLogger(__name__)
_STOP = object()
EXIT_FLUSH_S = 30.0


class WriteBackStats(NamedTuple):
    submitted: int
    written: int
    refused: int  # the store did not admit or could not store the chunk
    dropped: int  # the queue was full, or a put of the same key was already pending
    failed: int  # put raised
    pending: int


class WriteBack:
    """A bounded queue drained by one daemon thread that calls ``store.put``.

    ``submit`` never blocks: when the queue is full (or the key is already queued) the
    chunk is dropped and counted. The chunk's tensors must not be modified after submit
    (``ChunkKV`` is meant to be immutable); the store copies them when it writes.
    ``flush`` waits for everything submitted so far; ``close`` flushes and stops the thread;
    at interpreter exit pending chunks are flushed (up to ``EXIT_FLUSH_S``). Usable as a
    context manager.
    """

    def __init__(self, store: ChunkStore, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.store = store
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._cond = threading.Condition()
        self._pending: set[ChunkKey] = set()
        self._counts = dict.fromkeys(("submitted", "written", "refused", "dropped", "failed"), 0)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvblend-writeback", daemon=True)
        self._thread.start()
        atexit.register(self._flush_at_exit)

    def submit(self, key: ChunkKey, chunk: ChunkKV) -> bool:
        """Queue ``chunk`` for ``store.put``; False (counted as dropped) when the queue is
        full, the key is already queued, or the write-back is closed."""
        with self._cond:
            if self._closed or key in self._pending:
                self._counts["dropped"] += 1
                return False
            try:
                self._queue.put_nowait((key, chunk))
            except queue.Full:
                self._counts["dropped"] += 1
                return False
            self._pending.add(key)
            self._counts["submitted"] += 1
        return True

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
        """Flush, then stop the worker. Idempotent; later submits are dropped."""
        flushed = self.flush(timeout)
        with self._cond:
            if self._closed:
                return flushed
            self._closed = True
        atexit.unregister(self._flush_at_exit)
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return flushed

    def stats(self) -> WriteBackStats:
        with self._cond:
            return WriteBackStats(**self._counts, pending=len(self._pending))

    def __enter__(self) -> WriteBack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush_at_exit(self) -> None:
        if not self.flush(EXIT_FLUSH_S):
            log.warning("write-back: %d chunks not written at exit", self.stats().pending)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            key, chunk = item  # type: ignore[misc]
            self._finish(key, self._write(key, chunk))

    def _write(self, key: ChunkKey, chunk: ChunkKV) -> str:
        try:
            return "written" if self.store.put(key, chunk) else "refused"
        except Exception:  # the worker must survive any store failure
            log.exception("write-back of %s failed", key)
            return "failed"

    def _finish(self, key: ChunkKey, outcome: str) -> None:
        with self._cond:
            self._counts[outcome] += 1
            self._pending.discard(key)
            self._cond.notify_all()
