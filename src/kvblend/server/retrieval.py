"""Server-side retrieval: ``"retrieval": {"top_k": k}`` instead of ``documents``.

The server opens one read-only ``Retriever`` over the index ``kvblend ingest`` wrote
(``Settings.retrieval.index_dir``, default ``$KVBLEND_HOME/rag/<tokenizer>``), searches
the caller's own tenant with the request's question (the last user message, or the
prompt) and blends the hits as token ids, the ids they were chunked and precomputed
with, so their store keys are the ones ingest wrote. Nothing shared is changed per
request (no store admission swap, no retrieval counting): lazy precompute stays a
``kvblend ask`` feature. The response's ``kvblend.sources`` names the chunks used.

The server writes nothing to the index folder: where no index is yet (nothing ingested),
a search finds nothing, as over an empty index, and the folder is opened once an ingest
has written it (opening a ``Retriever`` would create it).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from kvblend.errors import InvalidRequestError
from kvblend.rag.retriever import Hit, Retriever, RetrieverConfig, default_index_dir, index_exists, search_query
from kvblend.server.errors import APIError, bad_request
from kvblend.server.protocol import ChatCompletionRequest, _Common
from kvblend.settings import Settings

DISABLED = ("retrieval is not enabled on this server: send `documents`, or start the server with "
            "retrieval.enabled (KVBLEND_RETRIEVAL__ENABLED=1) over an index built by `kvblend ingest`")

log = logging.getLogger("kvblend.server")


def index_folder(settings: Settings, tokenizer_id: str) -> Path:
    """The configured index folder, or the one ``kvblend ingest`` uses by default."""
    if settings.retrieval.index_dir:
        return Path(settings.retrieval.index_dir)
    return default_index_dir(tokenizer_id)


class IndexReader:
    """The server's side of the index folder: a ``Retriever`` opened by the first search
    that finds an index there; before, every search finds nothing. Thread-safe."""

    def __init__(self, config: RetrieverConfig) -> None:
        self.config = config
        self._retriever: Retriever | None = None
        self._lock = threading.Lock()

    def _opened(self) -> Retriever | None:
        with self._lock:
            if self._retriever is None and index_exists(self.config.folder):
                self._retriever = Retriever(self.config)
            return self._retriever

    def search(self, tenant: str, query: str, top_k: int) -> list[Hit]:
        retriever = self._opened()
        return [] if retriever is None else retriever.search(tenant, query, top_k)

    def close(self) -> None:
        with self._lock:
            if self._retriever is not None:
                self._retriever.close()


def open_retriever(settings: Settings, tokenizer_id: str) -> IndexReader | None:
    """The server's retriever, or None when retrieval is disabled."""
    if not settings.retrieval.enabled:
        return None
    folder = index_folder(settings, tokenizer_id)
    if not index_exists(folder):
        log.warning("retrieval: no index at %s yet; requests retrieve nothing until `kvblend ingest` writes one",
                    folder)
    return IndexReader(RetrieverConfig(folder, mode=settings.retrieval.mode))


def check_retrieval(body: _Common, settings: Settings, retriever: IndexReader | None) -> int | None:
    """The request's top_k, or None when it sends no ``retrieval``. 400 when retrieval is
    off, combined with ``documents``, or asks for more than the server allows."""
    if body.retrieval is None:
        return None
    if retriever is None:
        raise bad_request(DISABLED, "retrieval")
    if body.documents is not None:
        raise bad_request("send either `documents` or `retrieval`, not both", "retrieval")
    limit = settings.retrieval.max_top_k
    if body.retrieval.top_k > limit:
        raise bad_request(f"retrieval.top_k is {body.retrieval.top_k}; this server allows at most {limit}",
                          "retrieval.top_k")
    return body.retrieval.top_k


def query_text(body: _Common) -> str:
    """What to search with: the last user message of a chat, or the completion prompt; a
    text longer than the search takes is searched by its end (where a question usually
    is), and one without text is a 400 naming it."""
    if isinstance(body, ChatCompletionRequest):
        for i in range(len(body.messages) - 1, -1, -1):
            m = body.messages[i]
            if m.role == "user":
                try:
                    return _searchable(m.text(f"messages.{i}"), f"messages.{i}.content", "the last user message")
                except ValueError as exc:
                    raise bad_request(str(exc), f"messages.{i}.content") from None
        raise bad_request("retrieval needs a user message to search with", "messages")
    prompt = body.prompt
    text = prompt[0] if isinstance(prompt, list) and prompt else prompt if isinstance(prompt, str) else ""
    return _searchable(text, "prompt", "the prompt")


def _searchable(text: str, param: str, what: str) -> str:
    if not text.strip():
        raise bad_request(f"retrieval searches with {what}, which has no text", param)
    return search_query(text)


def search(retriever: IndexReader, tenant: str, query: str, top_k: int) -> list[Hit]:
    """The tenant's top-k chunks for ``query`` (runs off the event loop)."""
    try:
        return retriever.search(tenant, query, top_k)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "retrieval") from None
    except Exception as exc:  # noqa: BLE001 - an unreadable index is the operator's, not the caller's
        raise APIError(503, "the retrieval index is unavailable; retry later", "retrieval") from exc


def sources(hits: list[Hit]) -> list[dict[str, Any]]:
    """What the response names of the chunks used (the caller's own tenant only)."""
    return [{"chunk_id": h.chunk_id, "source": h.source, "ordinal": h.ordinal, "score": round(h.score, 6),
             "tokens": len(h.token_ids)} for h in hits]


__all__ = ["DISABLED", "IndexReader", "check_retrieval", "index_folder", "open_retriever", "query_text", "search", "sources"]
