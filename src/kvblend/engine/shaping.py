"""One request-shaping step: from what a client sent to the engine's ``Request`` and its
rendered layout, before any model work.

    shape(engine, draft, config, index=, lookup=) -> ShapedRequest
        documents given:  {"id"} expands to its stored chunks (``lookup``), a text is cut
                          by ``cut`` (the server's: the chunks ``POST /v1/documents``
                          stores, so each hits them), every document's tokens are
                          bounded; inline texts are indexed for matching later prompts
        none given:       the tenant's stored texts are found in the messages' characters
                          (``engine.matching``), and with ``discover`` long passages too
                          (``engine.discovery``); each becomes a document where it stands
        then:             the layout is rendered once, the context checked, and the layout
                          carried on the request so the engine does not render it again

The server, ``kvblend ask`` and the eval harness all shape their requests here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from kvblend.blend.config import BlendConfig
from kvblend.blend.layout import DocPlace, PromptLayout, conversation, tokenize_document
from kvblend.engine.discovery import DISCOVERED, Sightings, discover
from kvblend.engine.matching import DocumentIndex, IndexedText
from kvblend.engine.request import Request, SpanSource
from kvblend.errors import ContextLengthError, InvalidRequestError

STORED = "stored"
DEFAULT_DISCOVER_TOKENS = 64


class DocRef(NamedTuple):
    """A stored document named by id: ``shape``'s ``lookup`` expands it."""

    id: str


# (document id) -> its chunks' token ids in order (a row stored before chunking: its
# text), or None when the tenant has no such document.
Lookup = Callable[[str], Sequence[str | Sequence[int]] | None]


class UnknownDocumentError(InvalidRequestError):
    """A ``DocRef`` the lookup does not know (a server answers 404)."""

    def __init__(self, index: int, doc_id: str) -> None:
        super().__init__(f"no stored document with id {doc_id!r}")
        self.index, self.doc_id = index, doc_id


class DocumentTooLargeError(InvalidRequestError):
    """A document with more tokens than ``ShapeConfig.max_document_tokens`` (a server answers 413)."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(f"document {index} has {tokens} tokens; the limit is {limit}")
        self.index, self.tokens, self.limit = index, tokens, limit


class Piece(Protocol):
    """One piece of a cut text (``kvblend.rag.chunking.Chunk`` is one): its characters,
    its token ids and a stable id."""

    text: str
    token_ids: tuple[int, ...]
    chunk_id: str


# A text -> its pieces in order, whose ids concatenate to the text's (none for blank text).
Cut = Callable[[str], Sequence[Piece]]


@dataclass(frozen=True)
class ShapeConfig:
    """How requests are shaped. ``max_document_tokens``: per document (None: unbounded);
    ``match``: find stored texts in a request without documents; ``discover``: also treat
    its passages of at least ``discover_tokens`` tokens as documents."""

    max_document_tokens: int | None = None
    match: bool = True
    discover: bool = False
    discover_tokens: int = DEFAULT_DISCOVER_TOKENS

    def __post_init__(self) -> None:
        if self.max_document_tokens is not None and self.max_document_tokens < 1:
            raise ValueError("max_document_tokens must be >= 1")
        if self.discover_tokens < 1:
            raise ValueError("discover_tokens must be >= 1")


@dataclass(frozen=True)
class Draft:
    """A request as a client sent it: documents may name stored ones (``DocRef``) and
    texts are not cut yet. ``match=False`` (the request's ``kvblend.match``) turns
    matching and discovery off for it."""

    documents: Sequence[str | Sequence[int] | DocRef] = ()
    question: str | None = None
    messages: Sequence[dict[str, str]] | None = None
    system: str | None = None
    method: str = "blend"
    blend: BlendConfig = field(default_factory=BlendConfig)
    tenant: str = "default"
    use_chat_template: bool = True
    match: bool = True
    explain: bool = False
    template_kwargs: Mapping[str, Any] | None = None

    def base(self) -> Request:
        """The request without documents (validates every other field)."""
        return Request(question=self.question, messages=self.messages, system=self.system, method=self.method,
                       blend=self.blend, tenant=self.tenant, use_chat_template=self.use_chat_template,
                       explain=self.explain, template_kwargs=self.template_kwargs or {})


class SpanMatch(NamedTuple):
    """A span of a message that became a document: ``[start, end)`` in characters (code
    points) of message ``message`` (counted as the layout does: system prompt first when
    given), its tokens, the chunk and document it is, and how it was found."""

    message: int
    start: int
    end: int
    tokens: int
    chunk: str
    document: str | None
    source: str  # "stored" (indexed: registered, ingested or seen in a documents field) or "discovered"
    chunk_offset: int = 0  # the span's first token in its chunk (a run of it; 0 with ``whole``)
    whole: bool = True  # the whole stored chunk, else a run of it reused from the chunk's KV

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()


class ShapedRequest(NamedTuple):
    """The engine's request (documents as token ids, placement, the layout carried),
    its layout, the spans that became documents, and how many prompt documents each
    document given became (its stored chunks, its cut pieces; empty when none was given)."""

    request: Request
    layout: PromptLayout
    matches: tuple[SpanMatch, ...] = ()
    pieces: tuple[int, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.layout)


def shape(engine: Any, draft: Draft, config: ShapeConfig = ShapeConfig(), *, index: DocumentIndex | None = None,
          lookup: Lookup | None = None, cut: Cut | None = None, sightings: Sightings | None = None) -> ShapedRequest:
    """Shape ``draft`` for ``engine`` (see the module docstring); without ``cut`` a text
    document stays one document, tokenized alone; with ``sightings``, a discovered passage
    is a document only once they admit it (without: on its first sighting). Raises
    ``UnknownDocumentError``, ``DocumentTooLargeError``, ``InvalidRequestError`` (a bad
    placement or template) or ``ContextLengthError``; no model work."""
    base = draft.base()
    matches: tuple[SpanMatch, ...] = ()
    pieces: tuple[int, ...] = ()
    if draft.documents:
        docs, seen, pieces = expand_documents(engine, draft.documents, config, lookup, cut)
        if index is not None and seen:
            index.add(draft.tenant, seen)
        request = dataclasses.replace(base, documents=docs)
    else:
        request, matches = find_documents(engine, base, config, index if draft.match else None,
                                          draft.match and config.discover, sightings)
    layout = engine.layout(request)
    check_context(engine, len(layout))
    return ShapedRequest(dataclasses.replace(request, layout=layout), layout, matches, pieces)


def check_context(engine: Any, n: int) -> None:
    """ContextLengthError when ``n`` prompt tokens leave no room for one answer token."""
    context = engine.loaded.config.context_length
    if n + 1 > context:
        raise ContextLengthError(f"This model's maximum context length is {context} tokens. However, your request "
                                 f"has {n} input tokens. Please reduce the length of the input messages or "
                                 "documents.")


# ----- documents given ----------------------------------------------------------------------
def aligned(text: str, pieces: Sequence[IndexedText]) -> list[IndexedText]:
    """Those of ``pieces`` (the decoded chunks of ``text``, in order) found where they
    belong in ``text`` (after whitespace a decoder may drop); from a chunk that is not,
    the positions are unknown and the rest is left out."""
    out, pos = [], 0
    for piece in pieces:
        at = text.find(piece.text, pos) if piece.text else -1
        if at < 0 or (at > pos and not text[pos:at].isspace()):
            break
        out.append(piece)
        pos = at + len(piece.text)
    return out


def chunk_texts(text: str, chunks: Sequence[Piece], document: str | None = None) -> list[IndexedText]:
    """The chunks of ``text`` to index, each with its characters (see ``aligned``)."""
    return aligned(text, [IndexedText(c.text, c.token_ids, c.chunk_id, document) for c in chunks])


def expand_documents(engine: Any, documents: Sequence[str | Sequence[int] | DocRef], config: ShapeConfig,
                     lookup: Lookup | None, cut: Cut | None = None,
                     ) -> tuple[list[tuple[int, ...]], list[IndexedText], tuple[int, ...]]:
    """Every document as the token ids of its chunks, in order (a stored one's, a text's
    ``cut`` pieces, else the text tokenized alone), each document's tokens bounded; the
    inline texts' pieces to index; and how many prompt documents each document became. The prompt's tokens do not depend on the cutting: the windows
    partition a text's ids and documents are concatenated without separators."""
    out, seen, counts = [], [], []
    for i, doc in enumerate(documents):
        pieces = [doc] if not isinstance(doc, DocRef) else _stored(doc, i, lookup)
        ids: list[tuple[int, ...]] = []
        for piece in pieces:
            chunks = _cut(engine, piece, cut) if isinstance(piece, str) else []
            ids += [c.token_ids for c in chunks] or [tokenize_document(engine.tokenizer, piece)]
            if isinstance(piece, str):
                seen += chunk_texts(piece, chunks, doc.id if isinstance(doc, DocRef) else None)
        n = sum(map(len, ids))
        if config.max_document_tokens is not None and n > config.max_document_tokens:
            raise DocumentTooLargeError(i, n, config.max_document_tokens)
        kept = [p for p in ids if p] or [()]
        out += kept
        counts.append(len(kept))
    return out, seen, tuple(counts)


class _Whole(NamedTuple):
    text: str
    token_ids: tuple[int, ...]
    chunk_id: str


def _cut(engine: Any, text: str, cut: Cut | None) -> Sequence[Piece]:
    """``text``'s pieces: ``cut``'s, else the whole text tokenized alone (named by a digest
    of its ids; none for blank text)."""
    if cut is not None:
        return cut(text)
    if not text.strip():
        return []
    ids = tokenize_document(engine.tokenizer, text)
    return [_Whole(text, ids, "text-" + hashlib.sha256(repr(ids).encode()).hexdigest()[:24])]


def _stored(ref: DocRef, i: int, lookup: Lookup | None) -> Sequence[str | Sequence[int]]:
    pieces = lookup(ref.id) if lookup is not None else None
    if pieces is None:
        raise UnknownDocumentError(i, ref.id)
    return pieces


# ----- documents found in the text ----------------------------------------------------------
def find_documents(engine: Any, base: Request, config: ShapeConfig, index: DocumentIndex | None,
                   discovering: bool, sightings: Sightings | None = None) -> tuple[Request, tuple[SpanMatch, ...]]:
    """``base`` with the stored texts found in its messages (and, ``discovering``, its long
    passages) placed as documents where they stand; the spans found, in prompt order."""
    conv = conversation(base.system, base.messages, base.question)
    found: list[tuple[SpanMatch, tuple[int, ...], SpanSource | None]] = []
    if config.match and index is not None:
        for m in index.match(base.tenant, [c.get("content") or "" for c in conv]):
            span = SpanMatch(m.message, m.start, m.end, len(m.token_ids), m.chunk, m.document, STORED, m.offset,
                             m.whole)
            found.append((span, m.token_ids, None if m.whole else SpanSource(m.source_ids, m.offset)))
    if discovering:
        new = [(f, ids, None) for f, ids in
               _discovered(engine, base.tenant, conv, config, [f for f, _, _ in found], sightings)]
        new = _after_cached_prefix(engine, base, found, new) if new and sightings is not None else new
        if index is not None and new:  # indexed once a document: found later wherever it stands
            index.add(base.tenant, [IndexedText(conv[f.message]["content"][f.start : f.end], ids, f.chunk)
                                    for f, ids, _ in new])
        found = [*_outside(found, new), *new]  # a passage wins over the short stored runs inside it
    if not found:
        return base, ()
    found.sort(key=lambda f: (f[0].message, f[0].start))
    return _placed(base, found), tuple(f for f, _, _ in found)


def _outside(found: list, new: list) -> list:
    """Those of ``found`` that overlap none of ``new`` (both lists of (span, ids, source))."""
    return [f for f in found
            if not any(f[0].message == n.message and f[0].start < n.end and n.start < f[0].end for n, _, _ in new)]


def _placed(base: Request, found: list[tuple[SpanMatch, tuple[int, ...], SpanSource | None]]) -> Request:
    """``base`` with the ``found`` spans (in prompt order) as documents where they stand."""
    if not found:
        return base
    sources = [src for _, _, src in found]
    return dataclasses.replace(base, documents=[ids for _, ids, _ in found],
                               placement=[DocPlace(f.message, f.start, f.end) for f, _, _ in found],
                               sources=sources if any(sources) else None)


def _after_cached_prefix(engine: Any, base: Request, found: list, new: list) -> list:
    """The ``new`` (discovered) spans that do not lie inside what the engine already has
    cached for the prompt as it was sent before (``Engine.cached_prefix``). A passage
    admitted on its second sighting was text the first time; a repeat of that prompt, or a
    chat's next turn repeating it, is served from the cache only if it is rendered as it
    was then, so a passage inside the cached prefix stays text."""
    cached_prefix = getattr(engine, "cached_prefix", None)
    if cached_prefix is None:
        return new
    before = _placed(base, sorted(found, key=lambda f: (f[0].message, f[0].start)))
    covered = cached_prefix(before)
    if covered == 0:
        return new
    both = sorted([*_outside(found, new), *new], key=lambda f: (f[0].message, f[0].start))
    layout = engine.layout(_placed(base, both))
    ends = {id(f): start + len(doc) for f, start, doc in zip(both, layout.doc_starts, layout.docs)}
    return [f for f in new if ends[id(f)] > covered]


def _discovered(engine: Any, tenant: str, conv: list[dict[str, str]], config: ShapeConfig, taken: list[SpanMatch],
                sightings: Sightings | None = None) -> list[tuple[SpanMatch, tuple[int, ...]]]:
    """Long passages that the ``taken`` spans leave (``discovery.discover``) and that
    ``sightings`` admit (every one without), as spans."""
    passages = discover(engine.tokenizer, conv, config.discover_tokens, [(t.message, t.start, t.end) for t in taken])
    if sightings is not None:
        passages = [p for p in passages if sightings.admit(tenant, p)]
    return [(SpanMatch(p.message, p.start, p.end, len(p.token_ids), p.chunk, None, DISCOVERED), p.token_ids)
            for p in passages]
