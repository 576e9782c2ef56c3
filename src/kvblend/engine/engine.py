"""The engine: one request from documents to streamed tokens, by any method.

    layout  = render_layout(...)             # prefix | doc_1 | gap | ... doc_n | suffix ids
                                              # (or the request's, shaped and rendered once)
    prefix  = prefix_cache.lookup(...)        # exact reuse of the longest known prefix
    chunks  = store.locate(key(doc)) per doc  # memory: lent whole; disk/Redis: read per layer
    fused   = fuse(model, plan)               # re-rotate + selective recompute, while a
                                              # loader thread fetches the next layer
    tokens  = stream_from(model, fused.cache) # decode
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvblend import rope as rope_lib
from kvblend.blend.chunks import compute_chunk_steps
from kvblend.blend.config import BlendConfig
from kvblend.blend.fusion import FusionOutput, FusionPlan, PlacedChunk, SlicedKV, fuse_or_drop_steps, unsliced
from kvblend.blend.strategies import fuse_planned_steps, risk_kind
from kvblend.blend.layout import PromptLayout, render_layout, tokenize_document
from kvblend.engine.allocator import keep_freed_memory
from kvblend.engine.explain import doc_selections
from kvblend.engine.gate import RequestGate
from kvblend.engine.prefix_cache import PrefixCache, PrefixHit, PrefixScope
from kvblend.engine.request import CheckStat, DocStat, Request, RequestStats, Result, result_of
from kvblend.errors import ContextLengthError, InvalidRequestError
from kvblend.generation import SamplingParams, StreamEvent, stream_from
from kvblend.generation.chunked import SliceSize, Steps, forward_chunks, run_steps
from kvblend.engine.calibration import ShiftVerdict, calibrate_later, ensure_calibrated, is_known, known_verdict
from kvblend.engine.escalation import RiskWindows
from kvblend.engine.selfcheck import SelfCheckResult, ensure_checked
from kvblend.models.kv_cache import KVCache
from kvblend.models.loader import LoadedModel
from kvblend.pipeline.controller import DocLoad, RatioChoice, choose_ratio, choose_tier
from kvblend.pipeline.loader import LayerFeed, LoadFailure, LoadStats, PendingChunk
from kvblend.pipeline.profile import Profile, load_profile, measure_profile, measure_tier, profile_path, save_profile
from kvblend.store.base import ChunkStore
from kvblend.store.chunk import ChunkKV
from kvblend.store.codec import compute_dtype_name
from kvblend.store.config import StoreConfig, build_store
from kvblend.store.keys import ChunkKey, KeyContext, chunk_key
from kvblend.store.writeback import WriteBack, WriteBackStats

log = logging.getLogger(__name__)
DEFAULT_WRITEBACK_QUEUE = 64
BLENDED = "|blend:"  # in the dtype of a scope that keeps blends whole (``Engine.blended_scope``)


class Prepared(NamedTuple):
    """A prompt ready to decode: its cache, next-token logits, and how it was built.
    ``exact_tokens``: how many leading positions of ``cache`` hold exactly the KV a full
    prefill computes, and entered the prefix cache (0 for ``full``, which caches nothing).
    ``blended``: where a blend's prompt (not exact) and answer may be remembered whole
    (``Engine.remember_answer``), and what a request served from it reports."""

    layout: PromptLayout
    cache: KVCache
    logits: torch.Tensor  # (V,)
    stats: RequestStats
    exact_tokens: int = 0
    blended: BlendedEntry | None = None


class BlendedEntry(NamedTuple):
    """A blended prompt's KV kept whole in the prefix cache (its own scope per blend
    config): a repeat of the prompt, or a chat's next turn that extends it with the answer,
    is served the same KV, so it gets the first blend's answer without blending again. The
    KV is valid only as a whole sequence (its selection read the whole prompt), so it is
    looked up with ``whole_entries``. ``risk``/``escalated``: the first blend's, reported
    again by each request served from it."""

    scope: PrefixScope
    risk: float | None
    escalated: bool


class WarmPlan(NamedTuple):
    """What precomputing documents takes: every document's chunk key, and the (key, token
    ids) that still need computing."""

    keys: list[ChunkKey]
    todo: list[tuple[ChunkKey, tuple[int, ...]]]


class _Built(NamedTuple):
    """What a prefill path produced, before stats are assembled."""

    cache: KVCache
    logits: torch.Tensor
    prefix_hit: int
    docs: list[DocStat]
    recomputed: list[int]
    candidates: int
    fallback: str | None = None
    checks: tuple[CheckStat, ...] = ()
    loading: LoadStats | None = None
    controller: RatioChoice | None = None
    risk: float | None = None
    strategy: str | None = None  # the blend's as run (``Engine.blend_config``)
    escalated: bool = False  # the blend recomputed again at twice its ratio (``engine.escalation``)
    exact: int = 0  # leading positions whose KV is exact and entered the prefix cache
    blended: BlendedEntry | None = None


def _doc_checks(out: FusionOutput, layout: PromptLayout, placed: list[PlacedChunk],
                explain: bool = False) -> tuple[CheckStat, ...]:
    """Fusion's per-check selection, with kept tokens counted per request document (and,
    to ``explain``, listed per document)."""
    doc_at = {start: i for i, (start, d) in enumerate(zip(layout.doc_starts, layout.docs)) if d}
    where = [doc_at[p.start] for p in placed]
    spans = [(p.start, p.start + p.chunk.n_tokens) for p in placed]
    result = []
    for c in out.checks:
        per_doc = [0] * len(layout.docs)
        for doc, n in zip(where, c.kept_per_span.tolist()):
            per_doc[doc] += n
        detail = c.detail if explain else None
        tokens = None if detail is None else doc_selections(detail, spans, where, len(layout.docs))
        result.append(CheckStat(c.layer, c.candidates, c.kept, float(c.mean_score), float(c.max_score), per_doc,
                                tokens))
    return tuple(result)


@dataclass
class _Timer:
    """Per-request wall-clock breakdown."""

    start: float = field(default_factory=time.perf_counter)
    parts: dict[str, float] = field(default_factory=lambda: {"lookup": 0.0, "load": 0.0, "prefill": 0.0})

    def add(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.parts[name] += now - since
        return now


@dataclass
class _Chunks:
    """Per-request result of looking up every document."""

    placed: list[PlacedChunk] = field(default_factory=list)
    stats: list[DocStat] = field(default_factory=list)
    misses: dict[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    feed: LayerFeed | None = None  # loads slow-tier chunks layer by layer during fusion
    pending: dict[int, tuple[ChunkKey, PendingChunk]] = field(default_factory=dict)  # by document index
    # (start, key, ids, run) to compute alone: a document, or the chunk a run (offset, n) is of
    alone: list[tuple[int, ChunkKey, tuple[int, ...], tuple[int, int] | None]] = field(default_factory=list)


def _fall_back(chunks: _Chunks, dropped: set[int], pipelined: bool) -> LoadStats:
    """Mark the documents fusion had to recompute (their chunk failed to load) as misses,
    so they are reported and written back; the request's loading stats."""
    failures = []
    for i, (key, pending) in chunks.pending.items():
        if id(pending) not in dropped:
            continue
        failure = pending.failure() or LoadFailure(pending.slot, pending.source.tier_name, -1, "missing or corrupt")
        failures.append(failure._replace(slot=i))
        chunks.stats[i] = DocStat(i, chunks.stats[i].tokens, False, "fallback")
        chunks.misses[key] = pending.source.token_ids
    feed = chunks.feed
    if feed is None:
        return LoadStats(pipelined, 0, (), 0.0, tuple(failures))
    return LoadStats(pipelined, len(feed), tuple(feed.wait_s), feed.read_s, tuple(failures))


def _little_reuse(chunks: _Chunks, covered: int, n: int, cfg: BlendConfig) -> bool:
    """Whether a blend would reuse less than ``cfg.min_reuse`` of the prompt's ``n`` tokens
    (its ``covered`` prefix hit and its stored documents after it) and has no missed document
    to compute alone and store (``BlendConfig.min_reuse``): an exact prefill is then cheaper
    than fusion, and exact."""
    if chunks.alone or cfg.min_reuse <= 0:
        return False
    return covered + sum(d.tokens for d in chunks.stats if d.hit) < cfg.min_reuse * n


def _skip_loading(chunks: _Chunks) -> None:
    """At ratio 1 every document token is recomputed and the slow tiers' KV would only be
    waited for: do not load it (the documents are computed, like misses, and not written back)."""
    chunks.placed = [p for p in chunks.placed if not isinstance(unsliced(p.chunk), PendingChunk)]
    for i in chunks.pending:
        chunks.stats[i] = DocStat(i, chunks.stats[i].tokens, False, "skipped")
    chunks.pending.clear()
    chunks.feed = None


def _whole_documents(hit: PrefixHit | None, layout: PromptLayout) -> PrefixHit | None:
    """``hit`` cut back to the start of a document it ends inside, so that every document
    lies wholly inside the exact prefix or wholly after it; None when nothing is left."""
    if hit is None:
        return None
    length = hit.length
    for start, doc in zip(layout.doc_starts, layout.docs):
        if start < length < start + len(doc):
            length = start
            break
    if length == hit.length:
        return hit
    if length == 0:
        return None
    return PrefixHit(length, [k[:, :length] for k in hit.keys], [v[:, :length] for v in hit.values])


def sink_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The token chunk KV is computed after under the ``bos`` chunk prefix (the attention
    sink): the tokenizer's BOS token, else the first token of its chat template (Qwen2.5:
    ``<|im_start|>``), else none. It is the model's, not the request's, so that chat and
    plain-completion requests, ``kvblend ingest`` and ``/v1/documents`` key a chunk alike."""
    if tokenizer.bos_token_id is not None:
        return (int(tokenizer.bos_token_id),)
    if not getattr(tokenizer, "chat_template", None):
        return ()
    try:
        return render_layout(tokenizer, (), question="?").prefix[:1]
    except InvalidRequestError:  # a template that refuses a lone user turn: no sink
        return ()


class Engine:
    """Serves requests over one model, a chunk store and a prefix cache. Thread-safe:
    per-request state lives in request-scoped objects, shared state in the caches.

    ``self_check``: run (or read) the model's self-check at construction; a model that
    fails it is refused for reuse/blend/prefix-on-documents (``kvblend.engine.selfcheck``).
    ``calibrate``: test once per model whether the blend's shift helps it
    (``kvblend.engine.calibration``); on a model where it does not, a blend that asks for
    it runs without it, recomputing ``NO_SHIFT_EXTRA`` more (``blend_config``), and its stats say so. A packaged
    model's verdict ships with kvblend; ``"background"`` tests a model with none shipped or
    stored on a thread, blending without the shift until its verdict is in (the server).

    Missed chunks are written back by one :class:`WriteBack` (bounded by the store's
    ``writeback_queue``, from ``StoreConfig``): a chunk's KV is computed only once the
    store admits it, once per key in flight; ``writeback_stats()`` counts the outcomes."""

    def __init__(
        self, loaded: LoadedModel, store: ChunkStore | None = None,
        prefix_cache: PrefixCache | None = None, self_check: bool = True, *, pipeline: bool = True,
        load_timeout_s: float | None = 30.0, profile: Profile | None = None, calibrate: bool | str = True,
    ) -> None:
        """``pipeline``: read disk/Redis chunks layer by layer while fusion runs (else each
        chunk is read whole before fusion starts); a layer not loaded ``load_timeout_s``
        after fusion asks for it makes its document fall back to recompute. ``profile``:
        this model's measured costs (default: the stored one, measured when first needed)."""
        if loaded.model.device.type == "cpu":
            keep_freed_memory()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.store = store if store is not None else build_store(StoreConfig())
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.kv_dtype = getattr(self.store, "kv_dtype", "fp32")  # part of every chunk key
        self.sink_prefix = sink_prefix(self.tokenizer)  # the ``bos`` chunk prefix, one per model
        self.writeback = WriteBack(self.store, getattr(self.store, "writeback_queue", DEFAULT_WRITEBACK_QUEUE))
        self._gate = RequestGate()
        self.self_check: SelfCheckResult | None = ensure_checked(loaded) if self_check else None
        checked = self.self_check is None or self.self_check.passed
        self.shift_verdict: ShiftVerdict | None = None
        self.shift_pending = False  # the shift test runs in the background: blend without the shift meanwhile
        self._calibration: threading.Thread | None = None
        self._stop_calibration = threading.Event()
        if calibrate and checked:
            self._calibrate(calibrate == "background")
        self.pipeline = pipeline and hasattr(self.store, "locate")
        self.load_timeout_s = load_timeout_s
        self._profile = profile if profile is not None else load_profile(self._profile_path())
        self._profile_lock = threading.Lock()
        self.placement_r_min = BlendConfig().r_min  # the quality floor placement plans for
        self.escalation = RiskWindows()  # each tenant's recent risks per kind: which blends recompute again
        # Who runs background model work (write-back's chunk KV): None, here on the calling
        # thread; a scheduler sets it so that its worker stays the model's one owner. It takes
        # a step generator and a name and returns the work's value, blocking the caller, or
        # raises ComputeRefused when it cannot take the work.
        self.model_owner: Callable[[Steps, str], Any] | None = None
        self.slice_tokens: SliceSize = None  # background work's forward slices (None: whole; a callable: asked per slice)

    def _calibrate(self, background: bool) -> None:
        """The shift test's verdict (``kvblend.engine.calibration``): shipped, stored or
        measured now; with ``background``, one that must be measured is measured on a thread
        while the engine serves, its blends without the shift until then."""
        private = partial(Engine, self.loaded, self_check=False, calibrate=False)
        known = known_verdict(self.loaded)
        if is_known(known):
            self.shift_verdict = known  # type: ignore[assignment]
        elif not background:
            self.shift_verdict = ensure_calibrated(self.loaded, private)
        else:
            self.shift_pending = True
            self._calibration = calibrate_later(self.loaded, private, self._calibrated, self._stop_calibration)

    def _calibrated(self, verdict: ShiftVerdict | None) -> None:
        self.shift_verdict, self.shift_pending = verdict, False

    # ----- profile, controller, placement -------------------------------------------
    def _profile_path(self) -> Path:
        return profile_path(self.loaded.fingerprint, self.model.device, self.model.dtype)

    def profile(self) -> Profile:
        """This model's costs on this device: as given or stored, else measured now (a few
        seconds, progress bar on stderr) and saved; store tiers it lacks are measured and added."""
        with self._profile_lock:
            tiers = list(getattr(self.store, "tiers", ()))
            if self._profile is None:
                self._profile = measure_profile(self.model, self.loaded.fingerprint, tiers)
            elif missing := [t for t in tiers if t.name not in self._profile.tiers]:
                self._profile = self._profile.with_tiers({t.name: measure_tier(t, self.model.cfg) for t in missing})
            else:
                return self._profile
            save_profile(self._profile, self._profile_path())
            return self._profile

    def _choose_ratio(self, request: Request, layout: PromptLayout, chunks: _Chunks, prefix_hit: int) -> RatioChoice:
        cfg = request.blend
        docs = [DocLoad(s.index, s.source, s.tokens) for s in chunks.stats
                if s.source not in ("computed", "empty", "prefix")]
        forced = len(layout) - prefix_hit - sum(d.tokens for d in docs)
        return choose_ratio(self.profile(), self.model.cfg, docs, forced, len(layout), self.kv_dtype,
                            cfg.r_min, cfg.r_max)

    def _placement(self, n_tokens: int) -> tuple[str, ...] | None:
        """The tier placement picks for a new ``n_tokens``-token chunk; None (every tier)
        without a cost table. Write-backs pass it to ``store.put`` (``WriteBack.submit``)."""
        costs = getattr(self.store, "costs", None)
        if not costs:
            return None
        names = [t.name for t in self.store.tiers]
        tier = choose_tier(self.profile(), self.model.cfg, n_tokens, self.kv_dtype, self.placement_r_min,
                           costs, names)
        return None if tier is None else (tier,)

    def _put(self, key: ChunkKey, chunk: ChunkKV) -> bool:
        """Store a chunk now, in the tier placement picks (every tier without a cost table)."""
        tiers = self._placement(chunk.n_tokens)
        return self.store.put(key, chunk) if tiers is None else self.store.put(key, chunk, tiers=tiers)

    # ----- keys and chunks ---------------------------------------------------------
    def key_context(self, chunk_prefix: tuple[int, ...], tenant: str) -> KeyContext:
        """Everything besides the tokens a chunk's KV depends on: weights, tokenizer and
        config identities (computed at load), RoPE, the model's compute dtype, the KV
        storage dtype, the chunk prefix and the tenant."""
        return KeyContext(self.loaded.fingerprint, self.loaded.tokenizer_fingerprint,
                          self.loaded.config.rope.to_json(), self.kv_dtype, chunk_prefix, tenant,
                          compute_dtype=compute_dtype_name(self.model.dtype), model_config=self.loaded.config_digest)

    def prefix_scope(self, tenant: str) -> PrefixScope:
        """Whose prefix-cache entries a request may see: its tenant's, for this model and dtype."""
        return PrefixScope(tenant, f"{self.loaded.fingerprint}:{self.loaded.config_digest}", str(self.model.dtype))

    def blended_scope(self, tenant: str, cfg: BlendConfig) -> PrefixScope:
        """Where a tenant's whole blended prompts live (``BlendedEntry``): its prefix scope,
        qualified by the blend as run, so a blend never reads another config's KV."""
        own = self.prefix_scope(tenant)
        digest = hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]
        return own._replace(dtype=f"{own.dtype}{BLENDED}{digest}")

    def forget_blends(self, chunk_keys: Iterable[str]) -> int:
        """After the stored chunks ``chunk_keys`` ("tenant/digest") were deleted: drop their
        tenants' blends kept whole (``BlendedEntry``), which may hold KV made from them, so
        that a deleted document's KV is served by no cache. Exact prefixes stay (their KV
        is the prompt's own, computed from its text). How many tokens left the cache."""
        tenants = {key.split("/", 1)[0] for key in chunk_keys}
        return self.prefix_cache.drop_scopes(lambda scope: scope.tenant in tenants and BLENDED in scope.dtype)

    def cached_prefix(self, request: Request) -> int:
        """How many leading tokens of ``request``'s prompt the prefix cache would serve it:
        the longer of its exact prefix and, for a blend, an earlier blend's whole prompt
        (``BlendedEntry``). No model work; ``request``'s layout is rendered if it carries none."""
        layout = self.layout(request)
        ids, n = torch.tensor(layout.ids, dtype=torch.long), len(layout)
        if n < 2 or not self._prefix_cache_exact(n):
            return 0
        hit = self.prefix_cache.lookup(self.prefix_scope(request.tenant), ids, max_len=n - 1)
        best = hit.length if hit else 0
        if request.method in ("blend", "auto"):
            scope = self.blended_scope(request.tenant, self.blend_config(request.blend))
            whole = self.prefix_cache.lookup(scope, ids, max_len=n - 1, whole_entries=True)
            best = max(best, whole.length if whole else 0)
        return best

    def chunk_prefix(self, request: Request, layout: PromptLayout) -> tuple[int, ...]:
        """What a document's chunk KV is computed after: the request's whole prefix
        (``prompt``) or the model's one sink token (``bos``, see ``sink_prefix``)."""
        return layout.prefix if request.blend.chunk_prefix == "prompt" else self.sink_prefix

    def warm(self, documents: list[str | tuple[int, ...]], chunk_prefix: tuple[int, ...], tenant: str = "default") -> list[ChunkKey]:
        """Precompute and store the chunk KV of documents, now, on this thread (skipping those
        already stored, and computing none the store's admission would refuse)."""
        with self._gate.admit():
            plan = self.plan_warm(documents, chunk_prefix, tenant)
            self.put_chunks(run_steps(self.compute_steps(plan.todo, chunk_prefix), self.model))
        return plan.keys

    def plan_warm(self, documents: list[str | tuple[int, ...]], chunk_prefix: tuple[int, ...],
                  tenant: str = "default") -> WarmPlan:
        """Each document's chunk key, and the (key, token ids) still to compute: those not
        stored yet that the store's admission accepts (no model work here)."""
        ctx, keys, todo = self.key_context(chunk_prefix, tenant), [], {}
        for doc in documents:
            ids = tokenize_document(self.tokenizer, doc)
            key = chunk_key(ids, ctx)
            if ids and key not in todo and not self.store.contains(key) and self.store.sighting(key):
                todo[key] = ids
            keys.append(key)
        return WarmPlan(keys, list(todo.items()))

    def compute_steps(self, todo: list[tuple[ChunkKey, tuple[int, ...]]],
                      chunk_prefix: tuple[int, ...]) -> Generator[Any, Any, list[tuple[ChunkKey, ChunkKV]]]:
        """The chunk KV of each (key, ids) as one step generator (forward slices of
        ``slice_tokens``), for the model's owner to run."""
        out = []
        for key, ids in todo:
            out.append((key, (yield from compute_chunk_steps(self.model, chunk_prefix, ids, self.slice_tokens))))
        return out

    def put_chunks(self, chunks: list[tuple[ChunkKey, ChunkKV]]) -> None:
        """Store computed chunks now, each in the tier placement picks (store I/O, no model work)."""
        for key, chunk in chunks:
            self._put(key, chunk)

    def _lookup(self, request: Request, layout: PromptLayout, timer: _Timer, covered: int = 0) -> _Chunks:
        """Each document's chunk KV. A hit reports the tier that served it; a miss is
        recomputed in the prompt ("computed") or, without ``recompute_misses``, computed
        alone now and blended ("chunk"); neither, nor an empty document, is a hit. A
        repeat within the request reports "request" and its first occurrence's hit. A
        document within the first ``covered`` positions (the exact prefix hit) is not
        looked up: "prefix", its tokens counted in the prefix hit."""
        ctx = self.key_context(self.chunk_prefix(request, layout), request.tenant)
        out, seen = _Chunks(), {}
        sources = request.sources  # one per document: the layout's documents are the request's
        t = time.perf_counter()
        for i, (ids, start) in enumerate(zip(layout.docs, layout.doc_starts)):
            if not ids:
                out.stats.append(DocStat(i, 0, False, "empty"))
                continue
            if start + len(ids) <= covered:
                out.stats.append(DocStat(i, len(ids), False, "prefix"))
                continue
            span = sources[i] if sources is not None else None
            stored = span.chunk_ids if span is not None else ids  # a run's KV is its chunk's, sliced
            key = chunk_key(stored, ctx)
            if key in seen:
                chunk, hit = seen[key]
                source = "request"
            else:
                chunk, source = self._get(key, stored, ctx, out)
                hit = chunk is not None
                seen[key] = (chunk, hit)
            run = (span.offset, len(ids)) if span is not None else None
            if chunk is None and not request.blend.recompute_misses:  # computed alone before fusion
                out.alone.append((start, key, stored, run))
                out.stats.append(DocStat(i, len(ids), False, "request" if source == "request" else "chunk"))
                continue
            if isinstance(chunk, PendingChunk):
                out.pending[i] = (key, chunk)
            if chunk is None:
                out.misses[key] = stored
                out.stats.append(DocStat(i, len(ids), False, "computed"))
                continue
            out.placed.append(PlacedChunk(start, chunk if run is None else SlicedKV(chunk, *run)))
            out.stats.append(DocStat(i, len(ids), hit, source))
        timer.add("lookup", t)
        return out

    def _compute_alone(self, chunks: _Chunks, chunk_prefix: tuple[int, ...], slice_tokens: SliceSize,
                       timer: _Timer) -> Generator[Any, Any, None]:
        """Without ``recompute_misses``: compute each missed document alone (forward slices
        for the model's owner, as a full prefill's), store it at once, and place it to be
        blended; a document repeated in the request is computed once."""
        t, done = time.perf_counter(), {}
        for start, key, ids, run in chunks.alone:
            if key not in done:
                done[key] = yield from compute_chunk_steps(self.model, chunk_prefix, ids, slice_tokens)
                self.writeback.submit(key, done[key], self._placement(len(ids)))
            chunks.placed.append(PlacedChunk(start, done[key] if run is None else SlicedKV(done[key], *run)))
        chunks.placed.sort(key=lambda p: p.start)
        timer.add("prefill", t)

    def _get(self, key: ChunkKey, ids: tuple[int, ...], ctx: KeyContext,
             out: _Chunks) -> tuple[ChunkKV | PendingChunk | None, str]:
        """The stored chunk and the tier that served it ("memory", "disk", "redis"; "store"
        for a store without tiers); (None, "computed") on a miss.

        Borrowed: ``fuse`` only reads chunk tensors, so the memory tier lends its own.
        Pipelined: a slower tier's chunk is a PendingChunk of the request's LayerFeed."""
        if self.pipeline:
            found = self.store.locate(key, ids, len(ctx.chunk_prefix), len(self.model.layers))
            if found.layered is None:
                return found.chunk, found.tier or "computed"
            if out.feed is None:
                out.feed = LayerFeed(len(self.model.layers), self.model.device, self.model.dtype,
                                     self.load_timeout_s)
            return out.feed.add(found.layered), found.tier or "store"
        lookup = getattr(self.store, "lookup", None)
        if lookup is None:
            chunk = self.store.get(key, ids)
            return chunk, "store" if chunk is not None else "computed"
        found = lookup(key, ids, borrow=True)
        return found.chunk, found.tier or "computed"

    def _write_back(self, misses: dict[ChunkKey, tuple[int, ...]], chunk_prefix: tuple[int, ...]) -> None:
        """Hand missed chunks to the write-back: each is computed alone on its thread, only
        if the store admits it and it is not already pending (see ``WriteBack.submit``), and
        stored in the tier placement picks."""
        for key, ids in misses.items():
            self.writeback.submit(key, partial(self._compute_chunk, ids, chunk_prefix), self._placement(len(ids)))

    def _compute_chunk(self, ids: tuple[int, ...], chunk_prefix: tuple[int, ...]) -> ChunkKV:
        """One missed chunk's KV, on the write-back thread: by the model's owner when one is
        set (this thread waits), else here."""
        steps = compute_chunk_steps(self.model, chunk_prefix, ids, self.slice_tokens)
        owner = self.model_owner
        return run_steps(steps, self.model) if owner is None else owner(steps, "write-back")

    def writeback_stats(self) -> WriteBackStats:
        """Write-back counters (queued, written, refused, not_admitted, deduplicated,
        dropped, failed, pending), e.g. for a server's metrics."""
        return self.writeback.stats()

    def flush(self) -> None:
        """Wait until background chunk computations and writes are done."""
        self.writeback.flush()

    def close(self) -> None:
        """Refuse new requests (``EngineClosedError``), let those being prepared finish, then
        write back what is pending and close the store. Safe to call twice or concurrently."""
        if not self._gate.close():
            return
        self._stop_calibration.set()
        if self._calibration is not None:  # ends before its next question
            self._calibration.join()
        self.writeback.close()
        self.store.close()

    # ----- prefill by method ------------------------------------------------------
    def _check_length(self, n: int) -> None:
        limit = self.loaded.config.context_length
        if n + 1 > limit:
            raise ContextLengthError(
                f"the prompt has {n} tokens; the model's context is {limit} tokens (leave room for the answer)")

    def _load_prefix(self, cache: KVCache, hit: PrefixHit, timer: _Timer) -> None:
        t = time.perf_counter()
        for layer, (k, v) in enumerate(zip(hit.keys, hit.values)):
            cache.write(layer, 0, k.to(self.model.device), v.to(self.model.device))
        cache.length = hit.length
        timer.add("load", t)

    def _prefix_cache_exact(self, n: int) -> bool:
        """Whether the prefix cache is lossless for a prompt of ``n`` tokens. Dynamic NTK
        RoPE past ``max_position_embeddings`` rotates with frequencies that depend on the
        prompt's length, so KV cached from another prompt is not this prompt's (the
        entries are all made at base frequencies: prompts past it neither read nor add)."""
        return not rope_lib.length_dependent(self.loaded.config.rope, n)

    def _instead_of_blend(self, request: Request, layout: PromptLayout, ids: torch.Tensor, extra: int,
                          timer: _Timer, slice_tokens: SliceSize, chunks: _Chunks) -> Generator[Any, Any, _Built]:
        """An exact (prefix-cached) prefill in place of a blend reusing little (``_little_reuse``):
        its missed documents still go to the write-back, so the next request carrying them
        blends them; the stored ones it computes anyway are reported "skipped"."""
        if chunks.feed is not None:  # never started: nothing was loaded
            chunks.feed.close()
        self._write_back(chunks.misses, self.chunk_prefix(request, layout))
        built = yield from self._prefill_exact(replace(request, method="prefix"), layout, ids, extra, timer,
                                               slice_tokens)
        docs = [DocStat(d.index, d.tokens, False, "skipped") if looked.hit and d.source == "computed" else d
                for d, looked in zip(built.docs, chunks.stats)]
        return built._replace(fallback=built.fallback or "little-reuse", docs=docs)

    def _prefill_exact(self, request: Request, layout: PromptLayout, ids: torch.Tensor, extra: int,
                       timer: _Timer, slice_tokens: SliceSize) -> Generator[Any, Any, _Built]:
        """``full`` (no cache at all) or ``prefix`` (longest exact prefix, then the rest, in
        forward slices of ``slice_tokens``)."""
        use_prefix, scope = request.method == "prefix", self.prefix_scope(request.tenant)
        fallback = "dynamic-rope" if use_prefix and not self._prefix_cache_exact(ids.shape[0]) else None
        use_prefix = use_prefix and fallback is None
        hit = self.prefix_cache.lookup(scope, ids, max_len=ids.shape[0] - 1) if use_prefix else None
        cache = self.model.new_cache(ids.shape[0] + extra)
        if hit is not None:
            self._load_prefix(cache, hit, timer)
        t = time.perf_counter()
        logits = (yield from forward_chunks(self.model, ids[cache.length :], cache, slice_tokens))[0]  # (V,)
        timer.add("prefill", t)
        if use_prefix:
            self.prefix_cache.insert(scope, ids, cache, ids.shape[0])
        done = hit.length if hit else 0
        docs = [DocStat(i, len(d), False, "prefix" if d and a + len(d) <= done else "computed")
                for i, (a, d) in enumerate(zip(layout.doc_starts, layout.docs))]
        return _Built(cache, logits, done, docs, [len(layout) - done] * len(self.model.layers), 0, fallback,
                      exact=ids.shape[0] if use_prefix else 0)

    def _prefill_fused(self, request: Request, layout: PromptLayout, ids: torch.Tensor, extra: int,
                       timer: _Timer, slice_tokens: SliceSize = None) -> Generator[Any, Any, _Built]:
        """``reuse`` or ``blend``: exact prefix, then cached chunks fused by selective recompute
        (a step per layer of each fusion pass)."""
        scope, cfg, choice = self.prefix_scope(request.tenant), self.blend_config(request.blend), None
        fallback = None if self._prefix_cache_exact(ids.shape[0]) else "dynamic-rope"
        # a blend asked to explain itself runs its selection (and is not kept whole)
        blended = None if fallback or request.method != "blend" or request.explain else BlendedEntry(
            self.blended_scope(request.tenant, cfg), None, False)
        hit = None if fallback else _whole_documents(
            self.prefix_cache.lookup(scope, ids, max_len=ids.shape[0] - 1), layout)
        earlier = None if blended is None else self.prefix_cache.lookup(
            blended.scope, ids, max_len=ids.shape[0] - 1, whole_entries=True)
        if earlier is not None and _whole_documents(earlier, layout) is not earlier:
            earlier = None  # it ends inside a document here: valid only whole, so not usable
        if earlier is not None and earlier.length > (hit.length if hit else 0):
            hit = earlier  # an earlier blend of this prompt (or of its start): not exact, the same blend
            blended = blended._replace(risk=earlier.entry.risk, escalated=earlier.entry.escalated)
        else:
            earlier = None
        covered = hit.length if hit else 0  # documents inside it are done already: no lookup, no blend
        chunks = self._lookup(request, layout, timer, covered)
        if (request.method == "blend" and not request.explain and earlier is None
                and _little_reuse(chunks, covered, len(layout), cfg)):
            return (yield from self._instead_of_blend(request, layout, ids, extra, timer, slice_tokens, chunks))
        yield from self._compute_alone(chunks, self.chunk_prefix(request, layout), slice_tokens, timer)
        if cfg.auto and request.method == "reuse":
            cfg = cfg.with_ratio(0.0)
        elif cfg.auto:
            choice = self._choose_ratio(request, layout, chunks, hit.length if hit else 0)
            cfg = cfg.with_ratio(choice.ratio)
            if choice.ratio >= 1.0:
                _skip_loading(chunks)
        # a question-selected blend's risk ranks it among its tenant's of the same kind
        kind = risk_kind(cfg.strategy) if request.method == "blend" and cfg.selection == "question" else None
        plan = FusionPlan(ids, chunks.placed, (hit.keys, hit.values) if hit else None, cfg.check_layers,
                          cfg.ratios, cfg.signal, select_from_start=request.method == "reuse", extra_capacity=extra,
                          strategy=None if request.method == "reuse" or cfg.plain else cfg,
                          doc_spans=tuple((a, a + len(d)) for a, d in zip(layout.doc_starts, layout.docs)
                                          if d and a >= covered),
                          escalate_at=self.escalation.threshold(request.tenant, cfg.escalate, kind) if kind else None,
                          lossless=self.kv_dtype == compute_dtype_name(self.model.dtype))
        t = time.perf_counter()
        try:
            if chunks.feed is not None:
                chunks.feed.start()
            out, dropped = yield from fuse_or_drop_steps(self.model, plan, fuse_planned_steps)
        finally:
            if chunks.feed is not None:
                chunks.feed.close()
        timer.add("prefill", t)
        if kind and out.risk is not None:  # the risk that decided, before any second recompute
            self.escalation.add(request.tenant, out.escalated if out.escalated is not None else out.risk, kind)
        loading = _fall_back(chunks, {id(unsliced(p.chunk)) for p in dropped}, self.pipeline)
        fused = [p for p in chunks.placed if all(p is not d for d in dropped)]  # what fusion kept
        # every position before the first reused document was computed exactly, reading
        # nothing reused: the whole prompt when no document was reused (after an earlier
        # blend's prompt, nothing is exact)
        exact = 0 if fallback or earlier else min((p.start for p in fused), default=ids.shape[0])
        if exact > covered:
            self.prefix_cache.insert(scope, ids, out.cache, exact)
        self._write_back(chunks.misses, self.chunk_prefix(request, layout))
        risk, escalated = out.risk, out.escalated is not None
        if earlier is not None and risk is None:  # nothing blended after it: the earlier blend's
            risk, escalated = blended.risk, blended.escalated
        if blended is not None and exact < ids.shape[0]:
            blended = blended._replace(risk=risk, escalated=escalated)
        else:
            blended = None
        return _Built(out.cache, out.logits, covered, chunks.stats, out.recomputed, out.candidates,
                      fallback, _doc_checks(out, layout, fused, request.explain), loading, choice, risk,
                      cfg.strategy, escalated, exact, blended)

    def blend_config(self, cfg: BlendConfig) -> BlendConfig:
        """``cfg`` as this model runs it. Where the model's test found that the shift does
        not help (``calibrate``), a blend asking for it runs without it and recomputes
        ``NO_SHIFT_EXTRA`` more of the prompt instead (``BlendConfig.without_shift``): the
        shift is what corrects the tokens not recomputed, and on such a model more of them are
        recomputed instead (docs/results.md 2.1: Qwen2.5 at 35 % without it)."""
        if cfg.shift and (self.shift_pending or self.shift_verdict is not None and not self.shift_verdict.helps):
            return cfg.without_shift()
        return cfg

    def layout(self, request: Request) -> PromptLayout:
        """The request's token ids and spans (no model work): its pre-rendered ``layout``
        when it carries one (``engine.shaping.shape``), else rendered now."""
        if request.layout is not None:
            return request.layout
        return render_layout(self.tokenizer, request.documents, request.question, request.messages,
                             request.system, request.use_chat_template, request.placement, request.template_kwargs)

    def prepare(self, request: Request, extra_capacity: int = 0) -> Prepared:
        """Build the prompt's KV cache by the request's method; nothing is decoded yet.
        ``auto`` reaching the engine (no guard decided) is blend.

        The cache holds the prompt plus ``extra_capacity`` positions, never more than the
        model's context: a client's ``max_tokens`` does not size an allocation. Raises
        ``EngineClosedError`` once ``close`` has begun; decoding needs no shared state after it."""
        return run_steps(self.prepare_steps(request, extra_capacity), self.model)

    def prepare_steps(self, request: Request, extra_capacity: int = 0,
                      slice_tokens: SliceSize = None) -> Generator[Any, Any, Prepared]:
        """``prepare`` as a step generator (``generation.chunked``) for the model's owner to
        interleave with other work: a full prefill as ``Forward`` slices of at most
        ``slice_tokens`` tokens (None: one; a callable: asked per slice, and answering
        ``InPlace`` to have a chunk run here a step per layer), a fusion as one step per
        layer of each pass.
        The result equals ``prepare``'s (slices: up to float rounding)."""
        with self._gate.admit():
            return (yield from self._prepare(request, extra_capacity, slice_tokens))

    def _prepare(self, request: Request, extra_capacity: int,
                 slice_tokens: SliceSize) -> Generator[Any, Any, Prepared]:
        timer = _Timer()
        request = replace(request, method="blend") if request.method == "auto" else request
        if self.self_check is not None:
            self.self_check.require(request.method, any(request.documents))
        layout = self.layout(request)
        self._check_length(len(layout))
        extra_capacity = max(0, min(extra_capacity, self.loaded.config.context_length - len(layout)))
        ids = torch.tensor(layout.ids, dtype=torch.long, device=self.model.device)
        if request.method in ("full", "prefix"):
            built = yield from self._prefill_exact(request, layout, ids, extra_capacity, timer, slice_tokens)
        else:
            built = yield from self._prefill_fused(request, layout, ids, extra_capacity, timer, slice_tokens)
        elapsed = time.perf_counter() - timer.start
        stats = RequestStats(request.method, len(layout), built.prefix_hit, built.docs, built.recomputed,
                             built.candidates, timer.parts["lookup"], timer.parts["load"], timer.parts["prefill"],
                             elapsed, built.fallback, built.checks, built.loading, built.controller,
                             built.strategy if request.method == "blend" else None, built.risk, built.escalated)
        return Prepared(layout, built.cache, built.logits, stats, built.exact, built.blended)

    def remember_answer(self, request: Request, prepared: Prepared, tokens: Sequence[int]) -> int:
        """After ``prepared`` decoded ``tokens``: enter the prompt and the generated tokens
        whose KV ``prepared.cache`` holds (all but the last) in the prefix cache, so that a
        repeat, or a chat's next turn, which repeats them, reuses them: as exact prefixes
        when the whole prompt was exact, else, for a blend, whole (``BlendedEntry``).
        Returns the tokens entered (0 when nothing was). Caching is an optimisation: a
        failure is logged, never raised into the request that finished."""
        n, kept = len(prepared.layout), min(len(tokens), prepared.cache.length - len(prepared.layout))
        exact, blended = prepared.exact_tokens >= n, prepared.blended
        if kept <= 0 or not (exact or blended) or not self._prefix_cache_exact(n + kept):
            return 0
        ids = torch.tensor((*prepared.layout.ids, *tokens[:kept]), dtype=torch.long)
        try:
            if exact:
                self.prefix_cache.insert(self.prefix_scope(request.tenant), ids, prepared.cache, n + kept)
            else:  # whole: the prompt up to its last token (a repeat computes that one), and with the answer
                self.prefix_cache.insert(blended.scope, ids, prepared.cache, n + kept, entry=blended)
                self.prefix_cache.insert(blended.scope, ids, prepared.cache, n - 1, entry=blended)
        except Exception:  # noqa: BLE001 - never fail a finished request over its cache entry
            log.warning("a finished request's prompt and answer did not enter the prefix cache", exc_info=True)
            return 0
        return n + kept

    # ----- generation -------------------------------------------------------------
    def stream(self, request: Request, sampling: SamplingParams) -> Iterator[StreamEvent | RequestStats]:
        """Yield the request's stats (TTFT filled in: the first token is drawn) right before
        the first token's event, then the token events; so whoever sends the first token
        already has the usage and stats (as the scheduler's handles do)."""
        start = time.perf_counter()
        prepared = self.prepare(request, sampling.max_tokens)
        events = stream_from(self.model, self.tokenizer, prepared.cache, prepared.logits, sampling,
                             self.loaded.eos_token_ids)
        first = next(events)
        yield prepared.stats._replace(ttft_s=time.perf_counter() - start)
        tokens = [first.token_id]
        yield first
        for event in events:
            tokens.append(event.token_id)
            yield event
        self.remember_answer(request, prepared, tokens)

    def generate(self, request: Request, sampling: SamplingParams | None = None) -> Result:
        """Run a request to completion."""
        sampling = sampling or SamplingParams()
        return result_of(self.stream(request, sampling))