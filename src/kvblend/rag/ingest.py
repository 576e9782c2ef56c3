"""Ingest: files -> documents -> chunks -> vectors + chunk KV + catalog rows, batch by batch.

Each batch is made durable in this order, and the catalog commit comes last:

    1. chunk KV into the store (content-keyed, atomic files)  -- skipped if already stored
    2. vectors into the vector index (durable on return)
    3. one catalog transaction: the batch's chunk rows, the rows of documents whose chunks
       are now all committed, and the removal of chunks a changed document no longer uses

A crash before 3 leaves only KV entries and vectors nobody refers to: a search ignores
them, a rerun re-uses the KV (its key is found) and overwrites the vectors. Documents
whose text, chunker and tokenizer are unchanged are skipped; chunks already committed
(from any document) are re-used, not recomputed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvblend.rag.catalog import DocumentRow, NewChunk
from kvblend.rag.chunking import Chunk, ChunkerConfig, chunk_text
from kvblend.rag.readers import Document, SkipFile, discover, read_documents
from kvblend.rag.retriever import Retriever
from kvblend.store.keys import validate_tenant

PRECOMPUTE = ("all", "lazy")


@dataclass(frozen=True)
class IngestConfig:
    """``precompute``: ``all`` computes every new chunk's KV now; ``lazy`` leaves it to the
    ``precompute_after``-th retrieval (``kvblend ask`` counts them). ``dense``: embed and
    index vectors (off: BM25 only, no embedding model)."""

    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    tenant: str = "default"
    batch_size: int = 32
    precompute: str = "all"
    precompute_after: int = 2
    text_field: str = "text"
    dense: bool = True

    def __post_init__(self) -> None:
        validate_tenant(self.tenant)
        if not 1 <= self.batch_size <= 4096:
            raise ValueError("batch_size must be in [1, 4096]")
        if self.precompute not in PRECOMPUTE:
            raise ValueError(f"precompute must be one of {', '.join(PRECOMPUTE)}; got {self.precompute!r}")
        if self.precompute_after < 1:
            raise ValueError("precompute_after must be >= 1")


@dataclass
class IngestSummary:
    """What one ingest did; ``skipped`` holds ``(path, reason)``."""

    files: int = 0
    documents: int = 0
    unchanged: int = 0
    chunks: int = 0
    chunks_new: int = 0
    tokens_new: int = 0
    removed_chunks: int = 0
    kv_chunks: int = 0
    kv_tokens: int = 0
    kv_s: float = 0.0
    embed_s: float = 0.0
    total_s: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    store_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class _Doc:
    """A document to commit once its new chunks are stored."""

    row: DocumentRow
    waiting: set[str]
    orphans: list[str]


def document_hash(text: str, chunker: ChunkerConfig, tokenizer_id: str) -> str:
    """Identity of a document's chunking: its text, the chunker's parameters, the tokenizer."""
    h = hashlib.sha256()
    for part in (tokenizer_id, chunker.to_json(), text):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class KvWarmer:
    """Computes and stores chunk KV through an ``Engine`` (after the model's chat prefix)."""

    def __init__(self, engine: Any) -> None:
        from kvblend.rag.ask import chunk_prefix

        self.engine = engine
        self.chunk_prefix = chunk_prefix(engine)

    def warm(self, token_ids: tuple[int, ...], tenant: str) -> bool:
        """Store the chunk's KV; False if it was already there (nothing computed)."""
        key = self.engine.key_context(self.chunk_prefix, tenant)
        from kvblend.store.keys import chunk_key

        if self.engine.store.contains(chunk_key(token_ids, key)):
            return False
        self.engine.warm([token_ids], self.chunk_prefix, tenant)
        return True


def _read_all(files: list[Path], text_field: str, summary: IngestSummary, bar) -> list[Document]:
    docs = []
    for path in bar(files, desc="reading", unit="file"):
        try:
            docs.extend(read_documents(path, text_field))
            summary.files += 1
        except SkipFile as exc:
            summary.skipped.append((str(path), str(exc)))
    return docs


class Ingestor:
    """Ingests into ``retriever``'s folder with ``tokenizer`` (and ``warmer`` for chunk KV)."""

    def __init__(self, retriever: Retriever, tokenizer: Any, tokenizer_id: str, config: IngestConfig,
                 warmer: KvWarmer | None = None) -> None:
        self.retriever = retriever
        self.catalog = retriever.catalog
        self.tokenizer = tokenizer
        self.tokenizer_id = tokenizer_id
        self.config = config
        self.warmer = warmer
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        known = self.catalog.get_meta("tokenizer")
        if known is None:
            self.catalog.set_meta("tokenizer", self.tokenizer_id)
        elif known != self.tokenizer_id:
            from kvblend.errors import KvblendError

            raise KvblendError("this index was built with another tokenizer (another model): use another --index folder")

    def chunk(self, text: str) -> list[Chunk]:
        """The chunks of one text (the entry point ``POST /v1/documents`` shares)."""
        return chunk_text(self.tokenizer, text, self.config.chunker, self.tokenizer_id)

    def _plan(self, docs: list[Document], summary: IngestSummary) -> tuple[list[tuple[Chunk, str]], list[_Doc]]:
        """New chunks to store (deduplicated) and the documents waiting on them."""
        tenant, queued, todo, waiting = self.config.tenant, set(), [], []
        for doc in docs:
            sha = document_hash(doc.text, self.config.chunker, self.tokenizer_id)
            old = self.catalog.document(tenant, doc.source)
            summary.documents += 1
            if old is not None and old.sha256 == sha:
                summary.unchanged += 1
                self._restore_kv(old.chunk_ids, summary)
                continue
            chunks = self.chunk(doc.text)
            ids = [c.chunk_id for c in chunks]
            new = [c for c in chunks if c.chunk_id not in queued]
            new_ids = {c.chunk_id for c in new} - self.catalog.existing(tenant, [c.chunk_id for c in new])
            for c in new:
                if c.chunk_id in new_ids and c.chunk_id not in queued:
                    queued.add(c.chunk_id)
                    todo.append((c, doc.source))
            waiting_on = {c for c in ids if c in queued}
            orphans = [] if old is None else [c for c in old.chunk_ids if c not in set(ids)]
            row = DocumentRow(doc.source, sha, tuple(ids), sum(c.n_tokens for c in chunks))
            waiting.append(_Doc(row, waiting_on, orphans))
            summary.chunks += len(chunks)
        return todo, waiting

    def _restore_kv(self, chunk_ids: tuple[str, ...], summary: IngestSummary) -> None:
        """An unchanged document's chunk KV may have left the store since (evicted, cleared,
        or keyed anew by another model, dtype or key version): compute what is missing."""
        if self.warmer is None or self.config.precompute == "lazy":
            return
        for row in self.catalog.chunks(self.config.tenant, list(chunk_ids)):
            t = time.perf_counter()
            if self.warmer.warm(row.token_ids, self.config.tenant):
                summary.kv_s += time.perf_counter() - t
                summary.kv_chunks += 1
                summary.kv_tokens += len(row.token_ids)

    def _store_batch(self, batch: list[tuple[Chunk, str]], summary: IngestSummary) -> list[NewChunk]:
        tenant, lazy = self.config.tenant, self.config.precompute == "lazy"
        ready = []
        for chunk, _ in batch:
            done = False
            if self.warmer is not None and not lazy:
                t = time.perf_counter()
                if self.warmer.warm(chunk.token_ids, tenant):
                    summary.kv_s += time.perf_counter() - t
                    summary.kv_chunks += 1
                    summary.kv_tokens += chunk.n_tokens
                done = True
            ready.append(done)
        if self.config.dense:
            t = time.perf_counter()
            vectors = self.retriever.embed([c.text for c, _ in batch])  # (n, dim)
            summary.embed_s += time.perf_counter() - t
            self.retriever.index.upsert(tenant, [c.chunk_id for c, _ in batch], vectors)
        return [NewChunk(c.chunk_id, src, c.ordinal, c.text, c.token_ids, r) for (c, src), r in zip(batch, ready)]

    def _commit(self, new: list[NewChunk], waiting: list[_Doc], summary: IngestSummary) -> list[_Doc]:
        """Commit ``new`` chunks and every document no longer waiting; returns those still waiting."""
        done_ids = {c.chunk_id for c in new}
        complete, still = [], []
        for doc in waiting:
            doc.waiting -= done_ids
            (still if doc.waiting else complete).append(doc)
        orphans = []
        for doc in complete:
            orphans += self.catalog.orphans(self.config.tenant, doc.orphans, exclude_source=doc.row.source)
        self.catalog.commit(self.config.tenant, new, [d.row for d in complete], orphans)
        if orphans and self.config.dense:
            self.retriever.index.delete(self.config.tenant, orphans)
        summary.removed_chunks += len(orphans)
        summary.chunks_new += len(new)
        summary.tokens_new += sum(len(c.token_ids) for c in new)
        return still

    def ingest(self, paths: Sequence[Path], progress: bool = True) -> IngestSummary:
        """Ingest files and folders; bad files are skipped and listed in the summary."""
        start, summary = time.perf_counter(), IngestSummary()
        files, summary.skipped = discover([Path(p) for p in paths])
        docs = _read_all(files, self.config.text_field, summary, _progress(progress))
        return self.ingest_documents(docs, progress, summary, start)

    def ingest_documents(self, docs: Sequence[Document], progress: bool = True, summary: IngestSummary | None = None,
                         start: float | None = None) -> IngestSummary:
        """Ingest documents given as ``(source, text)`` (re-ingesting a source replaces it)."""
        start = time.perf_counter() if start is None else start
        summary = summary or IngestSummary()
        todo, waiting = self._plan(list(docs), summary)
        if self.config.dense:
            self.retriever.reconcile(self.config.tenant)
        size = self.config.batch_size
        with _progress(progress)(total=len(todo), desc="chunks", unit="chunk") as pbar:
            for i in range(0, len(todo), size):
                batch = todo[i : i + size]
                waiting = self._commit(self._store_batch(batch, summary), waiting, summary)
                pbar.update(len(batch))
        if waiting or not todo:
            self._commit([], waiting, summary)
        if self.config.dense:
            self.retriever.index.flush()
        summary.total_s = time.perf_counter() - start
        if self.warmer is not None:
            summary.store_bytes = {n: s.bytes for n, s in self.warmer.engine.store.tier_stats(self.config.tenant).items()}
        return summary


def _progress(enabled: bool) -> Callable[..., Any]:
    """tqdm (with ETA) on stderr, or a silent stand-in with the same calls."""
    from tqdm.auto import tqdm

    def bar(iterable=None, **kw):
        return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kw)

    return bar
