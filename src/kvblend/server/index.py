"""The server's document index for matching (``kvblend.engine.matching``): built from the
registry at startup, kept in step with ``/v1/documents`` — this process's directly, other
processes' sharing the registry file (ingress replicas on one host) through its change log
(``IndexFeed``) — and from the catalog ``kvblend ingest`` writes (``IngestFeed``: what a
re-ingest drops leaves the index, what it adds enters)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from kvblend.blend.layout import tokenize_document
from kvblend.engine.matching import DocumentIndex, IndexedText
from kvblend.engine.shaping import aligned
from kvblend.rag.catalog import CatalogReader
from kvblend.rag.retriever import CATALOG_NAME
from kvblend.server.documents import DocumentRecord, DocumentRegistry
from kvblend.settings import Settings

log = logging.getLogger("kvblend.server")
PAGE = 1000
INGESTED = "ingest:"  # an ingested chunk's name in the index: ingest:<chunk id> (its document: ingest:<source>)


def record_texts(tokenizer: Any, record: DocumentRecord) -> list[IndexedText]:
    """A stored document's chunks as indexed texts: each chunk's ids decoded, kept while
    they fall in order on the document's text (a row stored before chunking: its text)."""
    if not record.chunks:
        return [IndexedText(record.text, tokenize_document(tokenizer, record.text), record.chunk_key, record.id)]
    pieces = [IndexedText(tokenizer.decode(list(c.token_ids), skip_special_tokens=False), c.token_ids, c.id, record.id)
              for c in record.chunks]
    return aligned(record.text, pieces)


def _fill(index: DocumentIndex, registry: DocumentRegistry, tokenizer: Any) -> None:
    for tenant in registry.tenants():
        after = None
        while rows := registry.list(tenant, PAGE, after):
            index.add(tenant, [t for r in rows for t in record_texts(tokenizer, r)])
            after = rows[-1].id


class IndexFeed:
    """Keeps ``index`` in step with ``registry``: documents other processes put or deleted
    since change ``seq`` (``DocumentRegistry.changes_since``; each named document's texts
    are dropped and, if it is still stored, indexed again from its row), and this
    process's own (``stored``, ``deleted``), all under one lock so that neither undoes the
    other: a local add checks the row is still there, and a foreign change read before a
    local delete is applied before it. A log that no longer reaches back rebuilds the
    index (texts seen inline in requests are dropped too: they come back when seen again)."""

    def __init__(self, index: DocumentIndex, registry: DocumentRegistry, tokenizer: Any, seq: int,
                 ingested: IngestFeed | None = None) -> None:
        self.index, self.registry, self.tokenizer, self.seq = index, registry, tokenizer, seq
        self.ingested = ingested
        self._lock = threading.Lock()

    def catch_up(self, limit: int | None = None, wait: bool = True) -> int:
        """Apply the changes after ``seq``: all, or at most ``limit`` log rows; with
        ``wait=False`` nothing when another thread is applying them (a request then goes
        on with the index as it is rather than queue behind a bulk upload elsewhere). How
        many documents were applied; -1 for a rebuild."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            applied = self._apply(limit)
            if applied < 0 and self.ingested is not None:  # the rebuild dropped the ingested texts too
                self.ingested.reset()
        finally:
            self._lock.release()
        if self.ingested is not None and limit is None:  # the follower's call: a request never pays for an ingest
            self.ingested.catch_up(wait)
        return applied

    def _apply(self, limit: int | None) -> int:
        applied, budget = 0, limit
        while budget is None or budget > 0:
            page = PAGE if budget is None else min(PAGE, budget)
            answer = self.registry.changes_since(self.seq, page)
            if answer is None:
                log.warning("document index: the registry's change log moved past this index; rebuilding")
                self.seq = self.registry.last_change()
                self.index.clear()
                _fill(self.index, self.registry, self.tokenizer)
                return -1
            changes, last = answer
            for tenant, doc_id in dict.fromkeys(changes):
                self.index.remove_document(tenant, doc_id)
                record = self.registry.get(tenant, doc_id)
                if record is not None:
                    self.index.add(tenant, record_texts(self.tokenizer, record))
            applied += len(changes)
            if last == self.seq:
                break
            budget = None if budget is None else budget - (last - self.seq)
            self.seq = last
        return applied

    def stored(self, tenant: str, doc_id: str, sha256: str, texts: list[IndexedText]) -> None:
        """This process stored ``doc_id`` (``texts``, its text's ``sha256``): index it, unless
        another process deleted or replaced the row since (its change then decides)."""
        with self._lock:
            record = self.registry.get(tenant, doc_id)
            if record is not None and record.sha256 == sha256:
                self.index.add(tenant, texts)

    def deleted(self, tenant: str, doc_id: str) -> None:
        """This process deleted ``doc_id``: drop its texts (after any foreign change being applied)."""
        with self._lock:
            self.index.remove_document(tenant, doc_id)


class IngestFeed:
    """Keeps ``index`` in step with the catalog ``kvblend ingest`` writes (read-only): each
    tenant's committed chunks are indexed (named ``INGESTED`` + chunk id). When a tenant's
    catalog version moves, the chunks no longer committed (a re-ingest dropped or changed
    their file) leave the index and the new ones enter. Run by the app's background
    follower (``IndexFeed.catch_up`` without a limit), never on a request's path."""

    def __init__(self, index: DocumentIndex, reader: CatalogReader) -> None:
        self.index, self.reader = index, reader
        self.versions: dict[str, int] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Index every tenant's chunks again at the next catch-up (the index was cleared)."""
        with self._lock:
            self.versions.clear()

    def catch_up(self, wait: bool = True) -> int:
        """Apply catalog changes (see the class docstring); how many chunks entered or
        left. ``wait=False``: nothing when another thread is applying them."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            changed = 0
            for tenant, version in self.reader.versions().items():
                if self.versions.get(tenant) != version:
                    changed += self._sync(tenant)
                    self.versions[tenant] = version
            return changed
        finally:
            self._lock.release()

    def _sync(self, tenant: str) -> int:
        committed = self.reader.chunk_ids(tenant)
        held = {name[len(INGESTED):] for name in self.index.chunk_names(tenant, INGESTED)}
        gone = self.index.remove_chunks(tenant, [INGESTED + c for c in held - committed])
        new = sorted(committed - held)
        for i in range(0, len(new), PAGE):
            rows = self.reader.chunks(tenant, new[i : i + PAGE])
            self.index.add(tenant, [IndexedText(r.text, r.token_ids, INGESTED + r.chunk_id, INGESTED + r.source)
                                    for r in rows])
        return gone + len(new)

    def close(self) -> None:
        self.reader.close()


def open_index(settings: Settings, registry: DocumentRegistry, tokenizer: Any,
               catalog: Path | None = None) -> IndexFeed | None:
    """The index, rebuilt from every tenant's stored documents and (``catalog``: the
    ingest catalog's path) ingested chunks, with its feed of later changes
    (``feed.index``); None with matching off. Runs of stored texts match on the
    tokenizer's tokens (``documents.span_tokens`` at least)."""
    if not settings.documents.match:
        return None
    index = DocumentIndex(settings.documents.index_bytes, tokenizer, settings.documents.span_tokens)
    seq = registry.last_change()  # first: a change during the build is applied again, harmlessly
    _fill(index, registry, tokenizer)
    ingested = IngestFeed(index, CatalogReader(catalog)) if catalog is not None else None
    if ingested is not None:
        ingested.catch_up()
    log.info("document index: %d texts, %d bytes (%.0f per token)", len(index), index.nbytes,
             index.nbytes / max(1, index.tokens()))
    return IndexFeed(index, registry, tokenizer, seq, ingested)


def ingest_catalog(settings: Settings, tokenizer_id: str) -> Path:
    """The catalog of the folder ``kvblend ingest`` writes for this server's model."""
    from kvblend.server.retrieval import index_folder

    return index_folder(settings, tokenizer_id) / CATALOG_NAME
