from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from kvblend.store import ChunkKV, DiskStore, MemoryStore, WriteBack
from kvblend.store.keys import ChunkKey

from tests.store.helpers import keyed

REPO = Path(__file__).resolve().parents[2]


class GatedStore(MemoryStore):
    """A memory tier whose puts wait for a gate, to hold the write-back thread busy."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.gate = threading.Event()
        self.put_threads: list[str] = []

    def put(self, key: ChunkKey, chunk: ChunkKV) -> bool:
        self.put_threads.append(threading.current_thread().name)
        self.gate.wait(10)
        return super().put(key, chunk)


def test_submit_returns_at_once_and_flush_waits() -> None:
    store = GatedStore()
    wb = WriteBack(store, max_queue=8)
    pairs = [keyed(i) for i in range(3)]
    assert all(wb.submit(k, c) for k, c in pairs)
    assert not wb.flush(timeout=0.05)  # still blocked in put
    store.gate.set()
    assert wb.flush(timeout=5)
    assert all(store.get(k) is not None for k, _ in pairs)
    assert set(store.put_threads) == {"kvblend-writeback"}  # never on the caller's thread
    assert wb.stats()._asdict() == {"queued": 3, "written": 3, "refused": 0, "not_admitted": 0,
                                    "deduplicated": 0, "dropped": 0, "failed": 0, "pending": 0}
    wb.close()


def test_full_queue_drops_and_counts() -> None:
    store = GatedStore()
    wb = WriteBack(store, max_queue=2)
    results = [wb.submit(*keyed(i)) for i in range(6)]
    # one item may already be in the worker's hands; the queue holds two more
    assert results[:2] == [True, True] and results.count(False) >= 3
    assert wb.stats().dropped == results.count(False)
    store.gate.set()
    wb.close(timeout=5)


def test_same_key_pending_twice_is_written_once() -> None:
    store = GatedStore()
    wb = WriteBack(store, max_queue=8)
    key, chunk = keyed(1)
    assert wb.submit(key, chunk) and not wb.submit(key, chunk)
    store.gate.set()
    wb.close(timeout=5)
    assert wb.stats().written == 1 and wb.stats().deduplicated == 1 and wb.stats().dropped == 0


def test_a_computed_chunk_is_computed_on_the_worker_only_when_admitted() -> None:
    from kvblend.store import StoreConfig, build_store

    store = build_store(StoreConfig(admit_after=2))
    calls: list[str] = []
    key, chunk = keyed(1)

    def compute() -> ChunkKV:
        calls.append(threading.current_thread().name)
        return chunk

    with WriteBack(store, max_queue=4) as wb:
        assert not wb.submit(key, compute)  # first sighting: not admitted, nothing computed
        assert wb.submit(key, compute) and wb.flush(5)
    assert calls == ["kvblend-writeback"] and store.get(key) is not None
    assert wb.stats().not_admitted == 1 and wb.stats().written == 1


class Exploding(MemoryStore):
    def put(self, key: ChunkKey, chunk: ChunkKV) -> bool:
        raise RuntimeError("disk on fire")


def test_failing_store_is_counted_and_the_worker_survives() -> None:
    wb = WriteBack(Exploding(1 << 20), max_queue=4)
    assert wb.submit(*keyed(1)) and wb.flush(5)
    assert wb.submit(*keyed(2)) and wb.flush(5)
    assert wb.stats().failed == 2
    wb.close()


def test_close_flushes_then_refuses() -> None:
    store = MemoryStore(1 << 30)
    with WriteBack(store, max_queue=4) as wb:
        key, chunk = keyed(1)
        wb.submit(key, chunk)
    assert store.get(key) is not None and not wb.submit(*keyed(2))
    wb.close()  # idempotent


def test_refused_puts_are_counted() -> None:
    wb = WriteBack(MemoryStore(10), max_queue=4)
    wb.submit(*keyed(1))
    wb.close(timeout=5)
    assert wb.stats().refused == 1 and wb.stats().written == 0


EXITING = """
import sys, time
from kvblend.store import DiskStore, WriteBack
from tests.store.helpers import keyed

class SlowDisk(DiskStore):
    def put(self, key, chunk):
        time.sleep(0.5)
        return super().put(key, chunk)

wb = WriteBack(SlowDisk(sys.argv[1], 1 << 30), max_queue=4)
wb.submit(*keyed(1))
"""


def test_pending_chunks_are_flushed_when_the_process_exits(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], env=env, cwd=REPO, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert DiskStore(tmp_path, 1 << 30).get(keyed(1)[0]) is not None  # no close() was called


def test_an_idle_forgotten_write_back_keeps_nothing_alive() -> None:
    import gc
    import time
    import weakref

    store = MemoryStore(1 << 30)
    wb = WriteBack(store, max_queue=4)
    assert wb.submit(*keyed(1)) and wb.flush(5)
    gone, thread = weakref.ref(store), wb._thread
    del store, wb
    for _ in range(100):  # the worker holds the write-back only while writing
        gc.collect()
        if gone() is None:
            break
        time.sleep(0.01)
    assert gone() is None
    thread.join(5)
    assert not thread.is_alive()  # and ends once its write-back is collected


def test_at_exit_the_pending_chunks_are_written_and_the_thread_ends(tmp_path: Path) -> None:
    """A write-back thread left alive while the interpreter tears down aborted the process now
    and then (exit -6, "terminate called without an active exception"): the exit hook writes
    what is pending, then ends the thread."""
    from kvblend.store import writeback

    store = DiskStore(tmp_path, 1 << 30)
    wb = WriteBack(store, max_queue=4)
    key, chunk = keyed(1)
    assert wb.submit(key, chunk)
    writeback.end_at_exit(wb)  # what the exit hook does to every live one
    assert store.get(key) is not None and not wb._thread.is_alive()
