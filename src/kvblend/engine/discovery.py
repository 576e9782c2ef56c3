"""Passage discovery: a prompt's long paragraphs treated as documents though never stored.

With ``documents.discover`` on, the text of a request's (non-assistant) messages outside
the spans already matched (a passage they cover less than half of is a passage still) is cut
at blank lines and markdown headings; each passage of at least ``min_tokens`` tokens (tokenized alone, the way it becomes a document) is placed in
the layout as a document where it stands. The first time it misses the store and the
engine's write-back stores its chunk KV; wherever the same passage appears again it hits.

``Sightings`` is the admission: a passage becomes a document only on its ``after``-th
sighting by the same tenant, so text a client pastes once (user text, one-off context) is
never stored; until then the prompt is computed as it is (exact, and prefix-cached).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvblend.blend.layout import tokenize_document

# A passage ends at a blank line, or before a markdown heading line ("# ..." to "###### ...").
_BREAK = re.compile(r"\n[ \t]*\n\s*|\n(?=[ \t]{0,3}#{1,6}[ \t])")
DISCOVERED = "discovered"
TAKEN_SHARE = 0.5  # a passage this much covered by stored runs is left to them


class Passage(NamedTuple):
    """A passage found at ``[start, end)`` of message ``message``, with its own token ids."""

    message: int
    start: int
    end: int
    token_ids: tuple[int, ...]

    @property
    def chunk(self) -> str:
        """A stable name for the passage: a digest of its ids."""
        return "passage-" + hashlib.sha256(repr(self.token_ids).encode()).hexdigest()[:24]


class Sightings:
    """How many times each tenant sent each passage: a bounded, thread-safe count (the
    least recently seen passage is forgotten first, so a flood of one-off text costs at most
    ``max_tracked`` entries of ~200 bytes, and is never admitted)."""

    def __init__(self, after: int = 2, max_tracked: int = 50_000) -> None:
        if after < 1 or max_tracked < 1:
            raise ValueError("after and max_tracked must be >= 1")
        self.after = after
        self.max_tracked = max_tracked
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, tenant: str, passage: Passage) -> bool:
        """Record a sighting of ``passage`` by ``tenant``; True from its ``after``-th on."""
        if self.after == 1:
            return True
        key = (tenant, passage.chunk)
        with self._lock:
            count = min(self._counts.pop(key, 0) + 1, self.after)
            self._counts[key] = count
            while len(self._counts) > self.max_tracked:
                self._counts.popitem(last=False)
        return count >= self.after

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)


def paragraphs(text: str) -> list[tuple[int, int]]:
    """[start, end) of each paragraph of ``text``, cut at blank lines and before markdown
    headings, without the whitespace around it (empty ones left out)."""
    out, pos = [], 0
    for cut in [*_BREAK.finditer(text), None]:
        stop = cut.start() if cut is not None else len(text)
        piece = text[pos:stop]
        lead = len(piece) - len(piece.lstrip())
        body = piece.strip()
        if body:
            out.append((pos + lead, pos + lead + len(body)))
        pos = cut.end() if cut is not None else len(text)
    return out


def covered_share(span: tuple[int, int], taken: Sequence[tuple[int, int]]) -> float:
    """The share of ``span``'s characters inside the ``taken`` spans (which do not overlap)."""
    inside = sum(max(0, min(span[1], b) - max(span[0], a)) for a, b in taken)
    return inside / max(1, span[1] - span[0])


def discover(tokenizer: Any, messages: Sequence[dict[str, str]], min_tokens: int,
             taken: Sequence[tuple[int, int, int]] = (), leave_to_taken: float = TAKEN_SHARE) -> list[Passage]:
    """The passages of at least ``min_tokens`` tokens in the non-assistant ``messages``, in
    prompt order, but those the ``taken`` (message, start, end) spans already cover
    ``leave_to_taken`` of (by characters). A passage holding only a short run of stored
    text is still a passage: reused, that run would save little, and the passage stored
    whole serves its next sighting whole (the caller drops the taken spans inside it)."""
    found = []
    for m, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            continue
        text = msg.get("content") or ""
        spans = [(a, b) for k, a, b in taken if k == m]
        for start, end in paragraphs(text):
            if end - start < min_tokens or covered_share((start, end), spans) >= leave_to_taken:
                continue  # a token holds at least one character: too short to qualify
            ids = tokenize_document(tokenizer, text[start:end])
            if len(ids) >= min_tokens:
                found.append(Passage(m, start, end, ids))
    return found
