"""Chunking on the serving model's tokenizer: fixed token windows, markdown sections, dialogue turns.

A document is tokenized once (no special tokens) and cut only between tokens, so every
chunk's ids are a slice of the document's ids: without overlap the chunks' ids
concatenate back to the document's ids exactly, and the engine is handed those ids (not
re-tokenized text), so the chunk KV stored at ingest is the KV a request looks up.

    ids     = tokenizer(document)                    # once, with character offsets
    units   = [whole doc] | sections | turns          # token spans starting at a line
    chunks  = pack(units, size) -> windows(size, overlap)

A chunk's id is a sha256 over its token ids, the tokenizer's fingerprint and the chunker's
parameters, so re-ingesting unchanged text gives the same ids (and re-uses stored KV and
index rows), while a different tokenizer or chunk size never collides.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvblend.store.keys import token_bytes

CHUNKERS = ("tokens", "markdown", "dialogue")
CHUNK_ID_VERSION = b"kvblend/rag-chunk/v1"
MAX_CHUNK_TOKENS = 32768

_FENCE_RE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING_RE = re.compile(r"^\s{0,3}#{1,6}\s")
_TURN_RE = re.compile(r"^\s*(?:\[[^\]\n]{0,40}\]\s*)?[A-Za-z][\w .'\-]{0,39}:\s")


@dataclass(frozen=True)
class ChunkerConfig:
    """How to cut documents. ``kind``: ``tokens`` (fixed windows of ``size`` tokens, each
    overlapping the previous by ``overlap``), ``markdown`` (heading sections) or
    ``dialogue`` (speaker turns); sections and turns are packed greedily into chunks of
    at most ``size`` tokens, and a unit longer than ``size`` is cut into windows."""

    kind: str = "tokens"
    size: int = 512
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CHUNKERS:
            raise ValueError(f"chunker must be one of {', '.join(CHUNKERS)}; got {self.kind!r}")
        if not 1 <= self.size <= MAX_CHUNK_TOKENS:
            raise ValueError(f"chunk size must be in [1, {MAX_CHUNK_TOKENS}] tokens; got {self.size}")
        if not 0 <= self.overlap < self.size:
            raise ValueError(f"overlap must be in [0, size); got {self.overlap} with size {self.size}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Chunk:
    """One chunk: ``token_ids`` = document ids ``[start, end)``; ``text`` is their decoding."""

    chunk_id: str
    ordinal: int
    start: int
    end: int
    token_ids: tuple[int, ...]
    text: str

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def chunk_id(token_ids: Sequence[int], tokenizer_id: str, config: ChunkerConfig) -> str:
    """sha256 hex over the chunk's ids, the tokenizer's fingerprint and the chunker's parameters."""
    h = hashlib.sha256(CHUNK_ID_VERSION)
    for part in (tokenizer_id.encode(), config.to_json().encode(), token_bytes(token_ids)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def tokenize_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The document's ids (no special tokens) and each token's character span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _line_starts(text: str, is_break) -> list[int]:
    """Character offsets of lines (outside code fences) that ``is_break`` marks as a new unit."""
    starts, pos, fenced = [], 0, False
    for line in text.splitlines(keepends=True):
        if _FENCE_RE.match(line):
            fenced = not fenced
        elif not fenced and pos > 0 and is_break(line):
            starts.append(pos)
        pos += len(line)
    return starts


def _token_boundary(offsets: list[tuple[int, int]], char_pos: int, lo: int) -> int:
    """Index of the first token at or after ``lo`` that ends after ``char_pos`` (a token
    that straddles the position starts the new unit)."""
    i = lo
    while i < len(offsets) and offsets[i][1] <= char_pos:
        i += 1
    return i


def _unit_bounds(kind: str, text: str, offsets: list[tuple[int, int]]) -> list[int]:
    """Token indices where units start (always 0 first), for sections or turns."""
    n = len(offsets)
    if kind == "tokens" or n == 0:
        return [0]
    pattern = _HEADING_RE if kind == "markdown" else _TURN_RE
    bounds = [0]
    for pos in _line_starts(text, lambda line: bool(pattern.match(line))):
        b = _token_boundary(offsets, pos, bounds[-1])
        if bounds[-1] < b < n:
            bounds.append(b)
    return bounds


def _char_safe(offsets: list[tuple[int, int]], i: int) -> bool:
    """True when a cut before token ``i`` does not split a character (byte-level BPE can
    spread one character over several tokens whose spans then overlap)."""
    return i <= 0 or i >= len(offsets) or offsets[i][0] >= offsets[i - 1][1]


def _safe_cut(offsets: list[tuple[int, int]], floor: int, cut: int) -> int:
    """The largest cut in ``(floor, cut]`` that does not split a character; ``cut`` if none."""
    c = cut
    while c > floor and not _char_safe(offsets, c):
        c -= 1
    return c if c > floor else cut


def _windows(start: int, end: int, size: int, overlap: int, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Cut ``[start, end)`` into windows of at most ``size`` tokens, each starting
    ``overlap`` tokens before the previous one ended; a cut moves back (a token or two)
    rather than split a character."""
    out, s = [], start
    while True:
        e = min(s + size, end)
        if e < end:
            e = _safe_cut(offsets, s + overlap, e)
        out.append((s, e))
        if e >= end:
            return out
        s = e - overlap


def _pack(bounds: list[int], n: int, size: int) -> list[tuple[int, int]]:
    """Greedily merge consecutive units ``[bounds[i], bounds[i+1])`` into spans of at most
    ``size`` tokens; a unit longer than ``size`` stays alone (cut into windows later)."""
    units = list(zip(bounds, bounds[1:] + [n]))
    spans: list[tuple[int, int]] = []
    for s, e in units:
        if spans and e - spans[-1][0] <= size:
            spans[-1] = (spans[-1][0], e)
        else:
            spans.append((s, e))
    return spans


def split_ids(kind: str, text: str, offsets: list[tuple[int, int]], config: ChunkerConfig) -> list[tuple[int, int]]:
    """Token spans ``[start, end)`` of the chunks of a tokenized document."""
    n = len(offsets)
    if n == 0:
        return []
    overlap = config.overlap
    if kind == "tokens":
        return _windows(0, n, config.size, overlap, offsets)
    spans = []
    for s, e in _pack(_unit_bounds(kind, text, offsets), n, config.size):
        spans.extend(_windows(s, e, config.size, overlap, offsets) if e - s > config.size else [(s, e)])
    return spans


def chunk_text(tokenizer: Any, text: str, config: ChunkerConfig, tokenizer_id: str) -> list[Chunk]:
    """Cut ``text`` into chunks on ``tokenizer``'s tokens. ``tokenizer_id`` (the tokenizer's
    fingerprint) goes into each chunk id. An empty or whitespace-only text gives no chunks."""
    if not text.strip():
        return []
    ids, offsets = tokenize_with_offsets(tokenizer, text)
    chunks = []
    for i, (s, e) in enumerate(split_ids(config.kind, text, offsets, config)):
        piece = tuple(ids[s:e])
        chunks.append(Chunk(chunk_id(piece, tokenizer_id, config), i, s, e, piece,
                            tokenizer.decode(list(piece), skip_special_tokens=False)))
    return chunks


def chunk_pieces(tokenizer: Any, pieces: Iterable[str], config: ChunkerConfig, tokenizer_id: str) -> Iterator[Chunk]:
    """``chunk_text`` over a document given in pieces (``readers.split_pieces``), one piece
    tokenized at a time so that memory does not grow with the document: a chunk never
    straddles two pieces (the last chunk of a piece may be short), ordinals and token
    offsets run on across pieces. A document of one piece gives ``chunk_text``'s chunks."""
    ordinal = base = 0
    for piece in pieces:
        chunks = chunk_text(tokenizer, piece, config, tokenizer_id)
        for c in chunks:
            yield replace(c, ordinal=ordinal, start=base + c.start, end=base + c.end)
            ordinal += 1
        base += chunks[-1].end if chunks else 0
