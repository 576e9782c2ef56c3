"""The retrieval catalog: which chunks and documents are committed, per tenant (SQLite).

The catalog is the commit record of ingestion. A batch's chunk rows, and the row of each
document whose chunks are all stored, go in one transaction, written after the batch's
vectors and KV: a crash before it leaves at most unreferenced vectors and KV entries,
which a search ignores and the next ingest reconciles; never a row whose data is missing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvblend.store.keys import validate_tenant

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    tenant TEXT NOT NULL, chunk_id TEXT NOT NULL, source TEXT NOT NULL, ordinal INTEGER NOT NULL,
    text TEXT NOT NULL, token_ids BLOB NOT NULL, n_tokens INTEGER NOT NULL,
    retrievals INTEGER NOT NULL DEFAULT 0, kv_ready INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, chunk_id));
CREATE TABLE IF NOT EXISTS documents (
    tenant TEXT NOT NULL, source TEXT NOT NULL, sha256 TEXT NOT NULL, chunk_ids TEXT NOT NULL,
    n_tokens INTEGER NOT NULL, PRIMARY KEY (tenant, source));
CREATE TABLE IF NOT EXISTS doc_chunks (
    tenant TEXT NOT NULL, chunk_id TEXT NOT NULL, source TEXT NOT NULL,
    PRIMARY KEY (tenant, chunk_id, source)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS doc_chunks_by_source ON doc_chunks (tenant, source);
CREATE TRIGGER IF NOT EXISTS doc_chunks_on_insert AFTER INSERT ON documents BEGIN
    DELETE FROM doc_chunks WHERE tenant = NEW.tenant AND source = NEW.source;
    INSERT OR IGNORE INTO doc_chunks SELECT NEW.tenant, j.value, NEW.source FROM json_each(NEW.chunk_ids) AS j;
END;
CREATE TRIGGER IF NOT EXISTS doc_chunks_on_delete AFTER DELETE ON documents BEGIN
    DELETE FROM doc_chunks WHERE tenant = OLD.tenant AND source = OLD.source;
END;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (tenant TEXT PRIMARY KEY, version INTEGER NOT NULL);
"""


_MAX_PARAMS = 500  # ids per IN (...) query, well under SQLite's bound on parameters


class ChunkRow(NamedTuple):
    """A committed chunk: where it came from, its text and the ids the engine is given."""

    chunk_id: str
    source: str
    ordinal: int
    text: str
    token_ids: tuple[int, ...]
    retrievals: int
    kv_ready: bool


@dataclass(frozen=True)
class NewChunk:
    """A chunk to commit."""

    chunk_id: str
    source: str
    ordinal: int
    text: str
    token_ids: tuple[int, ...]
    kv_ready: bool


@dataclass(frozen=True)
class DocumentRow:
    """A committed document: its content hash and its chunks in order."""

    source: str
    sha256: str
    chunk_ids: tuple[str, ...]
    n_tokens: int


def _ids_blob(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype=np.int64).tobytes()


def _blob_ids(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype=np.int64).tolist())


class Catalog:
    """SQLite catalog at ``path`` (WAL). Thread-safe; one writing process at a time."""

    def __init__(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self._index_chunks()

    def _index_chunks(self) -> None:
        """Fill ``doc_chunks`` (which documents use a chunk) once for a catalog written
        before it existed; from then on triggers on ``documents`` keep it, whichever
        kvblend version writes the file (an older one that knows nothing of it included)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._db.execute("SELECT value FROM meta WHERE key = 'doc_chunks'").fetchone() is None:
                    self._db.execute("DELETE FROM doc_chunks")
                    self._db.execute("INSERT OR IGNORE INTO doc_chunks SELECT d.tenant, j.value, d.source "
                                     "FROM documents AS d, json_each(d.chunk_ids) AS j")
                    self._db.execute("INSERT INTO meta VALUES ('doc_chunks', '1')")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # ----- meta ------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def version(self, tenant: str) -> int:
        """Bumped by every commit that changes the tenant's chunks (caches key on it)."""
        row = self._db.execute("SELECT version FROM versions WHERE tenant = ?", (validate_tenant(tenant),)).fetchone()
        return row[0] if row else 0

    # ----- reads -----------------------------------------------------------------------
    def document(self, tenant: str, source: str) -> DocumentRow | None:
        row = self._db.execute("SELECT source, sha256, chunk_ids, n_tokens FROM documents WHERE tenant = ? AND source = ?",
                               (validate_tenant(tenant), source)).fetchone()
        return DocumentRow(row[0], row[1], tuple(json.loads(row[2])), row[3]) if row else None

    def documents(self, tenant: str) -> list[DocumentRow]:
        rows = self._db.execute("SELECT source, sha256, chunk_ids, n_tokens FROM documents WHERE tenant = ? ORDER BY source",
                                (validate_tenant(tenant),)).fetchall()
        return [DocumentRow(r[0], r[1], tuple(json.loads(r[2])), r[3]) for r in rows]

    def sources(self, tenant: str) -> list[str]:
        """The source of every committed document of ``tenant``."""
        return [r[0] for r in self._db.execute("SELECT source FROM documents WHERE tenant = ? ORDER BY source",
                                               (validate_tenant(tenant),))]

    def existing(self, tenant: str, chunk_ids: Iterable[str]) -> set[str]:
        """The subset of ``chunk_ids`` already committed for ``tenant``."""
        ids = list(dict.fromkeys(chunk_ids))
        found: set[str] = set()
        for i in range(0, len(ids), 500):
            part = ids[i : i + 500]
            found.update(r[0] for r in self._db.execute(
                f"SELECT chunk_id FROM chunks WHERE tenant = ? AND chunk_id IN ({','.join('?' * len(part))})",
                (validate_tenant(tenant), *part)))
        return found

    def chunks(self, tenant: str, chunk_ids: Sequence[str]) -> list[ChunkRow]:
        """Committed chunks among ``chunk_ids``, in the order given (unknown ids dropped)."""
        rows = {}
        for i in range(0, len(chunk_ids), 500):
            part = list(chunk_ids[i : i + 500])
            for r in self._db.execute(
                "SELECT chunk_id, source, ordinal, text, token_ids, retrievals, kv_ready FROM chunks "
                f"WHERE tenant = ? AND chunk_id IN ({','.join('?' * len(part))})", (validate_tenant(tenant), *part)):
                rows[r[0]] = ChunkRow(r[0], r[1], r[2], r[3], _blob_ids(r[4]), r[5], bool(r[6]))
        return [rows[c] for c in chunk_ids if c in rows]

    def first_ids(self, tenant: str, limit: int) -> list[str]:
        """Up to ``limit`` committed chunk ids of ``tenant`` (whichever SQLite finds first)."""
        rows = self._db.execute("SELECT chunk_id FROM chunks WHERE tenant = ? LIMIT ?",
                                (validate_tenant(tenant), limit)).fetchall()
        return [r[0] for r in rows]

    def all_texts(self, tenant: str) -> tuple[list[str], list[str]]:
        """Every committed chunk's id and text (for the BM25 index)."""
        rows = self._db.execute("SELECT chunk_id, text FROM chunks WHERE tenant = ? ORDER BY chunk_id",
                                (validate_tenant(tenant),)).fetchall()
        return [r[0] for r in rows], [r[1] for r in rows]

    def count(self, tenant: str) -> tuple[int, int, int]:
        """(documents, chunks, tokens) committed for ``tenant``."""
        t = validate_tenant(tenant)
        docs = self._db.execute("SELECT COUNT(*) FROM documents WHERE tenant = ?", (t,)).fetchone()[0]
        n, tokens = self._db.execute("SELECT COUNT(*), COALESCE(SUM(n_tokens), 0) FROM chunks WHERE tenant = ?",
                                     (t,)).fetchone()
        return docs, n, tokens

    # ----- writes ----------------------------------------------------------------------
    def commit(self, tenant: str, chunks: Sequence[NewChunk], documents: Sequence[DocumentRow] = (),
               orphans: Sequence[str] = ()) -> None:
        """One transaction: add ``chunks``, write ``documents`` (replacing rows of the same
        source), drop ``orphans`` (chunks no document refers to any more)."""
        validate_tenant(tenant)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO chunks (tenant, chunk_id, source, ordinal, text, token_ids, n_tokens, kv_ready)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(tenant, c.chunk_id, c.source, c.ordinal, c.text, _ids_blob(c.token_ids), len(c.token_ids),
                      int(c.kv_ready)) for c in chunks])
                self._db.executemany("INSERT OR REPLACE INTO documents VALUES (?, ?, ?, ?, ?)",
                                     [(tenant, d.source, d.sha256, json.dumps(list(d.chunk_ids)), d.n_tokens)
                                      for d in documents])

                self._db.executemany("DELETE FROM chunks WHERE tenant = ? AND chunk_id = ?", [(tenant, c) for c in orphans])
                self._db.execute("INSERT INTO versions VALUES (?, 1) ON CONFLICT(tenant) DO UPDATE SET version = version + 1",
                                 (tenant,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def delete_document(self, tenant: str, source: str) -> list[str]:
        """Remove a document; returns the chunk ids no other document refers to (now removed)."""
        doc = self.document(tenant, source)
        if doc is None:
            return []
        orphans = self.orphans(tenant, doc.chunk_ids, exclude_source=source)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM documents WHERE tenant = ? AND source = ?", (tenant, source))
            self._db.executemany("DELETE FROM chunks WHERE tenant = ? AND chunk_id = ?", [(tenant, c) for c in orphans])
            self._db.execute("INSERT INTO versions VALUES (?, 1) ON CONFLICT(tenant) DO UPDATE SET version = version + 1",
                             (tenant,))
            self._db.execute("COMMIT")
        return orphans

    def orphans(self, tenant: str, candidates: Iterable[str], exclude_source: str) -> list[str]:
        """Those of ``candidates`` that no document other than ``exclude_source`` refers to
        (from ``doc_chunks``: its cost grows with the candidates, not the corpus; re-ingesting
        a changed corpus asks this once per document)."""
        wanted = list(dict.fromkeys(candidates))
        used: set[str] = set()
        with self._lock:
            for i in range(0, len(wanted), _MAX_PARAMS):
                batch = wanted[i : i + _MAX_PARAMS]
                used.update(r[0] for r in self._db.execute(
                    "SELECT DISTINCT chunk_id FROM doc_chunks "
                    f"WHERE tenant = ? AND source != ? AND chunk_id IN ({', '.join('?' * len(batch))})",
                    (tenant, exclude_source, *batch)))
        return [c for c in wanted if c not in used]

    def unreferenced(self, tenant: str) -> list[str]:
        """Committed chunks no document refers to: left by a document whose ingest stopped
        part-way (the file changed or vanished while read, or the process was killed)."""
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT chunk_id FROM chunks WHERE tenant = ? EXCEPT SELECT chunk_id FROM doc_chunks WHERE tenant = ?",
                (validate_tenant(tenant), tenant))]

    def record_retrievals(self, tenant: str, chunk_ids: Sequence[str]) -> None:
        with self._lock:
            self._db.executemany("UPDATE chunks SET retrievals = retrievals + 1 WHERE tenant = ? AND chunk_id = ?",
                                 [(validate_tenant(tenant), c) for c in chunk_ids])

    def mark_kv_ready(self, tenant: str, chunk_ids: Sequence[str]) -> None:
        with self._lock:
            self._db.executemany("UPDATE chunks SET kv_ready = 1 WHERE tenant = ? AND chunk_id = ?",
                                 [(validate_tenant(tenant), c) for c in chunk_ids])

    def close(self) -> None:
        self._db.close()


class CatalogReader:
    """A read-only view of a catalog that ``kvblend ingest`` writes in another process
    (SQLite's read-only mode: the reader never writes the index folder). Opened by the
    first read that finds the file; before, there is nothing to read. Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection | None:
        if self._db is None and self.path.is_file():
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False, timeout=30)
        return self._db

    def versions(self) -> dict[str, int]:
        """Each tenant's version (bumped by every commit that changes its chunks); empty
        before the catalog exists."""
        with self._lock:
            db = self._conn()
            if db is None:
                return {}
            try:
                return dict(db.execute("SELECT tenant, version FROM versions").fetchall())
            except sqlite3.OperationalError:  # created, its tables not yet
                return {}

    def chunk_ids(self, tenant: str) -> set[str]:
        """Every committed chunk id of ``tenant``."""
        with self._lock:
            db = self._conn()
            if db is None:
                return set()
            return {r[0] for r in db.execute("SELECT chunk_id FROM chunks WHERE tenant = ?", (validate_tenant(tenant),))}

    def chunks(self, tenant: str, chunk_ids: Sequence[str]) -> list[ChunkRow]:
        """The committed chunks among ``chunk_ids`` (unknown ids dropped)."""
        rows: list[ChunkRow] = []
        with self._lock:
            db = self._conn()
            if db is None:
                return rows
            for i in range(0, len(chunk_ids), _MAX_PARAMS):
                part = list(chunk_ids[i : i + _MAX_PARAMS])
                rows += [ChunkRow(r[0], r[1], r[2], r[3], _blob_ids(r[4]), r[5], bool(r[6])) for r in db.execute(
                    "SELECT chunk_id, source, ordinal, text, token_ids, retrievals, kv_ready FROM chunks "
                    f"WHERE tenant = ? AND chunk_id IN ({','.join('?' * len(part))})", (validate_tenant(tenant), *part))]
        return rows

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
