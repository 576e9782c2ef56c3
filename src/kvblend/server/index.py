"""The server's document index for matching (``kvblend.engine.matching``): built from the
registry at startup, kept in step with ``/v1/documents``."""

from __future__ import annotations

import logging
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


def open_index(settings: Settings, registry: DocumentRegistry, tokenizer: Any) -> DocumentIndex | None:
    """The index, rebuilt from every tenant's stored documents; None with matching off."""
    if not settings.documents.match:
        return None
    index = DocumentIndex(settings.documents.index_bytes)
    for tenant in registry.tenants():
        after = None
        while rows := registry.list(tenant, PAGE, after):
            index.add(tenant, [t for r in rows for t in record_texts(tokenizer, r)])
            after = rows[-1].id
    log.info("document index: %d texts, %d bytes", len(index), index.nbytes)
    return index
