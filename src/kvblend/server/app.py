"""``create_app(engine_or_scheduler, settings)``: the OpenAI-compatible FastAPI app.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST|GET /v1/documents``, ``GET|DELETE /v1/documents/{id}``, ``GET /v1/kvblend/store``
(the caller's store view), ``GET /health``, ``GET /metrics``, and the playground page at
``GET /`` (``playground.py``). The app is a factory over an ``Engine`` (wrapped in a ``Scheduler``)
or a ready ``Scheduler``, so the same app can run under uvicorn or as a replica of a
Ray Serve deployment. Every request is scoped by the tenant its API key maps to
(``auth.ApiKeyAuth``); one JSON log line per completion request never holds document text
or ids. The event loop never waits on the document registry: its calls run on the
registry's own threads (``ServerState.off_loop``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest

from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import RequestHandle, Scheduler
from kvblend.errors import KvblendError
from kvblend.models.loader import cache_home
from kvblend.server.documents import (
    DocumentRecord, DocumentRegistry, KeyedLocks, RegistryConflictError, RegistryFullError, StoredChunk, default_id,
    new_record, text_sha256,
)
from kvblend.server.errors import APIError, bad_request, from_exception, from_validation
from kvblend.server.auth import ApiKeyAuth, read_json, tenant_of
from kvblend.server.explain import explainer
from kvblend.server.metrics import ServerMetrics, kv_cache_usage
from kvblend.server.observer import MetricsObserver
from kvblend.server.playground import add_playground
from kvblend.server.protocol import ChatCompletionRequest, CompletionRequest, DocumentCreate, check_doc_id
from kvblend.server.quality import ServerGuard, open_guard
from kvblend.server.retrieval import check_retrieval, open_retriever, query_text, search, sources
from kvblend.server.responses import Shape, SSEResponse, StreamResult, run_to_end, sse_stream
from kvblend.server.storeview import documents_summary, store_summary
from kvblend.engine.discovery import Sightings
from kvblend.engine.matching import DocumentIndex
from kvblend.engine.shaping import chunk_texts
from kvblend.server.index import IndexFeed, ingest_catalog, open_index
from kvblend.server.logprobs import token_text
from kvblend.server.tools import tool_plan
from kvblend.server.translate import (
    build_draft, check_common, check_format, document_chunks, parse, sampling_params, shape_body, utf8_len,
)
from kvblend.server.usage import cached_tokens, reused_docs
from kvblend.settings import Settings
from kvblend.store.keys import ChunkKey

log = logging.getLogger("kvblend.server")
access = logging.getLogger("kvblend.server.requests")
T = TypeVar("T")
REGISTRY_THREADS = 4


@dataclass
class ServerState:
    """Everything the routes share."""

    settings: Settings
    engine: Engine
    scheduler: Scheduler
    metrics: ServerMetrics
    registry: DocumentRegistry
    model_id: str
    model_ids: tuple[str, ...]
    retriever: Any = None  # server.retrieval.IndexReader when settings.retrieval.enabled
    guard: ServerGuard | None = None  # when settings.guard.enabled
    index: DocumentIndex | None = None  # stored texts found in messages (settings.documents.match), set at startup
    index_feed: IndexFeed | None = None  # other processes' document changes, applied to ``index`` before shaping
    # passages pasted before, per tenant (settings.documents.discover_after): discovery's admission
    sightings: Sightings = field(default_factory=Sightings)
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    exposition: Callable[[], bytes] | None = None  # /metrics body; None: this app's registry (Ray Serve: cluster.metrics)
    # told the chunk keys a deletion freed, after they left this app's store, and those a
    # stored document uses, before they are computed (Ray Serve: the replicas' own tiers,
    # cluster.purge); None: this store is the only one
    purge: Callable[[list[str]], None] | None = None
    revive: Callable[[list[str]], None] | None = None
    # answer X-Request-Id (the completion's id); False behind Ray Serve's proxy, which
    # answers its own request id there (a second one would make the header a list)
    request_id_header: bool = True
    registry_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        REGISTRY_THREADS, thread_name_prefix="kvblend-registry"))
    document_locks: KeyedLocks = field(default_factory=KeyedLocks)  # one POST/DELETE per (tenant, id) at a time

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the registry's threads (anything that reads or writes the
        registry goes through here); the loop only awaits it. Exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.registry_pool, functools.partial(fn, *args))

    @property
    def context_length(self) -> int:
        return self.engine.loaded.config.context_length

    @property
    def num_layers(self) -> int:
        return len(self.engine.model.layers)


def _registry_path(settings: Settings) -> Path:
    root = Path(settings.state_dir) if settings.state_dir else cache_home() / "server"
    return root / "documents.sqlite"


def _tier_stats(engine: Engine) -> dict[str, Any]:
    fn = getattr(engine.store, "tier_stats", None)
    if fn is None:
        return {"store": engine.store.stats()}
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a scrape must not fail because a tier is down
        log.warning("store statistics unavailable", exc_info=True)
        return {}


def build_scheduler(engine: Engine, settings: Settings) -> Scheduler:
    """The model worker over ``engine`` as ``settings.scheduler`` sizes it (not started)."""
    sch = settings.scheduler
    return Scheduler(engine, max_running=sch.max_running, max_queued=sch.max_queued,
                     deadline_s=sch.request_deadline_s, max_background=sch.max_background,
                     prefill_chunk_tokens=sch.prefill_chunk_tokens, max_jobs=sch.max_jobs,
                     shares=sch.shares(), decode_weight=sch.decode_weight,
                     stall_steps=sch.max_stall_steps, interleave=sch.interleave)


def server_metrics(model_id: str, engine: Engine, scheduler: Any) -> ServerMetrics:
    """The app's metrics over ``scheduler``'s gauges and ``engine``'s store; the scheduler's
    observer is wrapped so that finished requests feed them."""
    metrics = ServerMetrics(model_id, lambda: scheduler.num_running, lambda: scheduler.num_waiting,
                            lambda: _tier_stats(engine), background=lambda: scheduler.num_background,
                            cache_usage=lambda: kv_cache_usage(engine.store), jobs=lambda: scheduler.num_jobs,
                            parked=lambda: getattr(scheduler, "num_parked", 0))  # a remote stand-in parks nothing
    scheduler.observer = MetricsObserver(metrics, scheduler.observer)
    return metrics


def build_state(target: Engine | Scheduler, settings: Settings, scheduler: Any = None) -> ServerState:
    """``scheduler``: a stand-in for a remote model worker (``kvblend.cluster.remote``); the
    engine then only shapes requests (tokenizer, layout, keys, the shared store tiers)."""
    if scheduler is not None:
        engine = target
    elif isinstance(target, Scheduler):
        scheduler, engine = target, target.engine
    else:
        engine = target
        scheduler = build_scheduler(engine, settings)
    model_id = settings.model_id
    metrics = server_metrics(model_id, engine, scheduler)
    registry = DocumentRegistry(_registry_path(settings))
    ids = tuple(dict.fromkeys([model_id, settings.model, engine.loaded.name]))
    retriever = open_retriever(settings, engine.loaded.tokenizer_fingerprint)
    guard = open_guard(settings.guard, metrics.registry, model_id, engine.loaded.name, scheduler)
    return ServerState(settings, engine, scheduler, metrics, registry, model_id, ids, retriever, guard,
                       sightings=Sightings(settings.documents.discover_after))


def create_app(target: Engine | Scheduler, settings: Settings | None = None, *, scheduler: Any = None) -> FastAPI:
    """The app over an engine (a scheduler is built from ``settings.scheduler``) or over a
    scheduler. The scheduler's worker starts with the app; app shutdown drains it.

    ``scheduler``: instead, a stand-in for model workers elsewhere (the Ray Serve ingress:
    ``kvblend.cluster.remote.RemoteScheduler``) with the scheduler's caller side plus
    ``asubmit`` and ``compute_documents``; ``target`` is then the engine that shapes requests."""
    settings = settings or Settings.load()
    state = build_state(target, settings, scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.scheduler.started:  # a scheduler may be handed in already running
            state.scheduler.start()
        state.index_feed = await state.off_loop(open_index, settings, state.registry, state.engine.tokenizer,
                                                ingest_catalog(settings, state.engine.loaded.tokenizer_fingerprint))
        state.index = state.index_feed.index if state.index_feed is not None else None
        follower = asyncio.create_task(_follow_registry(state)) if state.index_feed is not None else None
        yield
        if follower is not None:
            follower.cancel()
        state.draining = True
        if not state.scheduler.draining:
            await anyio.to_thread.run_sync(state.scheduler.drain, settings.drain_timeout_s)
        await anyio.to_thread.run_sync(_close_registry, state)  # drain dropped any pending shadow checks (counted)
        if state.index_feed is not None and state.index_feed.ingested is not None:
            state.index_feed.ingested.close()
        if state.retriever is not None:
            state.retriever.close()

    app = FastAPI(title="kvblend", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=_AsciiJSON)
    app.state.kvblend = state
    app.add_middleware(ApiKeyAuth, api_keys=settings.api_keys, admin_key=settings.admin_key,
                       max_body_bytes=settings.limits.max_body_bytes,
                       draining=lambda: state.draining or state.scheduler.draining)
    _install_error_handlers(app, state)
    _add_routes(app, state)
    add_playground(app)
    return app


def _close_registry(state: ServerState) -> None:
    """Wait for the registry's running calls, then close it (blocks: run it off the loop)."""
    state.registry_pool.shutdown(wait=True)
    state.registry.close()


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII characters escaped: what a route returns may hold stored client
    text (a document's metadata written before it was checked could hold a lone surrogate,
    which UTF-8 cannot encode); escaped, it is still the same JSON to every client."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_response(err: APIError) -> Response:
    """The OpenAI error body, ASCII-escaped: a message may quote what the client sent, and
    a lone surrogate escape in it (valid JSON, not valid UTF-8) must not turn a 4xx into a 500."""
    return Response(err.json(), status_code=err.status, headers=err.headers, media_type="application/json")


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def _api(request: HTTPRequest, exc: APIError) -> Response:
        state.metrics.error(exc.type)
        access.info(json.dumps({"event": "request", "path": request.url.path, "tenant": tenant_of(request),
                                "status": exc.status, "error": exc.type, "param": exc.param}))
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: HTTPRequest, exc: RequestValidationError) -> Response:
        err = from_validation(exc)
        state.metrics.error(err.type)
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: HTTPRequest, exc: StarletteHTTPException) -> Response:
        return _error_response(APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(_: HTTPRequest, exc: Exception) -> Response:
        err = from_exception(exc)  # logs the cause
        state.metrics.error(err.type)
        return _error_response(err)


def _answers_errors(fn):
    """Route wrapper: an unexpected exception becomes the bare 500 APIError (cause logged)
    here, so it is answered by the APIError handler instead of escaping to the ASGI server."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except (APIError, StarletteHTTPException, RequestValidationError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, logged, never sent
            raise from_exception(exc) from None

    return wrapper


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.get("/health")
    @_answers_errors
    async def health() -> Response:
        ok = state.scheduler.alive and not state.draining and not state.scheduler.draining
        return Response(status_code=200 if ok else 503,
                        headers={"X-Kvblend-Worker-Restarts": str(state.scheduler.restarts)})

    @app.get("/metrics")
    @_answers_errors
    async def metrics() -> Response:
        expose = state.exposition or functools.partial(generate_latest, state.metrics.registry)
        data = await anyio.to_thread.run_sync(expose)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @_answers_errors
    async def models() -> dict[str, Any]:
        card = {"id": state.model_id, "object": "model", "created": state.started, "owned_by": "kvblend",
                "max_model_len": state.context_length}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    @_answers_errors
    async def chat(request: HTTPRequest) -> Response:
        return await _complete(request, state, ChatCompletionRequest)

    @app.post("/v1/completions")
    @_answers_errors
    async def completions(request: HTTPRequest) -> Response:
        return await _complete(request, state, CompletionRequest)

    @app.post("/v1/documents")
    @_answers_errors
    async def post_document(request: HTTPRequest) -> dict[str, Any]:
        body = parse(DocumentCreate, await read_json(request, settings.limits.max_body_bytes))
        return await _store_document(state, tenant_of(request), body)

    @app.get("/v1/documents")
    @_answers_errors
    async def list_documents(request: HTTPRequest, limit: int = 100, after: str | None = None) -> dict[str, Any]:
        if not 1 <= limit <= 1000:
            raise APIError(400, "limit must be within 1..1000", "limit")
        rows = await state.off_loop(state.registry.list, tenant_of(request), limit + 1, after)
        more, rows = len(rows) > limit, rows[:limit]  # one row past the page says whether there is more
        return {"object": "list", "data": [r.public() for r in rows], "has_more": more,
                "last_id": rows[-1].id if rows else None}

    @app.get("/v1/documents/{doc_id}")
    @_answers_errors
    async def get_document(request: HTTPRequest, doc_id: str) -> dict[str, Any]:
        record = await _own_document(state, tenant_of(request), doc_id)
        tiers = await anyio.to_thread.run_sync(_tiers_holding_all, state.engine, record.keys)
        return record.public(tiers, detail=True)

    @app.get("/v1/kvblend/store")
    @_answers_errors
    async def store_view(request: HTTPRequest) -> dict[str, Any]:
        tenant = tenant_of(request)
        documents = await state.off_loop(documents_summary, state.registry, tenant)
        return await anyio.to_thread.run_sync(store_summary, state.engine, settings, tenant, documents)

    @app.delete("/v1/documents/{doc_id}")
    @_answers_errors
    async def delete_document(request: HTTPRequest, doc_id: str) -> dict[str, Any]:
        tenant = tenant_of(request)
        async with state.document_locks.hold((tenant, doc_id)):
            record = await _own_document(state, tenant, doc_id)
            await state.off_loop(state.registry.delete, tenant, doc_id)
            if state.index_feed is not None:  # off the loop: the index's lock may be held by a match
                await anyio.to_thread.run_sync(state.index_feed.deleted, tenant, doc_id)
            await _delete_unused(state, tenant, record.keys, doc_id)
        return {"id": doc_id, "object": "document", "deleted": True}


# ----- documents ----------------------------------------------------------------------------
async def _own_document(state: ServerState, tenant: str, doc_id: str) -> DocumentRecord:
    try:
        check_doc_id(doc_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "id") from None
    record = await state.off_loop(state.registry.get, tenant, doc_id)
    if record is None:  # the same answer whether another tenant has this id or nobody does
        raise APIError(404, f"no stored document with id {doc_id!r}", "id", "NotFoundError")
    return record


def _tiers_holding(engine: Engine, key_text: str) -> list[str]:
    key = ChunkKey.parse(key_text)
    tiers = getattr(engine.store, "tiers", None)
    if tiers is None:
        return ["store"] if engine.store.contains(key) else []
    return [t.name for t in tiers if t.contains(key)]


def _tiers_holding_all(engine: Engine, keys: list[str]) -> list[str]:
    """The tiers (in the store's order) that hold the KV of every one of ``keys``."""
    held = [_tiers_holding(engine, k) for k in keys]
    return [t for t in held[0] if all(t in h for h in held[1:])] if held else []


async def _delete_unused(state: ServerState, tenant: str, keys: list[str], doc_id: str) -> None:
    """Delete from every tier the KV under ``keys`` that no document of the tenant but
    ``doc_id`` uses (the registry's key index answers; the store is called off the loop)."""
    shared = await state.off_loop(state.registry.keys_in_use, tenant, keys, doc_id)
    unused = [key for key in dict.fromkeys(keys) if key not in shared]
    if unused:
        await anyio.to_thread.run_sync(_delete_keys, state.engine, unused)
    if unused:
        await _tell_replicas(state.purge, unused, tenant, "delete")


async def _tell_replicas(tell: Callable[[list[str]], None] | None, keys: list[str], tenant: str, what: str) -> None:
    """``ServerState.purge``/``revive`` on a thread; a failure is logged, not raised: the
    request's own work is done (a copy left or deleted elsewhere is a cache's, not an answer's)."""
    if tell is None or not keys:
        return
    try:
        await anyio.to_thread.run_sync(tell, keys)
    except Exception:  # noqa: BLE001 - see above
        log.error("could not tell the other replicas to %s %d chunk entries of tenant %s", what, len(keys), tenant,
                  exc_info=True)


def _delete_keys(engine: Engine, keys: list[str]) -> None:
    for key in keys:
        engine.store.delete(ChunkKey.parse(key))
    engine.forget_blends(keys)


def _document_chunk_prefix(engine: Engine, settings: Settings) -> tuple[int, ...]:
    """The chunk prefix a chat request with the server's defaults computes documents after."""
    probe = Request(documents=(), messages=[{"role": "user", "content": "?"}], blend=settings.blend.blend_config())
    return engine.chunk_prefix(probe, engine.layout(probe))


async def _store_document(state: ServerState, tenant: str, body: DocumentCreate) -> dict[str, Any]:
    """Check, warm and register a document. One POST or DELETE per ``(tenant, id)`` runs at a
    time (two POSTs of one id with other texts: the second sees the first and gets a 409);
    the tenant's document count is checked again in the registry's put transaction."""
    limits = state.settings.limits
    size = utf8_len(body.text, "text")
    if size > limits.max_document_bytes:
        raise APIError(413, f"the document has {size} bytes; the limit is {limits.max_document_bytes}", "text")
    if not body.text.strip():
        raise APIError(400, "the document text is empty", "text")
    doc_id = body.id or default_id(body.text)

    def cut() -> tuple[list[Any], tuple[int, ...], Any]:
        engine = state.engine
        chunks = document_chunks(engine, body.text, state.settings.documents.chunk_tokens)
        tokens = sum(c.n_tokens for c in chunks)
        if tokens > limits.max_document_tokens:
            raise APIError(413, f"the document has {tokens} tokens; the limit is {limits.max_document_tokens}",
                           "text")
        if not chunks or tokens == 0:
            raise APIError(400, "the document text has no tokens", "text")
        prefix = _document_chunk_prefix(engine, state.settings)
        return chunks, prefix, engine.plan_warm([c.token_ids for c in chunks], prefix, tenant)

    indexed: list[Any] = []  # the chunks' texts, indexed for matching once the document is registered

    async def warm() -> tuple[list[StoredChunk], list[str]]:
        """Cut and key the text (a thread), compute the missing chunks' KV on the model
        worker (its jobs lane: 429 when full), store them (a thread)."""
        chunks, prefix, plan = await anyio.to_thread.run_sync(cut)
        keys = [str(k) for k in plan.keys]
        # before they are computed: a replica replaying an earlier deletion must not drop them
        await _tell_replicas(state.revive, keys, tenant, "keep")
        if plan.todo:
            await _compute_documents(state, plan.todo, prefix, f"document ({tenant})")
        stored = [StoredChunk(c.chunk_id, k, c.token_ids) for c, k in zip(chunks, keys)]
        indexed.extend(chunk_texts(body.text, chunks, doc_id))
        return stored, await anyio.to_thread.run_sync(_tiers_holding_all, state.engine, keys)

    async with state.document_locks.hold((tenant, doc_id)):
        existing = await state.off_loop(state.registry.get, tenant, doc_id)
        if existing is not None and existing.sha256 != text_sha256(body.text):
            raise APIError(409, f"document {doc_id!r} exists with other text; delete it first", "id")
        if existing is None and await state.off_loop(state.registry.count, tenant) >= limits.max_stored_documents:
            raise APIError(400, f"at most {limits.max_stored_documents} stored documents per tenant", "id")
        chunks, tiers = await warm()
        record = new_record(doc_id, body.text, chunks, body.metadata)
        if existing is not None:  # idempotent: the same text keeps its creation time
            record = record._replace(created=existing.created)
        if record._replace(created=0.0) != (existing._replace(created=0.0) if existing is not None else None):
            await _put_document(state, tenant, record, existing)
        if state.index_feed is not None:  # after a refused put nothing names a document never registered
            await state.off_loop(state.index_feed.stored, tenant, doc_id, record.sha256, indexed)
    return record.public(tiers)


async def _compute_documents(state: ServerState, todo: list[tuple[ChunkKey, tuple[int, ...]]],
                             prefix: tuple[int, ...], name: str) -> None:
    """Compute and store the chunks ``todo`` on the model worker: here on its jobs lane, or
    on a model replica's (whose store writes the shared tiers) for a remote stand-in."""
    if not isinstance(state.scheduler, Scheduler):
        try:
            await state.scheduler.compute_documents(todo, prefix, name)
        except KvblendError as exc:
            raise from_exception(exc) from None
        return
    computed = await _run_job(state, state.engine.compute_steps(todo, prefix), name)
    await anyio.to_thread.run_sync(state.engine.put_chunks, computed)


async def _submit(state: ServerState, request: Request, sampling: Any) -> RequestHandle:
    """Queue the request on the model worker; a remote stand-in answers once a replica
    accepted it, so that its refusals (429, 503) are still the response's status."""
    try:
        if isinstance(state.scheduler, Scheduler):
            return state.scheduler.submit(request, sampling)
        return await state.scheduler.asubmit(request, sampling)
    except KvblendError as exc:
        raise from_exception(exc) from None


async def _run_job(state: ServerState, steps: Any, name: str) -> Any:
    """Model work as a job of the scheduler's jobs lane, awaited here; its refusals as
    HTTP errors (429 when the lane is full, 503 while draining)."""
    try:
        future = state.scheduler.submit_job(steps, name)
    except KvblendError as exc:
        raise from_exception(exc) from None
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if future.cancelled():  # dropped by drain or worker death, not our caller's cancellation
            raise APIError(503, "the server stopped before this work ran") from None
        raise


async def _put_document(state: ServerState, tenant: str, record: DocumentRecord,
                        existing: DocumentRecord | None) -> None:
    """Register ``record`` if the row is still ``existing`` (another process sharing the
    registry may have stored the id meanwhile: 409, as for a known id with other text);
    refused for the tenant's count (400). Refused, the KV just warmed for it is dropped.
    Replacing a row cut otherwise (the chunk size changed) drops the old chunks' KV."""
    put = functools.partial(state.registry.put, expect=existing.sha256 if existing is not None else None)
    try:
        await state.off_loop(put, tenant, record, state.settings.limits.max_stored_documents)
    except RegistryFullError as exc:
        await _delete_unused(state, tenant, record.keys, record.id)
        raise APIError(400, str(exc), "id") from None
    except RegistryConflictError:
        current = await state.off_loop(state.registry.get, tenant, record.id)
        theirs = set(current.keys) if current is not None else set()
        await _delete_unused(state, tenant, [k for k in record.keys if k not in theirs], record.id)
        raise APIError(409, f"document {record.id!r} was stored with other text meanwhile; delete it first",
                       "id") from None
    if existing is not None:
        await _delete_unused(state, tenant, [k for k in existing.keys if k not in record.keys], record.id)


# ----- completions --------------------------------------------------------------------------
async def _complete(http: HTTPRequest, state: ServerState, model: type) -> Response:
    settings = state.settings
    tenant = tenant_of(http)
    started = time.perf_counter()
    body = parse(model, await read_json(http, settings.limits.max_body_bytes))
    check_common(body, settings, state.model_ids)
    top_k = check_retrieval(body, settings, state.retriever)
    plan = tool_plan(body, state.engine.tokenizer) if model is ChatCompletionRequest else None
    draft, used = build_draft(body, settings, tenant, state.num_layers, plan.tools if plan else None), None
    if top_k is not None:  # the caller's own tenant's chunks, as the token ids they were indexed with
        hits = await anyio.to_thread.run_sync(search, state.retriever, tenant, query_text(body), top_k)
        draft = dataclasses.replace(draft, documents=[h.token_ids for h in hits])
        used = tuple(sources(hits))
    param = "messages" if model is ChatCompletionRequest else "prompt"
    shaped = await state.off_loop(_shape, state, draft, param)
    request, prompt_tokens = shaped.request, shaped.prompt_tokens
    explains = None
    if request.explain:  # shape expanded and cut every document given: one piece each from here
        explains = explainer(request, state.engine.tokenizer, shaped.pieces, [1] * len(request.documents),
                             settings.limits)
    sampling = sampling_params(body, settings, prompt_tokens, state.context_length,
                               state.engine.loaded.config.vocab_size)
    if plan is not None and plan.parses and body.stream and sampling.logprobs is not None:
        raise bad_request("logprobs are not streamed with tools (a held-back call's tokens have none); "
                          "ask without stream", "logprobs")
    forced = plan.forced() if plan is not None else None
    if forced is not None:  # required or a named function: the grammar writes one call
        if sampling.response_format is not None:
            raise bad_request("a forced tool_choice and a response_format cannot both shape the answer",
                              "tool_choice")
        sampling = dataclasses.replace(sampling, response_format=forced)
    # a schema that does not compile: 400
    await anyio.to_thread.run_sync(check_format, state.engine, sampling, "tools" if forced else None)
    routing = state.guard.route(request) if state.guard is not None else None
    if routing is not None:
        request = routing.request
    handle = await _submit(state, request, sampling)
    matches = tuple(m.to_dict() for m in shaped.matches) if shaped.matches else None
    shape = Shape(chat=model is ChatCompletionRequest, model=state.model_id, sources=used, matches=matches,
                  explain=explains.block if explains is not None else None, replica=handle.replica, n=sampling.n,
                  token_text=token_text(state.engine.tokenizer) if sampling.logprobs is not None else None,
                  tools=plan if plan is not None and plan.parses else None)
    headers = {"X-Request-Id": shape.object_id} if state.request_id_header else {}
    if handle.replica is not None:
        headers["X-Kvblend-Replica"] = handle.replica
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)

    def finish(out: StreamResult) -> None:
        guarded = {}
        if routing is not None:  # the shadow check is queued, never awaited
            guarded = {"guard": routing.fallback, "shadow": state.guard.after(routing, out)}
        _account(state, handle, tenant, shape, out, started, {**guarded, **_client_request_id(http)})

    if body.stream:
        out = StreamResult()
        return SSEResponse(handle, out, finish, sse_stream(handle, shape, include_usage, out, finish, continuous),
                           headers={"Cache-Control": "no-cache", **headers})
    out = StreamResult()
    try:
        await run_to_end(handle, http, out)
    except asyncio.CancelledError:  # the client left and the proxy cancelled this handler
        try:
            finish(out)
        except Exception:  # noqa: BLE001 - the cancellation goes on whatever the accounting did
            log.exception("accounting for a cancelled request failed")
        raise
    if handle.replica is not None and handle.replica != shape.replica:  # sent again to another replica after its first was lost
        shape = dataclasses.replace(shape, replica=handle.replica)
        headers["X-Kvblend-Replica"] = handle.replica
    finish(out)
    if out.error is not None:
        return _error_response(out.error)
    if out.disconnected:
        return Response(status_code=499)
    return JSONResponse(shape.completion(out, handle.queue_s), headers=headers)


REQUEST_CATCH_UP = 16  # document changes from other processes one request applies at most before it is shaped
FOLLOW_S = 1.0  # how often the app applies them in the background


async def _follow_registry(state: ServerState) -> None:
    """Apply other processes' document changes every ``FOLLOW_S`` (on the registry's
    threads, never waiting for a request that is applying them), so that matching follows
    a bulk upload through another ingress without the requests here paying for it."""
    while True:
        await asyncio.sleep(FOLLOW_S)
        try:
            await state.off_loop(state.index_feed.catch_up, None, False)
        except Exception:  # noqa: BLE001 - the next round tries again; requests catch up too
            log.exception("applying other processes' document changes failed")


def _shape(state: ServerState, draft: Any, param: str) -> Any:
    """``shape_body`` (on the registry's threads) once the matching index has caught up
    with documents other processes sharing the registry stored or deleted: a bounded
    share of them, and none when another thread is applying them already (a bulk upload
    through another ingress is indexed by ``_follow_registry``, not by one request)."""
    if state.index_feed is not None:
        state.index_feed.catch_up(REQUEST_CATCH_UP, wait=False)
    return shape_body(state.engine, draft, state.settings, state.registry, state.index, param, state.sightings)


MAX_REQUEST_ID = 128  # characters of a client's X-Request-Id kept in the log line


def _client_request_id(http: HTTPRequest) -> dict[str, str]:
    """``{"request_id": ...}`` from the request's X-Request-Id (the client's, or Ray Serve's
    proxy's), printable ASCII and bounded; empty without one. The log line then ties the
    completion's id to the id the client saw."""
    value = http.headers.get("x-request-id")
    if not value:
        return {}
    return {"request_id": "".join(ch for ch in value[:MAX_REQUEST_ID] if " " <= ch <= "~")}


def _account(state: ServerState, handle: RequestHandle, tenant: str, shape: Shape, out: StreamResult,
             started: float, guarded: dict[str, Any] | None = None) -> None:
    """Metrics for what only the HTTP layer sees, and the request's one log line."""
    if out.disconnected:
        state.metrics.disconnects.inc()
    if out.error is not None:
        state.metrics.error(out.error.type)
    status = 499 if out.disconnected else (out.error.status if out.error else 200)
    stats = out.stats
    line = {
        "event": "request", "id": shape.object_id, "tenant": tenant, "route": "chat" if shape.chat else "completions",
        "status": status, "method": handle.request.method,
        "prompt_tokens": stats.prompt_tokens if stats else None, "completion_tokens": out.tokens,
        "cached_tokens": cached_tokens(stats) if stats else None,
        "doc_hits": len(reused_docs(stats)) if stats else None,
        "docs": len(handle.request.documents), "retrieved": len(shape.sources) if shape.sources is not None else None,
        "recompute_fraction": round(stats.recompute_frac, 4) if stats else None,
        "queue_s": round(handle.queue_s, 4), "ttft_s": round(stats.ttft_s, 4) if stats else None,
        "e2e_s": round(time.perf_counter() - started, 4), "finish_reason": out.finish_reason,
        "error": out.error.type if out.error else None, **(guarded or {}),
    }
    if handle.replica is not None:
        line["replica"] = handle.replica
    access.info(json.dumps(line))


__all__ = ["ServerState", "build_scheduler", "create_app", "server_metrics"]
