"""Answer a question from the index: retrieve the top-k chunks, blend their KV, stream.

The retrieved chunks go to the engine as token ids (the ids they were chunked and
precomputed with), so their store keys are the ones ingest wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

from kvblend.engine import Engine, Request, Result
from kvblend.engine.request import result_of
from kvblend.engine.shaping import Draft, shape
from kvblend.errors import KvblendError
from kvblend.generation import SamplingParams
from kvblend.rag.retriever import Hit, Retriever, search_query
from kvblend.store.keys import chunk_key


class Answer(NamedTuple):
    """The chunks used (best first), the blended result and, when asked, full prefill's."""

    hits: list[Hit]
    result: Result
    full: Result | None


class _KeysAdmission:
    """Admit only the given chunk keys (lazy precompute: chunks at their N-th retrieval)."""

    def __init__(self, keys: set) -> None:
        self.keys = keys

    def sight(self, key) -> bool:
        """A miss of ``key`` (the store's admission contract): admitted when it is due."""
        return key in self.keys

    def admit(self, key) -> bool:
        return key in self.keys


def chunk_prefix(engine: Engine) -> tuple[int, ...]:
    """The prefix chunk KV is computed after (the default ``bos`` chunk prefix: the
    model's sink token, the same for chat and plain-completion requests)."""
    return engine.sink_prefix


def _lazy_admission(engine: Engine, retriever: Retriever, hits: list[Hit], tenant: str) -> list[str]:
    """Count this retrieval. Under lazy precompute (``precompute_after:<tenant>`` N > 0 in
    the catalog) only chunks at their N-th retrieval may be written to the store: the
    store's admission is swapped until ``ask`` has flushed this request's write-back (an
    engine serving other requests at the same time should not use lazy precompute)."""
    ids = [h.chunk_id for h in hits]
    retriever.catalog.record_retrievals(tenant, ids)
    after = int(retriever.catalog.get_meta(f"precompute_after:{tenant}") or 0)
    if not after or not hasattr(engine.store, "admission"):
        return []
    due = [r for r in retriever.catalog.chunks(tenant, ids) if not r.kv_ready and r.retrievals >= after]
    ctx = engine.key_context(chunk_prefix(engine), tenant)
    engine.store.admission = _KeysAdmission({chunk_key(r.token_ids, ctx) for r in due})
    return [r.chunk_id for r in due]


def _stream(engine: Engine, request: Request, sampling: SamplingParams, on_text: Callable[[str], Any] | None) -> Result:
    return result_of(engine.stream(request, sampling), on_text)


def ask(engine: Engine, retriever: Retriever, question: str, *, tenant: str = "default", top_k: int = 6,
        mode: str | None = None, request_kw: dict[str, Any] | None = None, sampling: SamplingParams | None = None,
        compare: bool = False, on_text: Callable[[str], Any] | None = None, query: str | None = None) -> Answer:
    """Retrieve by ``query`` (default: the question), blend (``request_kw`` sets method,
    system, blend config) and decode; ``on_text`` receives the answer as it streams.
    Raises KvblendError on an empty index."""
    sampling = sampling or SamplingParams()
    hits = retriever.search(tenant, search_query(query or question), top_k, mode)
    if not hits:
        raise KvblendError(f"nothing retrieved from the index at {retriever.config.folder}: "
                           "run `kvblend ingest PATH...` first (with the same --model and --tenant)")
    draft = Draft(documents=[h.token_ids for h in hits], question=question, tenant=tenant, **(request_kw or {}))
    request = shape(engine, draft).request
    store_admission = getattr(engine.store, "admission", None)
    try:
        due = _lazy_admission(engine, retriever, hits, tenant)
        result = _stream(engine, request, sampling, on_text)
        engine.flush()
    finally:  # the swap is for this request's write-back only, never the engine's from now on
        if store_admission is not None:
            engine.store.admission = store_admission
    if due:
        retriever.catalog.mark_kv_ready(tenant, due)
    full = None
    if compare:
        full = engine.generate(Request(**{**{f.name: getattr(request, f.name) for f in fields(request)},
                                          "method": "full"}), sampling)
    return Answer(hits, result, full)
