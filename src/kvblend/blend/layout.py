"""Rendering a request into token ids with known spans: text segments and documents.

Each document is tokenized alone (no special tokens) and the ids are concatenated;
joined text is never re-tokenized, so every method sees exactly the same ids.

Where documents sit (``placement``):

* ``None`` — all of them, in order, at the start of the (last) user turn, where the chat
  template puts content (a request's ``documents`` field).
* one ``DocPlace(message, start, end)`` per document — the document replaces the
  characters ``[start, end)`` of that message's content (``start == end``: inserted
  there). Messages are counted in the conversation as rendered: the ``system`` prompt
  first when given, then the messages (or the question as one user turn). This is how a
  passage found inside a message's text becomes a document where it stands.

The chat template renders the conversation once with a placeholder per document; the
rendered text is cut at the placeholders and every text segment between them is tokenized
alone, so the layout is ``prefix | doc_1 | gap_1 | doc_2 | ... | doc_n | suffix``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvblend.errors import InvalidRequestError
from kvblend.generation.stream import chat_text

_MARK = "\x00KVBLEND_DOC_{}\x00"
_MARKS = re.compile("\x00KVBLEND_DOC_(\\d+)\x00")


class DocPlace(NamedTuple):
    """Where one document stands: it replaces ``content[start:end]`` of message ``message``
    (0-based over the rendered conversation: system prompt first when given)."""

    message: int
    start: int
    end: int


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of one prompt: ``prefix + docs[0] + gaps[0] + docs[1] + ... + docs[-1] + suffix``.

    ``gaps[i]`` is the text between ``docs[i]`` and ``docs[i + 1]`` (computed, never cached
    as a chunk); ``()`` means every document is adjacent to the next."""

    prefix: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]
    gaps: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.gaps and len(self.gaps) != len(self.docs) - 1:
            raise ValueError(f"{len(self.docs)} documents need {len(self.docs) - 1} gaps; got {len(self.gaps)}")

    def gap(self, i: int) -> tuple[int, ...]:
        """The text's ids between document ``i`` and ``i + 1``."""
        return self.gaps[i] if self.gaps else ()

    @property
    def ids(self) -> list[int]:
        out = list(self.prefix)
        for i, d in enumerate(self.docs):
            out.extend(d)
            if i + 1 < len(self.docs):
                out.extend(self.gap(i))
        return out + list(self.suffix)

    @property
    def doc_starts(self) -> list[int]:
        starts, pos = [], len(self.prefix)
        for i, d in enumerate(self.docs):
            starts.append(pos)
            pos += len(d) + (len(self.gap(i)) if i + 1 < len(self.docs) else 0)
        return starts

    @property
    def text_tokens(self) -> int:
        """Tokens outside every document (prefix, gaps, suffix): always computed."""
        return len(self.prefix) + sum(map(len, self.gaps)) + len(self.suffix)

    def __len__(self) -> int:
        return self.text_tokens + sum(map(len, self.docs))


def tokenize_document(tokenizer: Any, doc: str | Sequence[int]) -> tuple[int, ...]:
    """A document's own ids: text tokenized alone without BOS/EOS, or ids as given."""
    if isinstance(doc, str):
        return tuple(tokenizer(doc, add_special_tokens=False)["input_ids"])
    ids = tuple(int(t) for t in doc)
    vocab = len(tokenizer)  # computed by the tokenizer on each call: once per document
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequestError("document token ids must be within the tokenizer's vocabulary")
    return ids


def conversation(system: str | None, messages: Sequence[dict[str, str]] | None,
                 question: str | None) -> list[dict[str, str]]:
    """The messages as rendered: the system prompt first when given, then the messages
    (or ``question`` as one user turn). ``DocPlace.message`` indexes this list."""
    out = [{"role": "system", "content": system}] if system is not None else []
    if messages is not None:
        return out + [dict(m) for m in messages]
    return out + [{"role": "user", "content": question or ""}]


def check_placement(conv: Sequence[dict[str, str]], placement: Sequence[DocPlace], n_docs: int) -> None:
    """InvalidRequestError unless there is one place per document, each inside its
    message's content, in prompt order and not overlapping."""
    if len(placement) != n_docs:
        raise InvalidRequestError(f"placement needs one place per document: {n_docs} documents, {len(placement)} places")
    last = (-1, 0)
    for i, p in enumerate(placement):
        if not 0 <= p.message < len(conv):
            raise InvalidRequestError(f"document {i} is placed in message {p.message}, which does not exist")
        if not 0 <= p.start <= p.end <= len(conv[p.message].get("content") or ""):
            raise InvalidRequestError(f"document {i}'s place [{p.start}, {p.end}) is outside its message")
        if (p.message, p.start) < last:
            raise InvalidRequestError(f"document {i} overlaps or precedes the document before it")
        last = (p.message, p.end)


def _with_marks(conv: list[dict[str, str]], placement: Sequence[DocPlace] | None, n_docs: int) -> list[dict[str, str]]:
    """The conversation with a placeholder per document where it stands (``None``: all at
    the start of the last user turn). Without documents there is no placeholder: the
    rendered text is tokenized whole, as any server tokenizes it, so that a chat's next
    turn repeats this turn's ids exactly (a cut would tokenize the text on either side of
    it alone, and the next turn, cut elsewhere, would differ there: no prefix reuse)."""
    if placement is None:
        if not n_docs:
            if not conv:
                raise InvalidRequestError("the conversation needs a user message to hold the documents")
            return conv
        users = [i for i, m in enumerate(conv) if m.get("role") == "user"]
        if not users:
            raise InvalidRequestError("the conversation needs a user message to hold the documents")
        conv[users[-1]]["content"] = "".join(_MARK.format(i) for i in range(n_docs)) + (conv[users[-1]]["content"] or "")
        return conv
    check_placement(conv, placement, n_docs)
    by_message: dict[int, list[tuple[int, DocPlace]]] = {}
    for i, p in enumerate(placement):
        by_message.setdefault(p.message, []).append((i, p))
    for m, places in by_message.items():
        text, pieces, pos = conv[m]["content"] or "", [], 0
        for i, p in places:
            pieces += [text[pos : p.start], _MARK.format(i)]
            pos = p.end
        conv[m]["content"] = "".join(pieces) + text[pos:]
    return conv


def split_marked(texts: Sequence[str], n_docs: int) -> list[list[str]]:
    """Each text cut at the placeholders of ``n_docs`` documents: per text, the segments
    around its placeholders. InvalidRequestError unless the placeholders, read across the
    texts in order, are each document's once in order: a template that altered them."""
    out, found = [], []
    for text in texts:
        parts = _MARKS.split(text)
        out.append(parts[0::2])
        found += parts[1::2]
    if found != [str(i) for i in range(n_docs)]:
        raise InvalidRequestError("the chat template altered the document placeholders")
    return out


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()


def _from_segments(tokenizer: Any, segments: Sequence[Sequence[str | tuple[int, ...]]],
                   docs: tuple[tuple[int, ...], ...]) -> PromptLayout:
    """A layout from the text around each document; a segment may join several pieces
    (texts each tokenized alone, or ids as they are)."""
    enc = [tuple(t for piece in seg for t in (piece if isinstance(piece, tuple) else _encode(tokenizer, piece)))
           for seg in segments]
    gaps = tuple(enc[1:-1])
    return PromptLayout(enc[0], docs, enc[-1], gaps if any(gaps) else ())


def render_layout(
    tokenizer: Any,
    documents: Sequence[str | Sequence[int]],
    question: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    system: str | None = None,
    use_chat_template: bool = True,
    placement: Sequence[DocPlace] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> PromptLayout:
    """Lay out a RAG prompt. Give ``question`` (one user turn) or chat ``messages``;
    ``placement`` puts each document inside a message's text (see the module docstring);
    ``template_kwargs``: extra chat-template variables (``generation.stream.chat_text``)."""
    if (question is None) == (messages is None):
        raise InvalidRequestError("give exactly one of question or messages")
    docs = tuple(tokenize_document(tokenizer, d) for d in documents)
    conv = _with_marks(conversation(system, messages, question), placement, len(docs))
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = chat_text(tokenizer, conv, template_kwargs)
        if not docs:  # the whole text, tokenized at once
            return _from_segments(tokenizer, [[""], [text]], docs)
        return _from_segments(tokenizer, [[s] for s in split_marked([text], len(docs))[0]], docs)
    if messages is not None:
        raise InvalidRequestError("this model has no chat template: send a question, not messages")
    return _plain_layout(tokenizer, conv, docs)


def _plain_layout(tokenizer: Any, conv: list[dict[str, str]], docs: tuple[tuple[int, ...], ...]) -> PromptLayout:
    """Without a chat template: BOS, then the system prompt and the question, each text
    tokenized alone (a segment may join the end of one and the start of the other)."""
    bos = (tokenizer.bos_token_id,) if tokenizer.bos_token_id is not None else ()
    segments: list[list[str | tuple[int, ...]]] = [[bos]]
    for texts in split_marked([m["content"] or "" for m in conv], len(docs)):
        segments[-1].append(texts[0])
        segments.extend([t] for t in texts[1:])
    if not docs:  # one segment: the whole prompt, after an empty prefix
        segments.insert(0, [""])
    layout = _from_segments(tokenizer, segments, docs)
    if not len(layout):
        raise InvalidRequestError("the prompt is empty: give a question, documents or a system prompt")
    return layout
