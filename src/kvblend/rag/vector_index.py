"""The vector index interface: per-tenant upsert, delete, search and count of chunk vectors.

The retriever and the ingest pipeline talk only to this protocol, so another store (a
Qdrant server, pgvector) replaces the embedded one by registering a builder under a
name and setting ``RagConfig.vector_backend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np


class ScoredId(NamedTuple):
    """One search result: a chunk id and its similarity (higher is closer)."""

    chunk_id: str
    score: float


class VectorIndex(Protocol):
    """Contract of a vector index. Every call is scoped to one tenant: a search never
    returns another tenant's ids. ``upsert`` is durable when it returns (a crash after it
    loses nothing) and replaces the vector of an existing id; ``delete`` ignores unknown
    ids; vectors are float32 rows of ``dim`` columns, compared by inner product (the
    embedder normalises them, so this is cosine similarity)."""

    dim: int

    def upsert(self, tenant: str, chunk_ids: Sequence[str], vectors: np.ndarray) -> None: ...

    def delete(self, tenant: str, chunk_ids: Sequence[str]) -> int: ...

    def search(self, tenant: str, vector: np.ndarray, k: int) -> list[ScoredId]: ...

    def count(self, tenant: str) -> int: ...

    def ids(self, tenant: str) -> set[str]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
