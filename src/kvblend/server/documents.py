"""The per-tenant registry of documents stored through ``/v1/documents``.

One SQLite file (``documents.sqlite`` under the server's state directory) maps
``(tenant, id)`` to the document's text, token count, metadata and its chunks (the
``kvblend.rag`` chunker's fixed token windows: each chunk's id, store key, token count and
token ids), so that requests may name a stored document by id (it expands to its chunks,
in order, each hitting its stored KV) and the KV can be deleted from every tier. A row
written before chunking (no chunks) stands for one chunk: its whole text under
``chunk_key``. A second table indexes ``(tenant, chunk key, id)``, written in the same
transaction as the row, so "which of these keys does another document use" reads the
index, never the rows (a registry written before it is indexed once when opened).
Every query takes the tenant: one tenant can never read, list, count or delete another's
rows. Thread-safe (one connection behind a lock); the server calls it off its event loop.
``KeyedLocks`` serializes the server's check-then-put per ``(tenant, id)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Hashable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    tenant TEXT NOT NULL, id TEXT NOT NULL, sha256 TEXT NOT NULL, text TEXT NOT NULL,
    tokens INTEGER NOT NULL, chunk_key TEXT NOT NULL, metadata TEXT NOT NULL, created REAL NOT NULL,
    chunks TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (tenant, id)
)
"""
# Which documents store KV under a key: looked up by (tenant, key) when a document is
# deleted, and by (tenant, id) when a row is replaced or deleted.
_KEY_INDEX = """
CREATE TABLE IF NOT EXISTS chunk_keys (
    tenant TEXT NOT NULL, chunk_key TEXT NOT NULL, doc_id TEXT NOT NULL,
    PRIMARY KEY (tenant, chunk_key, doc_id)
) WITHOUT ROWID
"""
_KEYS_BY_DOC = "CREATE INDEX IF NOT EXISTS chunk_keys_by_doc ON chunk_keys (tenant, doc_id)"
_INDEX_ALL_ROWS = """
INSERT OR IGNORE INTO chunk_keys (tenant, chunk_key, doc_id)
SELECT d.tenant, json_extract(c.value, '$.key'), d.id FROM documents AS d, json_each(d.chunks) AS c
UNION ALL SELECT tenant, chunk_key, id FROM documents WHERE chunks = '[]'
"""
# Every put and delete, in order: other processes sharing the file (ingress replicas on one
# host) read it to keep their in-memory matching index in step (``changes_since``).
_CHANGES = """
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, doc_id TEXT NOT NULL
)
"""
KEEP_CHANGES = 100_000  # the log keeps this many; a reader further behind rebuilds from the rows
# Each tenant's documents, tokens and chunks, kept by triggers (whoever writes the file):
# the store view's totals without reading a tenant's rows. A REPLACE does not fire delete
# triggers, so the row it replaces is taken out before the insert.
_N_CHUNKS = "(CASE {0}.chunks WHEN '[]' THEN 1 ELSE json_array_length({0}.chunks) END)"
_TOTALS = (
    """CREATE TABLE IF NOT EXISTS tenant_totals (
        tenant TEXT PRIMARY KEY, documents INTEGER NOT NULL, tokens INTEGER NOT NULL, chunks INTEGER NOT NULL)""",
    f"""CREATE TRIGGER IF NOT EXISTS totals_before_insert BEFORE INSERT ON documents BEGIN
        UPDATE tenant_totals SET documents = documents - 1,
            tokens = tokens - (SELECT d.tokens FROM documents AS d WHERE d.tenant = NEW.tenant AND d.id = NEW.id),
            chunks = chunks - (SELECT {_N_CHUNKS.format('d')} FROM documents AS d
                               WHERE d.tenant = NEW.tenant AND d.id = NEW.id)
        WHERE tenant = NEW.tenant AND EXISTS (SELECT 1 FROM documents AS d WHERE d.tenant = NEW.tenant AND d.id = NEW.id);
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS totals_after_insert AFTER INSERT ON documents BEGIN
        INSERT INTO tenant_totals VALUES (NEW.tenant, 1, NEW.tokens, {_N_CHUNKS.format('NEW')})
        ON CONFLICT (tenant) DO UPDATE SET documents = documents + 1, tokens = tokens + excluded.tokens,
            chunks = chunks + excluded.chunks;
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS totals_after_delete AFTER DELETE ON documents BEGIN
        UPDATE tenant_totals SET documents = documents - 1, tokens = tokens - OLD.tokens,
            chunks = chunks - {_N_CHUNKS.format('OLD')}
        WHERE tenant = OLD.tenant;
    END""",
)
_FILL_TOTALS = f"""
INSERT INTO tenant_totals SELECT d.tenant, COUNT(*), SUM(d.tokens), SUM({_N_CHUNKS.format('d')})
FROM documents AS d GROUP BY d.tenant
"""
SCHEMA_VERSION = 2  # PRAGMA user_version: 1 = every row's keys are in chunk_keys; 2 = tenant_totals filled
KEYS_IN_USE_SQL = ("SELECT DISTINCT chunk_key FROM chunk_keys WHERE tenant = ? AND doc_id != ? "
                   "AND chunk_key IN ({marks})")
_MAX_PARAMS = 500  # keys per IN (...) query, well under SQLite's bound on parameters
_COLUMNS = "id, sha256, text, tokens, chunk_key, metadata, created, chunks"


class RegistryConflictError(Exception):
    """The row changed since the caller read it (another process stored the id meanwhile)."""


ANY = object()  # ``put(expect=ANY)``: replace whatever is there


class RegistryFullError(Exception):
    """A new document would exceed the tenant's ``limit`` of stored documents."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} stored documents per tenant")
        self.limit = limit


class StoredChunk(NamedTuple):
    """One chunk of a stored document: the rag chunk id, the store key of its KV, its ids."""

    id: str
    key: str
    token_ids: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "key": self.key, "ids": list(self.token_ids)}


class DocumentRecord(NamedTuple):
    id: str
    sha256: str
    text: str
    tokens: int
    chunk_key: str
    metadata: dict[str, Any]
    created: float
    chunks: tuple[StoredChunk, ...] = ()

    @property
    def keys(self) -> list[str]:
        """The store keys of every chunk's KV (the one ``chunk_key`` for a row without chunks)."""
        return [c.key for c in self.chunks] if self.chunks else [self.chunk_key]

    def public(self, tiers: list[str] | None = None, detail: bool = False) -> dict[str, Any]:
        """What the API returns for the owner (never the text). ``detail``: each chunk's id
        and token count; ``tiers``: the tiers holding every chunk's KV."""
        out = {"id": self.id, "object": "document", "tokens": self.tokens, "num_chunks": len(self.keys),
               "created": int(self.created), "metadata": self.metadata}
        if detail:
            out["chunks"] = ([{"id": c.id, "tokens": c.tokens} for c in self.chunks] if self.chunks
                             else [{"id": self.chunk_key, "tokens": self.tokens}])
        if tiers is not None:
            out["tiers"] = tiers
            out["tier"] = tiers[0] if tiers else None
        return out


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def default_id(text: str) -> str:
    """A stable id from the text, so that re-posting the same text is idempotent."""
    return "doc-" + text_sha256(text)[:24]


class DocumentRegistry:
    """``(tenant, id) -> DocumentRecord`` persisted in SQLite (``path=None``: in memory).

    Every method is a short indexed query or one transaction, safe to call from any thread
    (one connection behind a lock); none reads another row than the ones it names, except
    ``list`` (at most ``limit``), ``count`` (the tenant's primary-key range) and
    ``changes_since`` (at most ``limit`` log rows).

    ``put`` and ``delete`` also append ``(tenant, id)`` to a change log in their
    transaction; ``changes_since`` answers the changes other processes made (this object's
    own are left out), so several processes on one file can follow each other."""

    def __init__(self, path: str | Path | None) -> None:
        target = ":memory:"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            target = str(path)
        self._lock = threading.Lock()
        self._own: set[int] = set()  # change-log seqs this object wrote and no reader passed yet
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if path is not None else "PRAGMA journal_mode=MEMORY")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: no fsync per commit, still never corrupt
        self._migrate()

    def _migrate(self) -> None:
        """Create the tables, add the ``chunks`` column to a registry written before
        chunking, and index the keys of every row of a registry written before the index."""
        with self._transaction() as db:
            db.execute(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(documents)")}
            if "chunks" not in columns:
                db.execute("ALTER TABLE documents ADD COLUMN chunks TEXT NOT NULL DEFAULT '[]'")
            db.execute(_KEY_INDEX)
            db.execute(_KEYS_BY_DOC)
            db.execute(_CHANGES)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version < 1:
                db.execute("DELETE FROM chunk_keys")
                db.execute(_INDEX_ALL_ROWS)
            for statement in _TOTALS:
                db.execute(statement)
            if version < 2:
                db.execute("DELETE FROM tenant_totals")
                db.execute(_FILL_TOTALS)
            if version < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection, locked, inside one write transaction (rolled back on error)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def get(self, tenant: str, doc_id: str) -> DocumentRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM documents "
                "WHERE tenant = ? AND id = ?", (tenant, doc_id)).fetchone()
        return _record(row) if row else None

    def list(self, tenant: str, limit: int = 1000, after: str | None = None) -> list[DocumentRecord]:
        """The tenant's documents ordered by id, at most ``limit``, starting after ``after``."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM documents "
                "WHERE tenant = ? AND id > ? ORDER BY id LIMIT ?", (tenant, after or "", limit)).fetchall()
        return [_record(r) for r in rows]

    def count(self, tenant: str) -> int:
        with self._lock:
            return _count(self._db, tenant)

    def totals(self, tenant: str) -> tuple[int, int, int]:
        """``(documents, tokens, chunks)`` the tenant stores (kept by triggers: one row read)."""
        with self._lock:
            row = self._db.execute("SELECT documents, tokens, chunks FROM tenant_totals WHERE tenant = ?",
                                   (tenant,)).fetchone()
        return tuple(row) if row else (0, 0, 0)

    def tenants(self) -> list[str]:
        """Every tenant holding at least one document (for rebuilding indexes at startup)."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT tenant FROM documents ORDER BY tenant")]

    def put(self, tenant: str, record: DocumentRecord, limit: int | None = None, *, expect: Any = ANY) -> None:
        """Insert or replace the row and its keys in the index, in one transaction. With
        ``limit``, a new id when the tenant already holds ``limit`` documents raises
        ``RegistryFullError`` and changes nothing (replacing an existing id never does).
        ``expect``: the sha256 of the text the caller saw under the id (None: no row); if the
        row now holds a text that is neither that one nor the record's (another process stored
        other text under the id meanwhile), ``RegistryConflictError`` and nothing changes. The
        same text stored meanwhile, or the row deleted meanwhile, is no conflict."""
        row = (tenant, record.id, record.sha256, record.text, record.tokens, record.chunk_key,
               json.dumps(record.metadata), record.created,
               json.dumps([c.to_json() for c in record.chunks], separators=(",", ":")))
        keys = [(tenant, key, record.id) for key in dict.fromkeys(record.keys)]
        with self._transaction() as db:
            exists = db.execute("SELECT sha256 FROM documents WHERE tenant = ? AND id = ?",
                                (tenant, record.id)).fetchone()
            if expect is not ANY and exists is not None and exists[0] not in (expect, record.sha256):
                raise RegistryConflictError(f"document {record.id!r} changed while it was being stored")
            if limit is not None and exists is None and _count(db, tenant) >= limit:
                raise RegistryFullError(limit)
            db.execute(f"INSERT OR REPLACE INTO documents (tenant, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            db.execute("DELETE FROM chunk_keys WHERE tenant = ? AND doc_id = ?", (tenant, record.id))
            db.executemany("INSERT INTO chunk_keys (tenant, chunk_key, doc_id) VALUES (?, ?, ?)", keys)
            self._log_change(db, tenant, record.id)

    def keys_in_use(self, tenant: str, keys: list[str], except_id: str) -> set[str]:
        """Those of ``keys`` that another of the tenant's documents (not ``except_id``) stores
        its KV under (two documents may share a chunk), so deleting one keeps the other's KV.
        Reads the key index only: its cost grows with ``len(keys)``, not the tenant's rows."""
        wanted, used = list(dict.fromkeys(keys)), set()
        with self._lock:
            for i in range(0, len(wanted), _MAX_PARAMS):
                batch = wanted[i : i + _MAX_PARAMS]
                sql = KEYS_IN_USE_SQL.format(marks=", ".join("?" * len(batch)))
                used.update(r[0] for r in self._db.execute(sql, (tenant, except_id, *batch)))
        return used

    def delete(self, tenant: str, doc_id: str) -> bool:
        """Remove the row and its keys from the index; False when there was no such row."""
        with self._transaction() as db:
            cur = db.execute("DELETE FROM documents WHERE tenant = ? AND id = ?", (tenant, doc_id))
            db.execute("DELETE FROM chunk_keys WHERE tenant = ? AND doc_id = ?", (tenant, doc_id))
            if cur.rowcount > 0:
                self._log_change(db, tenant, doc_id)
        return cur.rowcount > 0

    def _log_change(self, db: sqlite3.Connection, tenant: str, doc_id: str) -> None:
        seq = db.execute("INSERT INTO changes (tenant, doc_id) VALUES (?, ?)", (tenant, doc_id)).lastrowid
        db.execute("DELETE FROM changes WHERE seq <= ?", (seq - KEEP_CHANGES,))
        self._own.add(seq)
        if len(self._own) > KEEP_CHANGES:  # nobody reads the log here (matching off): forget what it pruned
            self._own = {n for n in self._own if n > seq - KEEP_CHANGES}

    def last_change(self) -> int:
        """The change log's last sequence number (0: none yet)."""
        with self._lock:
            return self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0]

    def changes_since(self, seq: int, limit: int = 1000) -> tuple[list[tuple[str, str]], int] | None:
        """``([(tenant, id), ...], last seq read)``: the documents other processes put or
        deleted after ``seq``, oldest first, from at most ``limit`` log rows (read again
        from the returned seq for more). None when the log no longer reaches back to
        ``seq`` (more than ``KEEP_CHANGES`` behind) or ends before it (the file was replaced):
        the reader must start again from the rows themselves."""
        with self._lock:
            rows = self._db.execute("SELECT seq, tenant, doc_id FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
                                    (seq, limit)).fetchall()
            # seqs are contiguous (a rolled-back insert gives its number back), so a gap after
            # ``seq`` is pruning; a log that ends before ``seq`` is another file (a restore)
            if rows and rows[0][0] > seq + 1:
                return None
            if not rows and seq > 0 and self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0] < seq:
                return None
            last = rows[-1][0] if rows else seq
            theirs = [(tenant, doc_id) for n, tenant, doc_id in rows if n not in self._own]
            self._own = {n for n in self._own if n > last}
        return theirs, last

    def close(self) -> None:
        with self._lock:
            self._db.close()


class KeyedLocks:
    """One ``asyncio.Lock`` per key (e.g. ``(tenant, id)``), kept only while it is held or
    awaited: ``async with locks.hold(key):`` runs one holder of a key at a time, in order.
    For one event loop (not thread-safe)."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            users = self._locks[key][1] - 1
            if users:
                self._locks[key] = (lock, users)
            else:
                del self._locks[key]


def new_record(doc_id: str, text: str, chunks: list[StoredChunk], metadata: dict[str, Any]) -> DocumentRecord:
    """A record for ``text`` cut into ``chunks`` (at least one); ``chunk_key`` is the first's."""
    if not chunks:
        raise ValueError("a stored document has at least one chunk")
    return DocumentRecord(doc_id, text_sha256(text), text, sum(c.tokens for c in chunks), chunks[0].key,
                          dict(metadata), time.time(), tuple(chunks))


def _count(db: sqlite3.Connection, tenant: str) -> int:
    return int(db.execute("SELECT COUNT(*) FROM documents WHERE tenant = ?", (tenant,)).fetchone()[0])


def _record(row: tuple[Any, ...]) -> DocumentRecord:
    chunks = tuple(StoredChunk(c["id"], c["key"], tuple(int(t) for t in c["ids"])) for c in json.loads(row[7]))
    return DocumentRecord(row[0], row[1], row[2], int(row[3]), row[4], json.loads(row[5]), float(row[6]), chunks)
