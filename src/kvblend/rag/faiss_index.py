"""The embedded vector index: a SQLite log of vectors (the durable truth) and, per tenant,
an in-memory faiss index rebuilt from it or read from a snapshot.

    upsert  -> one SQLite transaction (durable), then the tenant's faiss index
    search  -> exact inner product (IndexFlatIP) up to ``ivf_min`` vectors, IVF above it
    flush   -> per-tenant snapshot (faiss file + the log version it reflects, atomic rename)
    open    -> snapshot when its version equals the log's, otherwise a rebuild from the log
    follow  -> a tenant whose log version moved (another process wrote it: the server
               reading while ``kvblend ingest`` writes) is reloaded the same way; an IVF
               one from the writer's snapshot (never trained per search), kept until then
               while the writer lives (``pending.lock``), rebuilt from the log on its own
               training once no process holds unflushed changes (a killed ingest)

Why faiss and not LanceDB or Qdrant's local mode: see docs/retrieval.md (measured).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import faiss
import numpy as np

from kvblend.rag.vector_index import ScoredId
from kvblend.store.keys import validate_tenant

IVF_MIN = 20_000  # below this many vectors a tenant's search is exact
PENDING_LOCK = "pending.lock"
log = logging.getLogger(__name__)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS vectors (
    id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, chunk_id TEXT NOT NULL, vec BLOB NOT NULL,
    UNIQUE (tenant, chunk_id));
CREATE TABLE IF NOT EXISTS versions (tenant TEXT PRIMARY KEY, version INTEGER NOT NULL);
"""


class _TenantIndex:
    """One tenant's in-memory index and its row-id -> chunk-id map, as of log ``version``."""

    def __init__(self, index: faiss.Index, names: dict[int, str], trained_at: int, version: int) -> None:
        self.index = index
        self.names = names
        self.rows = {c: i for i, c in names.items()}
        self.trained_at = trained_at  # vectors when the IVF was trained (0: exact index)
        self.version = version


class _PendingLock:
    """``pending.lock``: a process holds it shared from its first write to the log until its
    flush has written the snapshots (the kernel drops it when the process dies), so a reader
    can tell a writer that will still write its snapshot from one killed before it did."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a+")
        self.held = False

    def hold(self) -> None:
        if not self.held:
            fcntl.flock(self._file, fcntl.LOCK_SH)  # waits only out another's `alone`
            self.held = True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self.held = False

    @contextlib.contextmanager
    def alone(self) -> Iterator[bool]:
        """Whether no process (this one included) holds unflushed changes; while True, none
        can start writing."""
        if self.held:
            yield False
            return
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def close(self) -> None:
        self.release()
        self._file.close()


def _exact(dim: int) -> faiss.Index:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))


def _nlist(n: int) -> int:
    return int(min(4096, max(64, 2 * math.sqrt(n))))


def _emptied(index: faiss.Index) -> faiss.Index:
    """A copy of ``index`` without its vectors: an IVF keeps its training."""
    copy = faiss.clone_index(index)
    copy.reset()
    return copy


def _ivf(dim: int, vectors: np.ndarray, seed: int = 0) -> faiss.Index:
    """An IVF-Flat index trained on (a sample of) ``vectors``; searches probe 1/16 of the lists."""
    nlist = _nlist(len(vectors))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    sample = vectors
    if len(vectors) > 64 * nlist:
        sample = vectors[np.random.default_rng(seed).choice(len(vectors), 64 * nlist, replace=False)]
    index.cp.niter = 10
    index.train(np.ascontiguousarray(sample))
    index.nprobe = max(8, nlist // 16)
    return index


class FaissIndex:
    """``VectorIndex`` in ``folder``: ``vectors.sqlite`` plus ``<tenant>.faiss`` snapshots.
    Thread-safe (one lock); one writing process at a time (SQLite serialises writers)."""

    def __init__(self, folder: Path, dim: int, ivf_min: int = IVF_MIN) -> None:
        if dim < 1:
            raise ValueError("dim must be >= 1")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dim = dim
        self.ivf_min = ivf_min
        self._db = sqlite3.connect(self.folder / "vectors.sqlite", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self._tenants: dict[str, _TenantIndex] = {}
        self._dirty: set[str] = set()
        self._behind: set[str] = set()  # rebuilt from the log: their snapshot is behind it
        self._pending = _PendingLock(self.folder / PENDING_LOCK)

    # ----- durable log ----------------------------------------------------------------
    def _version(self, tenant: str) -> int:
        row = self._db.execute("SELECT version FROM versions WHERE tenant = ?", (tenant,)).fetchone()
        return row[0] if row else 0

    def _bump(self, tenant: str) -> None:
        self._db.execute("INSERT INTO versions VALUES (?, 1) ON CONFLICT(tenant) DO UPDATE SET version = version + 1",
                         (tenant,))

    def _rows(self, tenant: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
        cur = self._db.execute("SELECT id, chunk_id, vec FROM vectors WHERE tenant = ? ORDER BY id", (tenant,))
        ids, names, vecs = [], [], []
        for rid, cid, blob in cur:
            ids.append(rid)
            names.append(cid)
            vecs.append(np.frombuffer(blob, dtype=np.float32))
        mat = np.stack(vecs) if vecs else np.zeros((0, self.dim), np.float32)  # (N, dim)
        return np.asarray(ids, dtype=np.int64), mat, names

    # ----- per-tenant index -------------------------------------------------------------
    def _snapshot_paths(self, tenant: str) -> tuple[Path, Path]:
        return self.folder / f"{tenant}.faiss", self.folder / f"{tenant}.json"

    def _load_snapshot(self, tenant: str) -> _TenantIndex | None:
        index_path, meta_path = self._snapshot_paths(tenant)
        try:
            meta = json.loads(meta_path.read_text())
            if meta["version"] != self._version(tenant) or meta["dim"] != self.dim:
                return None
            index = faiss.read_index(str(index_path))
        except (OSError, ValueError, KeyError, RuntimeError):
            return None
        names = dict(self._db.execute("SELECT id, chunk_id FROM vectors WHERE tenant = ?", (tenant,)).fetchall())
        if index.ntotal != len(names):
            return None
        return _TenantIndex(index, names, meta["trained_at"], meta["version"])

    def _rebuild(self, tenant: str, like: _TenantIndex | None = None) -> _TenantIndex:
        """The tenant from the log, on ``like``'s training when given (no training per
        search), else trained for its size."""
        version = self._version(tenant)  # before the rows: a write in between only makes it look stale
        ids, mat, names = self._rows(tenant)
        if version:
            self._behind.add(tenant)
        if like is not None:
            index, trained = _emptied(like.index), like.trained_at
        elif len(ids) >= self.ivf_min:
            index, trained = _ivf(self.dim, mat), len(ids)
        else:
            index, trained = _exact(self.dim), 0
        if len(ids):
            index.add_with_ids(mat, ids)
        return _TenantIndex(index, dict(zip(ids.tolist(), names)), trained, version)

    def _tenant(self, tenant: str) -> _TenantIndex:
        """The tenant's index, reloaded when another process changed its log since."""
        validate_tenant(tenant)
        t = self._tenants.get(tenant)
        if t is None:
            t = self._load_snapshot(tenant) or self._rebuild(tenant)
            self._tenants[tenant] = t
        elif t.version != self._version(tenant):
            fresh = self._load_snapshot(tenant)
            if fresh is None and not t.trained_at and self._count(tenant) < self.ivf_min:
                fresh = self._rebuild(tenant)  # exact: cheap; an IVF waits for the writer's snapshot
            if fresh is None:
                fresh = self._recover(tenant, t)
            if fresh is not None:
                self._tenants[tenant] = t = fresh
        return t

    def _recover(self, tenant: str, t: _TenantIndex) -> _TenantIndex | None:
        """``t`` rebuilt from the log on its own training when no process holds unflushed
        changes: the writer that moved the log died before its snapshot (a killed ingest),
        which would otherwise never come. None while a writer may still write it."""
        with self._pending.alone() as alone:
            if not alone:
                return None
        fresh = self._load_snapshot(tenant)  # flushed since the first look
        if fresh is not None:
            return fresh
        start, n = time.perf_counter(), self._count(tenant)
        log.warning("vector index %s: tenant %r's snapshot is behind its log and no writer holds changes (an "
                    "ingest stopped before its flush): rebuilding its %d vectors from the log", self.folder, tenant, n)
        fresh = self._rebuild(tenant, like=t)
        log.warning("vector index %s: tenant %r rebuilt (%d vectors) in %.1f s", self.folder, tenant,
                    fresh.index.ntotal, time.perf_counter() - start)
        return fresh

    def _count(self, tenant: str) -> int:
        return self._db.execute("SELECT COUNT(*) FROM vectors WHERE tenant = ?", (tenant,)).fetchone()[0]

    def _maybe_retrain(self, tenant: str, t: _TenantIndex) -> None:
        n = t.index.ntotal
        if (t.trained_at == 0 and n >= self.ivf_min) or (t.trained_at and n >= 4 * t.trained_at):
            self._tenants[tenant] = self._rebuild(tenant)

    # ----- VectorIndex ------------------------------------------------------------------
    def upsert(self, tenant: str, chunk_ids: Sequence[str], vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # (n, dim)
        if vectors.ndim != 2 or vectors.shape != (len(chunk_ids), self.dim):
            raise ValueError(f"vectors must be ({len(chunk_ids)}, {self.dim}); got {vectors.shape}")
        if not len(chunk_ids):
            return
        with self._lock:
            t = self._tenant(tenant)
            self._pending.hold()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for cid, vec in zip(chunk_ids, vectors):
                    self._db.execute("INSERT INTO vectors (tenant, chunk_id, vec) VALUES (?, ?, ?) ON CONFLICT"
                                     "(tenant, chunk_id) DO UPDATE SET vec = excluded.vec", (tenant, cid, vec.tobytes()))
                self._bump(tenant)
                version = self._version(tenant)
                rows = dict(self._db.execute(
                    f"SELECT chunk_id, id FROM vectors WHERE tenant = ? AND chunk_id IN ({','.join('?' * len(chunk_ids))})",
                    (tenant, *chunk_ids)).fetchall())
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            ids = np.asarray([rows[c] for c in chunk_ids], dtype=np.int64)
            t.index.remove_ids(ids)
            t.index.add_with_ids(vectors, ids)
            for cid, rid in zip(chunk_ids, ids.tolist()):
                t.names[rid], t.rows[cid] = cid, rid
            t.version = version
            self._dirty.add(tenant)
            self._maybe_retrain(tenant, t)

    def delete(self, tenant: str, chunk_ids: Sequence[str]) -> int:
        with self._lock:
            t = self._tenant(tenant)
            ids = [t.rows[c] for c in chunk_ids if c in t.rows]
            if not ids:
                return 0
            self._pending.hold()
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM vectors WHERE id = ?", [(i,) for i in ids])
            self._bump(tenant)
            version = self._version(tenant)
            self._db.execute("COMMIT")
            t.index.remove_ids(np.asarray(ids, dtype=np.int64))
            for rid in ids:
                t.rows.pop(t.names.pop(rid), None)
            t.version = version
            self._dirty.add(tenant)
            return len(ids)

    def search(self, tenant: str, vector: np.ndarray, k: int) -> list[ScoredId]:
        if k < 1:
            raise ValueError("k must be >= 1")
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim)  # (1, dim)
        with self._lock:
            t = self._tenant(tenant)
            if t.index.ntotal == 0:
                return []
            scores, ids = t.index.search(query, min(k, t.index.ntotal))  # (1, k) each
            return [ScoredId(t.names[i], float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def count(self, tenant: str) -> int:
        with self._lock:
            return self._tenant(tenant).index.ntotal

    def ids(self, tenant: str) -> set[str]:
        with self._lock:
            return set(self._tenant(tenant).rows)

    def flush(self) -> None:
        """Write a snapshot of every changed tenant, then of those rebuilt from the log because
        theirs was behind it (a killed ingest) while no process holds unflushed changes."""
        with self._lock:
            for tenant in sorted(self._dirty):
                self._write_snapshot(tenant)
            self._dirty.clear()
            self._pending.release()
            if self._behind:
                self._repair()

    def _repair(self) -> None:
        with self._pending.alone() as alone:
            if not alone:
                return  # a writer's own flush will write them
            for tenant in sorted(self._behind):
                if self._tenants[tenant].version == self._version(tenant):
                    self._write_snapshot(tenant)
            self._behind.clear()

    def _write_snapshot(self, tenant: str) -> None:
        """``<tenant>.faiss`` and ``<tenant>.json`` (the log version the index reflects),
        each atomic: a temp file, then a rename."""
        t = self._tenants[tenant]
        index_path, meta_path = self._snapshot_paths(tenant)
        tmp = index_path.with_suffix(".faiss.tmp")
        faiss.write_index(t.index, str(tmp))
        os.replace(tmp, index_path)
        meta = {"version": t.version, "dim": self.dim, "trained_at": t.trained_at}
        tmp_meta = meta_path.with_suffix(".json.tmp")
        tmp_meta.write_text(json.dumps(meta))
        os.replace(tmp_meta, meta_path)
        self._behind.discard(tenant)

    def close(self) -> None:
        self.flush()
        self._pending.close()
        self._db.close()
