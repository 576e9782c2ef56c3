"""A request with explicit documents, and what the engine reports back."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvblend.blend.config import METHODS, BlendConfig
from kvblend.blend.layout import DocPlace, PromptLayout, check_placement, conversation
from kvblend.errors import InvalidRequestError
from kvblend.generation.stream import StreamEvent, collect, validate_messages, validate_template_kwargs
from kvblend.pipeline.controller import RatioChoice
from kvblend.pipeline.loader import LoadStats

REQUEST_METHODS = (*METHODS, "auto")  # "auto": a quality guard decides (kvblend.guard.quality)
# Selections that choose the recomputed tokens once, before layer 0, and recompute them at
# every layer; question selection runs a reuse pass first (``kvblend.blend.strategies``).
SELECT_ONCE = ("question", "oracle")


class SpanSource(NamedTuple):
    """A document that is a run of a stored chunk: ``chunk_ids[offset : offset + n]``,
    reused from that chunk's stored KV (``engine.matching`` finds such runs in a prompt)."""

    chunk_ids: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Request:
    """``system`` (optional) + ``documents`` + a ``question`` or chat ``messages``.

    Documents are texts or token-id lists; each is tokenized alone and placed, in
    order, at the start of the last user turn, or, with ``placement``, each where its
    ``DocPlace`` says (it replaces those characters of a message: a passage found in the
    message's text; ``blend.layout``). ``method`` is one of full, prefix, reuse, blend,
    or auto (a ``QualityGuard`` picks; without one it is blend); ``blend`` holds the
    selective-recompute knobs. ``explain``: the stats' check layers also list, per
    document, the tokens chosen for recompute with their scores (``CheckStat.tokens``);
    off by default, since only a caller that shows them needs them. ``layout``: this
    request's prompt already rendered (``engine.shaping.shape`` renders it once), so the
    engine does not render it again; its documents must be the request's (checked for
    documents given as ids). ``template_kwargs``: extra chat-template variables (vLLM's
    ``chat_template_kwargs``; ``generation.stream.validate_template_kwargs``).
    ``sources``: per document, None or the ``SpanSource`` it is a run of (the document
    must be given as those ids); its KV is that chunk's, sliced.
    """

    documents: Sequence[str | Sequence[int]] = ()
    question: str | None = None
    messages: Sequence[dict[str, str]] | None = None
    system: str | None = None
    method: str = "blend"
    blend: BlendConfig = field(default_factory=BlendConfig)
    tenant: str = "default"
    use_chat_template: bool = True
    explain: bool = False
    placement: Sequence[DocPlace] | None = None
    layout: PromptLayout | None = field(default=None, compare=False, repr=False)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    sources: Sequence[SpanSource | None] | None = None

    def __post_init__(self) -> None:
        if self.method not in REQUEST_METHODS:
            raise InvalidRequestError(f"method must be one of {', '.join(REQUEST_METHODS)}; got {self.method!r}")
        object.__setattr__(self, "documents", _documents(self.documents))
        if (self.question is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of question or messages")
        if self.messages is not None:
            object.__setattr__(self, "messages", validate_messages(self.messages))
        object.__setattr__(self, "template_kwargs", validate_template_kwargs(self.template_kwargs, tools=True))
        for name in ("question", "system"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be text")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise InvalidRequestError("tenant must be a non-empty string")
        if self.placement is not None:
            places = tuple(DocPlace(*p) for p in self.placement)
            object.__setattr__(self, "placement", places)
            check_placement(conversation(self.system, self.messages, self.question), places, len(self.documents))
        if self.sources is not None:
            object.__setattr__(self, "sources", _sources(self.sources, self.documents))
        if self.layout is not None:
            _check_layout(self.layout, self.documents)


def _sources(sources: Sequence[SpanSource | None], documents: Sequence[str | tuple[int, ...]],
             ) -> tuple[SpanSource | None, ...]:
    """InvalidRequestError unless there is one source (or None) per document, each naming
    a run of its chunk that is exactly the document's ids."""
    if len(sources) != len(documents):
        raise InvalidRequestError(f"sources needs one entry per document: {len(documents)} documents, "
                                  f"{len(sources)} sources")
    out: list[SpanSource | None] = []
    for i, (src, doc) in enumerate(zip(sources, documents)):
        if src is None:
            out.append(None)
            continue
        src = SpanSource(tuple(src[0]), int(src[1]))
        if isinstance(doc, str) or not doc or src.offset < 0 \
                or src.chunk_ids[src.offset : src.offset + len(doc)] != doc:
            raise InvalidRequestError(f"document {i} is not the run of its source chunk that it names")
        out.append(src)
    return tuple(out)


def _check_layout(layout: PromptLayout, documents: Sequence[str | tuple[int, ...]]) -> None:
    """InvalidRequestError when a pre-rendered layout cannot be this request's: another
    number of documents, or a document given as ids that is not the layout's."""
    if len(layout.docs) != len(documents) or any(
            not isinstance(d, str) and d != ids for d, ids in zip(documents, layout.docs)):
        raise InvalidRequestError("the pre-rendered layout does not match the request's documents")


def _documents(documents: object) -> tuple[str | tuple[int, ...], ...]:
    """Documents as texts or tuples of ints, or InvalidRequestError."""
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise InvalidRequestError("documents must be a list of texts or token-id lists, not one string")
    out = []
    for d in documents:
        if isinstance(d, str):
            out.append(d)
            continue
        try:
            out.append(tuple(operator.index(t) for t in d))
        except TypeError:
            raise InvalidRequestError("each document must be a text or a list of token ids") from None
    return tuple(out)


class DocStat(NamedTuple):
    """One document: its length and whether its KV came from the store (``hit``)."""

    index: int
    tokens: int
    hit: bool  # True only when the store served it (or, for a repeat, its first occurrence)
    source: str  # the tier that served it ("memory", "disk", "redis"; "store" for a store
    # without tiers), "computed" (a miss, computed in the prompt: in full, or under question
    # selection once over the reused context and then blended like a chunk), "chunk" (a miss whose chunk KV
    # was computed alone in this request and blended), "fallback" (found, but a layer failed
    # to load: recomputed in full), "skipped" (stored on a tier slower than recomputing it:
    # computed, see the controller), "request" (a repeat within this request), "prefix" (inside
    # the exact prefix cache hit: its tokens count in ``prefix_hit_tokens``) or "empty"


class DocSelection(NamedTuple):
    """One document's tokens at one check, as offsets within the document (``Request.explain``)."""

    kept: list[int]  # chosen for recompute, ascending
    kept_scores: list[float]  # the score that ranked each
    reused: list[int]  # candidates left as cached
    reused_scores: list[float]
    measured: list[int]  # tokens whose deviation was measured at the check's layer
    deviation: list[float]
    forced: list[int]  # kept tokens chosen before any score (the shift's sample)


class CheckStat(NamedTuple):
    """One check layer of a blend: deviation (selection score) over its candidates, how
    many it kept for recompute, and how the kept tokens fall on the request's documents."""

    layer: int
    candidates: int  # cached document tokens still active at this layer
    selected: int
    mean_score: float
    max_score: float
    doc_selected: list[int]  # kept tokens per request document (indexed like ``docs``)
    tokens: tuple[DocSelection | None, ...] | None = None  # per document (None: not reused); explain only

    @property
    def doc_share(self) -> list[float]:
        """Each document's share of the kept document tokens (all 0.0 when none were kept)."""
        total = sum(self.doc_selected)
        return [n / total if total else 0.0 for n in self.doc_selected]

    def to_dict(self) -> dict[str, Any]:
        out = {**self._asdict(), "doc_share": self.doc_share}
        if self.tokens is None:
            del out["tokens"]
        else:
            out["tokens"] = [None if t is None else t._asdict() for t in self.tokens]
        return out


class RequestStats(NamedTuple):
    method: str
    prompt_tokens: int
    prefix_hit_tokens: int
    docs: list[DocStat]
    recomputed_per_layer: list[int]
    candidates: int  # document tokens whose cached KV was available for reuse
    lookup_s: float
    load_s: float
    prefill_s: float  # full prefill or fusion/recompute
    ttft_s: float  # request start -> first token sampled
    fallback: str | None = None  # why reuse the method allows was skipped, e.g. "dynamic-rope":
    # dynamic NTK RoPE past max_position_embeddings, where the exact prefix cache is bypassed;
    # "little-reuse": a blend reusing under ``BlendConfig.min_reuse`` of its prompt ran exact
    checks: tuple[CheckStat, ...] = ()  # blend's check layers, in order
    loading: LoadStats | None = None  # pipelined loading: worker waits per layer, fallbacks
    controller: RatioChoice | None = None  # ratio "auto": the ratio chosen and its inputs
    strategy: str | None = None  # blend only: the selection and corrections (BlendConfig.strategy)
    # a blend's estimate of how much of reuse's error it left (0 none, 1 reuse's): with the shift, the share
    # of reuse's KV error left (``blend.strategies.blend_risk``); a question-selected blend without it, how
    # little it moved the answer from reuse's (``moved_risk``); requests with more risk are shadow-checked first
    risk: float | None = None
    # the blend's moved risk was in the top of its tenant's recent ones, so it recomputed again at
    # twice its ratio (``engine.escalation``); ``risk`` is then the second recompute's
    escalated: bool = False
    # choices decoded from this one prefill (``n``: the others in forks of its cache)
    choices: int = 1

    @property
    def recompute_frac(self) -> float:
        """Share of the prompt's token-layers this request computed rather than reused, in [0, 1].

        A token-layer is one prompt token at one layer. Reused: the exact prefix hit at every
        layer, and at each layer the cached document tokens (``candidates``) not run through
        it. Computed: every other token-layer, counted once however many passes ran it
        (question selection runs the question's rows in two passes). So ``full`` is 1, a
        prefix hit of p tokens alone gives 1 - p / prompt_tokens, and ``reuse`` counts only
        the tokens around the cached documents. ``recomputed_per_layer`` stays the rows each
        layer ran, all passes summed (the work done)."""
        layers = len(self.recomputed_per_layer)
        if not layers or self.prompt_tokens <= 0:
            return 0.0
        computed = sum(self._computed_at(rows) for rows in self.recomputed_per_layer)
        return computed / (self.prompt_tokens * layers)

    def _computed_at(self, rows: int) -> int:
        """The distinct prompt tokens one layer computed, from the rows it ran (all passes):
        every uncached token after the prefix hit, plus the cached document tokens it ran,
        which one pass cannot exceed and a select-once selection states (its check's kept)."""
        uncached = max(0, self.prompt_tokens - self.prefix_hit_tokens - self.candidates)
        recomputed = min(self.candidates, max(0, rows - uncached))
        if self.checks and (self.strategy or "").split("+")[0] in SELECT_ONCE:
            recomputed = min(recomputed, self.checks[-1].selected)
        return uncached + recomputed

    def to_dict(self) -> dict[str, Any]:
        out = self._asdict()
        out["docs"] = [d._asdict() for d in self.docs]
        out["checks"] = [c.to_dict() for c in self.checks]
        out["loading"] = None if self.loading is None else self.loading.to_dict()
        out["controller"] = None if self.controller is None else self.controller.to_dict()
        out["recompute_frac"] = self.recompute_frac
        return out


class Result(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


def result_of(items: Iterable[StreamEvent | RequestStats], on_text: Callable[[str], Any] | None = None) -> Result:
    """The whole ``Result`` of a stream of token events with its ``RequestStats`` among
    them (as ``Engine.stream`` and the scheduler yield them); ``on_text`` sees each piece
    of text as it arrives. Of a request of several choices, choice 0's (the others' events
    are skipped)."""
    stats, events = None, []
    for item in items:
        if isinstance(item, RequestStats):
            stats = item
            continue
        if item.index != 0:
            continue
        events.append(item)
        if on_text is not None:
            on_text(item.text)
    if stats is None:
        raise RuntimeError("the stream ended without its request stats")
    done = collect(iter(events), stats.prompt_tokens)
    return Result(done.text, done.token_ids, done.finish_reason, stats)
