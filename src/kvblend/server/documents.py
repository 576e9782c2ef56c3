"""The per-tenant registry of documents stored through ``/v1/documents``.

One SQLite file (``documents.sqlite`` under the server's state directory) maps
``(tenant, id)`` to the document's text, token count, metadata and its chunks (the
``kvblend.rag`` chunker's fixed token windows: each chunk's id, store key, token count and
token ids), so that requests may name a stored document by id (it expands to its chunks,
in order, each hitting its stored KV) and the KV can be deleted from every tier. A row
written before chunking (no chunks) stands for one chunk: its whole text under
``chunk_key``.
Every query takes the tenant: one tenant can never read, list, count or delete another's
rows. Thread-safe (one connection behind a lock).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
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
_COLUMNS = "id, sha256, text, tokens, chunk_key, metadata, created, chunks"


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
    """``(tenant, id) -> DocumentRecord`` persisted in SQLite (``path=None``: in memory)."""

    def __init__(self, path: str | Path | None) -> None:
        target = ":memory:"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            target = str(path)
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if path is not None else "PRAGMA journal_mode=MEMORY")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(documents)")}
        if "chunks" not in columns:  # a registry written before documents were chunked
            self._db.execute("ALTER TABLE documents ADD COLUMN chunks TEXT NOT NULL DEFAULT '[]'")
        self._lock = threading.Lock()

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
            return int(self._db.execute("SELECT COUNT(*) FROM documents WHERE tenant = ?", (tenant,)).fetchone()[0])

    def put(self, tenant: str, record: DocumentRecord) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO documents (tenant, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (tenant, record.id, record.sha256, record.text, record.tokens, record.chunk_key,
                 json.dumps(record.metadata), record.created,
                 json.dumps([c.to_json() for c in record.chunks], separators=(",", ":"))))

    def keys_in_use(self, tenant: str, keys: list[str], except_id: str) -> set[str]:
        """Those of ``keys`` that another of the tenant's documents (not ``except_id``) stores
        its KV under (two documents may share a chunk), so deleting one keeps the other's KV."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM documents WHERE tenant = ? AND id != ?",
                                    (tenant, except_id)).fetchall()
        wanted = set(keys)
        return {k for r in rows for k in _record(r).keys if k in wanted}

    def delete(self, tenant: str, doc_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM documents WHERE tenant = ? AND id = ?", (tenant, doc_id))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def new_record(doc_id: str, text: str, chunks: list[StoredChunk], metadata: dict[str, Any]) -> DocumentRecord:
    """A record for ``text`` cut into ``chunks`` (at least one); ``chunk_key`` is the first's."""
    if not chunks:
        raise ValueError("a stored document has at least one chunk")
    return DocumentRecord(doc_id, text_sha256(text), text, sum(c.tokens for c in chunks), chunks[0].key,
                          dict(metadata), time.time(), tuple(chunks))


def _record(row: tuple[Any, ...]) -> DocumentRecord:
    chunks = tuple(StoredChunk(c["id"], c["key"], tuple(int(t) for t in c["ids"])) for c in json.loads(row[7]))
    return DocumentRecord(row[0], row[1], row[2], int(row[3]), row[4], json.loads(row[5]), float(row[6]), chunks)
