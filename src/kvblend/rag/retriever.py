"""The retriever: dense (embedded vector index), BM25 (bm25s), or both fused by reciprocal rank.

    dense  = index.search(embed(query))           # cosine over all-MiniLM-L6-v2 vectors
    bm25   = bm25s over the tenant's chunk texts   # rebuilt when the catalog changes
    hybrid = RRF(dense, bm25): sum of 1 / (60 + rank) over both lists (Cormack et al., 2009)

Only committed chunks are returned (the catalog is the truth): vectors of a batch that
crashed before its commit are ignored.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvblend.errors import InvalidRequestError, KvblendError
from kvblend.rag.catalog import Catalog, ChunkRow
from kvblend.rag.embed import Embedder, MiniLMEmbedder
from kvblend.rag.backends import build_vector_index
from kvblend.rag.vector_index import VectorIndex
from kvblend.store.keys import validate_tenant

MODES = ("dense", "bm25", "hybrid")
RRF_K = 60
MAX_TOP_K = 100
MAX_QUERY_CHARS = 8192
CATALOG_NAME = "catalog.sqlite"  # in the index folder: its presence is what makes the folder an index


def default_index_dir(tokenizer_id: str) -> Path:
    """``$KVBLEND_HOME/rag/<tokenizer fingerprint>``: one index per tokenizer, where
    ``kvblend ingest`` writes and ``ask`` and the server read without ``--index``."""
    from kvblend.models.gguf import cache_home

    return cache_home() / "rag" / tokenizer_id[:16]


def check_top_k(value: object, name: str = "top_k") -> int:
    """``value`` if it is an int (not a bool) in [1, `MAX_TOP_K`]; else InvalidRequestError
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOP_K:
        raise InvalidRequestError(f"{name} must be an integer in [1, {MAX_TOP_K}]; got {value!r}", name)
    return value


def index_exists(folder: Path) -> bool:
    """Whether ``folder`` holds an index (its catalog). Opening a ``Retriever`` creates one,
    so a reader that must not create anything (``kvblend ask``) asks this first."""
    return (Path(folder) / CATALOG_NAME).is_file()


def search_query(text: str) -> str:
    """What a search takes of ``text``: its last `MAX_QUERY_CHARS` characters, trimmed (a
    question usually ends a long message). The server's retrieval and `kvblend ask` both."""
    return text.strip()[-MAX_QUERY_CHARS:]


@dataclass(frozen=True)
class RetrieverConfig:
    """``folder``: where the catalog and index live; ``mode``: dense, bm25 or hybrid;
    ``vector_backend``: a registered ``VectorIndex`` builder (``faiss``: embedded)."""

    folder: Path
    mode: str = "hybrid"
    vector_backend: str = "faiss"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"retriever mode must be one of {', '.join(MODES)}; got {self.mode!r}")


class Hit(NamedTuple):
    """One retrieved chunk: its rank score, where it came from, and the ids to blend."""

    chunk_id: str
    score: float
    source: str
    ordinal: int
    text: str
    token_ids: tuple[int, ...]
    kv_ready: bool


def rrf(rankings: list[list[str]], k: int = RRF_K) -> list[tuple[str, float]]:
    """Reciprocal-rank fusion: ids ordered by the sum of ``1 / (k + rank)`` (rank from 1)."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, cid in enumerate(ranking, start=1):
            scores[cid] = scores.get(cid, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))


@dataclass
class _Bm25:
    version: int
    ids: list[str]
    model: object | None


def _bm25_tokens(texts: list[str]):
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", show_progress=False)


@dataclass
class Retriever:
    """Searches one index folder. ``embedder`` defaults to all-MiniLM-L6-v2, loaded on first
    dense use. Thread-safe."""

    config: RetrieverConfig
    embedder: Embedder | None = None
    catalog: Catalog = field(init=False)
    _index: VectorIndex | None = field(init=False, default=None)
    _bm25: dict[str, _Bm25] = field(init=False, default_factory=dict)
    _lock: threading.RLock = field(init=False, default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.catalog = Catalog(Path(self.config.folder) / CATALOG_NAME)
        if self.embedder is None:
            self.embedder = MiniLMEmbedder()

    @property
    def index(self) -> VectorIndex:
        with self._lock:
            if self._index is None:
                self._check_embedder()
                self._index = build_vector_index(self.config.vector_backend, Path(self.config.folder) / "vectors",
                                                 self.embedder.dim)
            return self._index

    def _check_embedder(self) -> None:
        known = self.catalog.get_meta("embedder")
        if known is None:
            self.catalog.set_meta("embedder", self.embedder.name)
        elif known != self.embedder.name:
            raise KvblendError(f"this index was built with the embedder {known!r}, not {self.embedder.name!r}: "
                               "use another --index folder")

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.embedder.encode(texts)  # (n, dim)

    # ----- search ----------------------------------------------------------------------
    def _dense(self, tenant: str, query: str, depth: int) -> list[str]:
        return [s.chunk_id for s in self.index.search(tenant, self.embed([query])[0], depth)]

    def _bm25_index(self, tenant: str) -> _Bm25:
        version = self.catalog.version(tenant)
        with self._lock:
            cached = self._bm25.get(tenant)
            if cached is not None and cached.version == version:
                return cached
            import bm25s

            ids, texts = self.catalog.all_texts(tenant)
            model = None
            if ids:
                model = bm25s.BM25()
                model.index(_bm25_tokens(texts), show_progress=False)
            self._bm25[tenant] = built = _Bm25(version, ids, model)
            return built

    def _bm25_search(self, tenant: str, query: str, depth: int) -> list[str]:
        idx = self._bm25_index(tenant)
        if idx.model is None:
            return []
        docs, scores = idx.model.retrieve(_bm25_tokens([query]), k=min(depth, len(idx.ids)), show_progress=False)
        return [idx.ids[d] for d, s in zip(docs[0], scores[0]) if s > 0]

    def search(self, tenant: str, query: str, top_k: int = 6, mode: str | None = None) -> list[Hit]:
        """The ``top_k`` committed chunks of ``tenant`` closest to ``query``, best first."""
        validate_tenant(tenant)
        mode = mode or self.config.mode
        if mode not in MODES:
            raise InvalidRequestError(f"retrieval mode must be one of {', '.join(MODES)}; got {mode!r}")
        check_top_k(top_k)
        if not query.strip() or len(query) > MAX_QUERY_CHARS:
            raise InvalidRequestError(f"the query must be non-empty and at most {MAX_QUERY_CHARS} characters")
        depth = max(4 * top_k, 20)
        if mode == "dense":
            ranked = [(c, 1.0 / (RRF_K + r)) for r, c in enumerate(self._dense(tenant, query, depth), 1)]
        elif mode == "bm25":
            ranked = [(c, 1.0 / (RRF_K + r)) for r, c in enumerate(self._bm25_search(tenant, query, depth), 1)]
        else:
            ranked = rrf([self._dense(tenant, query, depth), self._bm25_search(tenant, query, depth)])
        return self._hits(tenant, ranked, top_k)

    def _hits(self, tenant: str, ranked: list[tuple[str, float]], top_k: int) -> list[Hit]:
        rows = {r.chunk_id: r for r in self.catalog.chunks(tenant, [c for c, _ in ranked])}
        hits = [_hit(rows[c], s) for c, s in ranked if c in rows]
        return hits[:top_k]

    # ----- maintenance -----------------------------------------------------------------
    def delete_document(self, tenant: str, source: str) -> int:
        """Remove a document and the chunks only it used (catalog, then vectors); returns
        the number of chunks removed."""
        orphans = self.catalog.delete_document(tenant, source)
        if orphans:
            self.index.delete(tenant, orphans)
        return len(orphans)

    def reconcile(self, tenant: str) -> int:
        """Drop vectors no committed chunk owns (left by a crash before a batch's commit)."""
        ids = self.index.ids(tenant)
        if not ids:
            return 0
        stray = ids - self.catalog.existing(tenant, ids)
        return self.index.delete(tenant, sorted(stray)) if stray else 0

    def close(self) -> None:
        with self._lock:
            if self._index is not None:
                self._index.close()
            self.catalog.close()


def _hit(row: ChunkRow, score: float) -> Hit:
    return Hit(row.chunk_id, score, row.source, row.ordinal, row.text, row.token_ids, row.kv_ready)
