"""The server's document index for matching (``kvblend.engine.matching``): built from the
registry at startup, kept in step with ``/v1/documents`` — this process's directly, other
processes' sharing the registry file (ingress replicas on one host) through its change log
(``IndexFeed``)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvblend.blend.layout import tokenize_document
from kvblend.engine.matching import DocumentIndex, IndexedText
from kvblend.engine.shaping import aligned
from kvblend.server.documents import DocumentRecord, DocumentRegistry
from kvblend.settings import Settings

log = logging.getLogger("kvblend.server")
PAGE = 1000


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

    def __init__(self, index: DocumentIndex, registry: DocumentRegistry, tokenizer: Any, seq: int) -> None:
        self.index, self.registry, self.tokenizer, self.seq = index, registry, tokenizer, seq
        self._lock = threading.Lock()

    def catch_up(self, limit: int | None = None, wait: bool = True) -> int:
        """Apply the changes after ``seq``: all, or at most ``limit`` log rows; with
        ``wait=False`` nothing when another thread is applying them (a request then goes
        on with the index as it is rather than queue behind a bulk upload elsewhere). How
        many documents were applied; -1 for a rebuild."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            return self._apply(limit)
        finally:
            self._lock.release()

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


def open_index(settings: Settings, registry: DocumentRegistry, tokenizer: Any) -> IndexFeed | None:
    """The index, rebuilt from every tenant's stored documents, with its feed of later
    changes (``feed.index``); None with matching off."""
    if not settings.documents.match:
        return None
    index = DocumentIndex(settings.documents.index_bytes)
    seq = registry.last_change()  # first: a change during the build is applied again, harmlessly
    _fill(index, registry, tokenizer)
    log.info("document index: %d texts, %d bytes", len(index), index.nbytes)
    return IndexFeed(index, registry, tokenizer, seq)
