"""Finding a tenant's stored texts, whole or in part, inside a prompt's text, on characters.

RAG frameworks paste retrieved passages into the message text, cut their own way (LangChain
~1,000 characters with overlaps, LlamaIndex sentence windows), so a prompt rarely holds a
stored chunk whole: it holds *runs* of stored text. Matching token ids (a rolling hash over
ids, as LMCache's blend server does) misses a passage that tokenizes differently inside the
message than alone; matching characters does not, and each run found is mapped back onto
the stored chunk's own tokens (``Match.token_ids``: the tokens whose characters lie inside
the run), whose stored KV the engine then reuses at its new position.

Every indexed text (a stored chunk's text) is registered under its *anchors*: the windows
of ``WINDOW`` characters inside it whose mixed Rabin–Karp hash (over code points) has its
top ``ANCHOR_BITS`` bits zero, about one window in 2**ANCHOR_BITS, chosen by content, so a
run of the text finds the same anchors wherever it stands. A text without one (short ones,
rarely) is anchored at its first window instead (``fixed``: found only whole or from its
start). Matching a message:

    h       = window_hashes(message)                   # (n - WINDOW + 1,) one numpy pass
    anchors = positions where h is an anchor           # ~ n / 2**ANCHOR_BITS of them
    known   = anchors whose hash passes the tenant's bit filter   # one vector gather
    for each known position p, for each (text t, offset o) under h[p]:
        extend message[p:] ~ t[o:] right and left while the characters agree (C-speed
        slice comparisons, a binary search); keep the run if it is t whole or at least
        ``SPAN_CHARS`` characters
    keep the non-overlapping runs that cover the most characters, each cut to whole tokens
    of its text (a run that is not the whole text needs the text's token cuts and at
    least ``min_span_tokens`` tokens); a run found in several stored texts (a shared
    paragraph) is taken from the one that continues the previous run's stored text
    (``continuity_order``): its KV was computed after the text that precedes it here

so the cost grows with the message's length (and the runs found), not with the number of
stored texts: the bit filter (``FILTER_BITS`` bits per anchor) keeps Python's per-anchor
work to the anchors of stored texts. An anchor hash holds at most ``MAX_BUCKET`` (text,
offset) pairs (the newest win). A run of a text that starts inside the last run found of
the same text is not extended again, so a repetitive message cannot make the work grow
with its length times the bucket size.

Token cuts (``token_cuts``): the (token index, character offset) pairs where a text's ids
decode to exactly its leading characters, from the tokenizer's offsets when its ids are
the stored ones, else from decoding prefixes. A run cut at them, placed between text
tokenized alone, decodes to the message's characters exactly.

Memory is bounded: ``DocumentIndex(max_bytes)`` counts each text's characters, its token
ids (4 bytes each, twice: the content key holds a copy), its cuts (8 bytes each),
``ANCHOR_BYTES`` per anchor and ``ENTRY_OVERHEAD`` (about what Python holds: 90 bytes per
stored token of English text, ``benchmarks/dropin.py``); past the bound it drops the least recently matched or added texts of
the tenant holding the most bytes. Each tenant has its own index: a lookup never reads
another tenant's texts.
"""

from __future__ import annotations

import bisect
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

WINDOW = 32  # characters per anchor window (a power of two: hashes are built by doubling)
ANCHOR_BITS = 4  # a window is an anchor with probability 2**-ANCHOR_BITS
MIN_CHARS = WINDOW  # shorter texts are not indexed
SPAN_CHARS = 2 * WINDOW  # a run shorter than this is kept only when it is its text whole
DEFAULT_SPAN_TOKENS = 32  # fewer reused tokens than this are not worth a span
CUT_EVERY = 4  # without the tokenizer's offsets, a cut every this many tokens (decoded prefixes)
FILTER_BITS = 16  # bits of the anchor filter per anchor (a power of two)
MIN_FILTER = 1 << 12
MAX_BUCKET = 64  # (text, offset) pairs per anchor hash
ENTRY_OVERHEAD = 400  # bytes per text besides its characters, ids, cuts and anchors
ANCHOR_BYTES = 120  # one anchor: its hash and offset, a dict slot, the hash key and packed (serial, offset) ints
DEFAULT_MAX_BYTES = 256 << 20
_BASE = np.uint64(0x100000001B3)  # polynomial base (odd)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: top bits of h * _MIX depend on all of h
_SHIFT = np.uint64(64 - ANCHOR_BITS)
_MIX2 = np.uint64(0xD6E8FEB86659FD93)  # another odd multiplier: the filter's bits
_OFFSET_BITS = 32


class IndexedText(NamedTuple):
    """A text to index: a stored chunk's characters and the token ids its KV was computed
    from, with the document and chunk it is (``document`` None: seen inline or discovered)."""

    text: str
    token_ids: tuple[int, ...]
    chunk: str
    document: str | None = None


class Match(NamedTuple):
    """Stored text found at ``[start, end)`` of message ``message``: the tokens
    ``source_ids[offset : offset + len(token_ids)]`` of the stored chunk ``chunk`` (its
    ids ``source_ids``), whose characters are exactly those. ``whole``: the chunk itself."""

    message: int
    start: int
    end: int
    token_ids: tuple[int, ...]
    chunk: str
    document: str | None
    source_ids: tuple[int, ...] = ()
    offset: int = 0

    @property
    def whole(self) -> bool:
        return self.offset == 0 and len(self.token_ids) == len(self.source_ids)


class _Entry(NamedTuple):
    text: str
    ids: array  # token ids, 4 bytes each
    chunk: str
    document: str | None
    anchor_hashes: array  # each anchor window's hash (8 bytes) ...
    anchor_offsets: array  # ... and its start in the text (4 bytes)
    fixed: bool  # anchored at its first window (no content-defined anchor)
    cut_tokens: array  # token indices where a token starts at a known character ...
    cut_chars: array  # ... offset (ascending; the text's end last), empty: whole only
    nbytes: int


# ----- hashing ------------------------------------------------------------------------------
def code_points(text: str) -> np.ndarray:
    """(n,) uint64 code points of ``text``."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)


def window_hashes(codes: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """(n - window + 1,) polynomial hashes mod 2**64 of every ``window``-long run of
    ``codes``: h[p] = sum_k codes[p + k] * BASE**(window - 1 - k), built by doubling
    (h_2m[p] = h_m[p] * BASE**m + h_m[p + m]) in log2(window) vector steps."""
    h, m, power = codes, 1, _BASE
    with np.errstate(over="ignore"):
        while m < window:
            h = h[:-m] * power + h[m:]  # (len - m,)
            power, m = power * power, 2 * m
    return h


def _mixed(h: np.ndarray) -> np.ndarray:
    return h * _MIX


def anchor_mask(h: np.ndarray) -> np.ndarray:
    """(len(h),) bool: the windows that are anchors (top ANCHOR_BITS bits of the mixed hash zero)."""
    return (_mixed(h) >> _SHIFT) == 0


def text_anchors(text: str) -> tuple[tuple[tuple[int, int], ...], bool]:
    """((hash, offset) of every anchor window of ``text``, fixed): its content-defined
    anchors, else its first window (``fixed``)."""
    with np.errstate(over="ignore"):
        h = window_hashes(code_points(text))
        positions = np.flatnonzero(anchor_mask(h))
        if positions.size == 0:
            return ((int(h[0]), 0),), True
        return tuple(zip(h[positions].tolist(), positions.tolist())), False


# ----- token cuts ---------------------------------------------------------------------------
def token_cuts(tokenizer: Any, text: str, ids: Sequence[int]) -> list[tuple[int, int]]:
    """(token index, character offset) pairs, ascending, where ``ids[:index]`` decodes to
    exactly ``text[:offset]`` (index 0 and len(ids) included when they do); empty when
    ``ids`` do not decode to ``text``. From the tokenizer's offsets when tokenizing ``text``
    alone gives ``ids`` (every token boundary that no character straddles), else from
    decoded prefixes every ``CUT_EVERY`` tokens."""
    ids = list(ids)
    if not ids or tokenizer.decode(ids, skip_special_tokens=False) != text:
        return []
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"] if list(enc["input_ids"]) == ids else None
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
        offsets = None
    if offsets is not None:
        cuts = [(0, 0)] if offsets[0][0] == 0 else []
        cuts += [(j, offsets[j][0]) for j in range(1, len(ids)) if offsets[j - 1][1] == offsets[j][0]]
        if offsets[-1][1] == len(text):
            cuts.append((len(ids), len(text)))
        if _spot_check(tokenizer, text, ids, cuts):
            return cuts
    points = list(range(0, len(ids), CUT_EVERY)) + [len(ids)]
    decoded = tokenizer.batch_decode([ids[:j] for j in points], skip_special_tokens=False)
    return [(j, len(d)) for j, d in zip(points, decoded) if text.startswith(d)]


def _spot_check(tokenizer: Any, text: str, ids: list[int], cuts: list[tuple[int, int]]) -> bool:
    """Whether four evenly spread cuts decode to their prefixes (offsets a tokenizer
    trims, or maps from a normalized text, fail it)."""
    if not cuts:
        return False
    sample = [cuts[i * (len(cuts) - 1) // 3] for i in range(4)]
    decoded = tokenizer.batch_decode([ids[:j] for j, _ in sample], skip_special_tokens=False)
    return all(d == text[:c] for (_, c), d in zip(sample, decoded))


# ----- choosing spans -----------------------------------------------------------------------
def best_spans(found: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The non-overlapping (start, end, tag) spans covering the most characters (weighted
    interval scheduling; adjacent spans do not overlap; ties keep fewer, longer spans, and
    of equal spans the one with the highest tag: the most recently indexed text)."""
    spans = sorted(set(found), key=lambda s: (s[1], s[0], -s[2]))  # at one place, the highest tag wins
    ends = [s[1] for s in spans]
    best: list[tuple[int, int]] = [(0, 0)]  # (covered, -count) over the first i spans
    for i, (start, end, _) in enumerate(spans):
        j = bisect.bisect_right(ends, start, 0, i)
        take = (best[j][0] + end - start, best[j][1] - 1)
        best.append(max(best[i], take))
    out, i = [], len(spans)
    while i > 0:
        start, end, tag = spans[i - 1]
        j = bisect.bisect_right(ends, start, 0, i - 1)
        if best[i] == best[i - 1]:
            i -= 1
            continue
        out.append((start, end, tag))
        i = j
    return out[::-1]


def common_run(a: str, i: int, b: str, j: int) -> tuple[int, int]:
    """(left, right): the longest run around ``a[i] ~ b[j]`` on which the strings agree:
    ``a[i - left : i + right] == b[j - left : j + right]`` (binary searches over slice
    comparisons, which run in C)."""
    return _agree(a, i, b, j, -1), _agree(a, i, b, j, 1)


def _agree(a: str, i: int, b: str, j: int, way: int) -> int:
    hi = min(len(a) - i, len(b) - j) if way > 0 else min(i, j)

    def same(n: int) -> bool:
        return a[i : i + n] == b[j : j + n] if way > 0 else a[i - n : i] == b[j - n : j]

    if same(hi):
        return hi
    lo = 0  # same(lo), not same(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if same(mid) else (lo, mid)
    return lo


def _token_run(entry: _Entry, start: int, end: int) -> tuple[int, int, int, int] | None:
    """(first token, end token, first char, end char) of the whole tokens of ``entry``
    inside its characters ``[start, end)``; None when there are none."""
    if start == 0 and end == len(entry.text):
        return 0, len(entry.ids), 0, end
    chars = entry.cut_chars
    a = bisect.bisect_left(chars, start)
    b = bisect.bisect_right(chars, end) - 1
    if a >= len(chars) or b < a:
        return None
    return entry.cut_tokens[a], entry.cut_tokens[b], chars[a], chars[b]


# ----- one tenant ---------------------------------------------------------------------------
class _BitFilter:
    """A set of 64-bit hashes that may answer yes falsely, never no falsely: one bit per
    hash slot, ``FILTER_BITS`` bits per member (grown by rebuilding; removed members'
    bits stay until then)."""

    def __init__(self, bits: int = MIN_FILTER) -> None:
        self.size_log2 = bits.bit_length() - 1
        self.bits = np.zeros(bits >> 3, dtype=np.uint8)

    def _slots(self, hashes: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return (hashes * _MIX2) >> np.uint64(64 - self.size_log2)

    def add(self, hashes: np.ndarray) -> None:
        slots = self._slots(hashes)
        np.bitwise_or.at(self.bits, slots >> np.uint64(3), (np.uint8(1) << (slots & np.uint64(7)).astype(np.uint8)))

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """(len(hashes),) bool: members, and about 1/FILTER_BITS of the others."""
        slots = self._slots(hashes)
        return (self.bits[slots >> np.uint64(3)] >> (slots & np.uint64(7)).astype(np.uint8)) & 1 == 1

    @classmethod
    def of(cls, hashes: Iterable[int], members: int) -> _BitFilter:
        bits = max(MIN_FILTER, 1 << (FILTER_BITS * max(1, members) - 1).bit_length())
        f = cls(bits)
        f.add(np.fromiter(hashes, dtype=np.uint64))
        return f


def _packed(serial: int, offset: int) -> int:
    return serial << _OFFSET_BITS | offset


class _TenantIndex:
    """One tenant's texts: entries in recency order; buckets by anchor hash, each one
    packed (serial, offset) int or a list of them (most hashes have one)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.anchors: dict[int, int | list[int]] = {}
        self.fixed: dict[int, int | list[int]] = {}
        self.by_content: dict[tuple[str, bytes], int] = {}
        self._fixed_sorted: np.ndarray | None = None
        self._filter = _BitFilter()
        self.nbytes = 0

    def add(self, serial: int, entry: _Entry) -> int:
        """Index ``entry``; the bytes this frees (texts pushed out of full buckets)."""
        buckets = self.fixed if entry.fixed else self.anchors
        freed = 0
        for value, offset in zip(entry.anchor_hashes, entry.anchor_offsets):
            held = buckets.get(value)
            if isinstance(held, list) and len(held) >= MAX_BUCKET:
                oldest = held[0] >> _OFFSET_BITS
                freed += self.remove(oldest).nbytes if oldest in self.entries else 0
                held = buckets.get(value)
            item = _packed(serial, offset)
            buckets[value] = item if held is None else (held + [item] if isinstance(held, list) else [held, item])
        self.entries[serial] = entry
        if entry.fixed:
            self._fixed_sorted = None
        else:
            self._note_anchors(entry.anchor_hashes)
        self.by_content[(entry.text, entry.ids.tobytes())] = serial
        self.nbytes += entry.nbytes
        return freed

    def remove(self, serial: int) -> _Entry:
        entry = self.entries.pop(serial)
        buckets = self.fixed if entry.fixed else self.anchors
        for value, offset in zip(entry.anchor_hashes, entry.anchor_offsets):
            held = buckets.get(value)
            item = _packed(serial, offset)
            if isinstance(held, list):
                if item in held:
                    held.remove(item)
                if len(held) == 1:
                    buckets[value] = held[0]
                elif not held:
                    del buckets[value]
            elif held == item:
                del buckets[value]
        self.by_content.pop((entry.text, entry.ids.tobytes()), None)
        self.nbytes -= entry.nbytes
        if entry.fixed:
            self._fixed_sorted = None
        return entry

    def _note_anchors(self, anchors: array) -> None:
        """Put ``anchors`` in the filter, rebuilt twice as large when it holds too few bits per anchor."""
        if FILTER_BITS * len(self.anchors) > self._filter.bits.size * 8:
            self._filter = _BitFilter.of(self.anchors, len(self.anchors))
        else:
            self._filter.add(np.frombuffer(anchors, dtype=np.uint64))

    def fixed_hashes(self) -> np.ndarray:
        """The sorted anchor hashes of the fixed-anchored texts (cached until they change)."""
        if self._fixed_sorted is None:
            self._fixed_sorted = np.array(sorted(self.fixed), dtype=np.uint64)
        return self._fixed_sorted

    def candidates(self, message: str) -> list[tuple[int, int, int, int]]:
        """Every (start, end, serial, text start) run of an indexed text found in
        ``message``: the text whole, or at least ``SPAN_CHARS`` of it."""
        if len(message) < MIN_CHARS:
            return []
        with np.errstate(over="ignore"):
            h = window_hashes(code_points(message))
            positions = np.flatnonzero(anchor_mask(h))
            positions = positions[self._filter.contains(h[positions])]
            hits = [(p, held) for p, v in zip(positions.tolist(), h[positions].tolist())
                    if (held := self.anchors.get(v)) is not None]
            if self.fixed:
                fixed = self.fixed_hashes()
                at = np.searchsorted(fixed, h).clip(max=len(fixed) - 1)
                hit = np.flatnonzero(fixed[at] == h)
                hits += [(p, self.fixed[v]) for p, v in zip(hit.tolist(), h[hit].tolist())]
                hits.sort(key=lambda x: x[0])
        return self._extend(message, hits, candidate_limit(len(message)))

    def _extend(self, message: str, hits: list[tuple[int, int | list[int]]],
                limit: int) -> list[tuple[int, int, int, int]]:
        """The runs around ``hits`` (message position, packed anchors), at most ``limit``;
        a hit inside the last run found of the same text is skipped (see the module
        docstring)."""
        found: list[tuple[int, int, int, int]] = []
        ends: dict[int, int] = {}
        for pos, held in hits:
            for item in held if isinstance(held, list) else (held,):
                serial, offset = item >> _OFFSET_BITS, item & ((1 << _OFFSET_BITS) - 1)
                if pos < ends.get(serial, 0):
                    continue
                text = self.entries[serial].text
                left, right = common_run(message, pos, text, offset)
                if right < WINDOW:  # a hash collision
                    continue
                start, end, t_start = pos - left, pos + right, offset - left
                if end - start < SPAN_CHARS and end - start < len(text):
                    continue
                found.append((start, end, serial, t_start))
                ends[serial] = end
                if len(found) >= limit:
                    return found
        return found


def continuity_order(index: _TenantIndex, runs: Sequence[tuple[int, int, int, int]], equal: Sequence[int],
                     chosen: int, prev: tuple[int, int, int, int] | None,
                     following: tuple[int, int, int, int] | None) -> list[int]:
    """The runs ``equal`` (indices into ``runs``, all at the same place of the message) in
    the order to try them, best first. A text repeated in several stored texts (a shared
    paragraph, boilerplate) is found in each; the one to reuse is the one whose stored KV
    was computed after the text that precedes the run here: the stored text of the
    previous run, further on (the stored gap closest to the message's), then another
    chunk of its document, then the stored text of the next run; else ``chosen`` first
    (``best_spans``'s pick), then the rest."""
    if len(equal) == 1:
        return list(equal)
    document = index.entries[prev[2]].document if prev is not None else None

    def rank(j: int) -> tuple[int, int]:
        start, _, serial, t_start = runs[j]
        if prev is not None:
            p_start, p_end, p_serial, p_t_start = prev
            if serial == p_serial and t_start >= p_t_start:  # the stored gap against the message's
                return 0, abs((t_start - p_t_start - (p_end - p_start)) - (start - p_end))
            if document is not None and index.entries[serial].document == document:
                return 1, 0
        if following is not None and serial == following[2]:
            return 2, 0
        return 3, 0 if j == chosen else 1
    return sorted(equal, key=rank)


def candidate_limit(chars: int) -> int:
    """Runs kept per message: twice the most non-overlapping texts it can hold, plus a
    bucket's worth. Past it later runs are not matched (computed, never wrong)."""
    return 2 * (chars // MIN_CHARS) + MAX_BUCKET


class DocumentIndex:
    """Per-tenant character index of stored texts, bounded to ``max_bytes`` in all.

    ``add`` indexes texts (a text already there, with the same ids, only becomes the most
    recent); ``match`` finds them, whole or in runs, in messages; ``remove_document`` drops
    a document's texts (``remove_chunks`` chunks by name). ``tokenizer``: the model's, to
    cut runs on its tokens (``token_cuts``); without it only whole texts match.
    Thread-safe (one lock; a lookup holds it for one message's runs)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, tokenizer: Any = None,
                 min_span_tokens: int = DEFAULT_SPAN_TOKENS) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if min_span_tokens < 1:
            raise ValueError("min_span_tokens must be >= 1")
        self.max_bytes = max_bytes
        self.tokenizer = tokenizer
        self.min_span_tokens = min_span_tokens
        self._tenants: dict[str, _TenantIndex] = {}
        self._lock = threading.Lock()
        self._serial = 0
        self.nbytes = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(t.entries) for t in self._tenants.values())

    def count(self, tenant: str) -> int:
        with self._lock:
            index = self._tenants.get(tenant)
            return len(index.entries) if index else 0

    def tokens(self) -> int:
        """Token ids held, over every tenant (``nbytes / tokens()``: bytes per stored token)."""
        with self._lock:
            return sum(len(e.ids) for t in self._tenants.values() for e in t.entries.values())

    def add(self, tenant: str, texts: Iterable[IndexedText]) -> int:
        """Index ``texts`` for ``tenant`` (shorter than ``MIN_CHARS`` or without ids: skipped);
        the number indexed. A text already indexed only becomes the most recent (its cuts
        are not computed again). May evict the least recent texts to stay within ``max_bytes``."""
        texts = [t for t in texts if len(t.text) >= MIN_CHARS and t.token_ids]
        with self._lock:
            index = self._tenants.get(tenant)
            known = {} if index is None else index.by_content
            fresh = [t for t in texts if (t.text, array("I", t.token_ids).tobytes()) not in known]
        prepared = {id(t): _entry(t, self.tokenizer) for t in fresh}
        with self._lock:
            index = self._tenants.setdefault(tenant, _TenantIndex())
            for t in texts:
                entry = prepared.get(id(t))
                self._add_locked(index, t, entry)
            self._evict_locked()
            if not index.entries:
                self._tenants.pop(tenant, None)
        return len(texts)

    def _add_locked(self, index: _TenantIndex, text: IndexedText, entry: _Entry | None) -> None:
        serial = index.by_content.get((text.text, array("I", text.token_ids).tobytes()))
        if serial is not None:  # already indexed: refresh its recency and names
            old = index.remove(serial)
            self.nbytes -= old.nbytes
            document = text.document if text.document is not None else old.document  # seen inline: still stored
            entry = old._replace(chunk=text.chunk, document=document)
        elif entry is None:  # indexed and dropped since we looked: prepare it here
            entry = _entry(text, self.tokenizer)
        self._serial += 1
        self.nbytes += entry.nbytes - index.add(self._serial, entry)

    def _evict_locked(self) -> None:
        while self.nbytes > self.max_bytes and self._tenants:
            name, index = max(self._tenants.items(), key=lambda kv: kv[1].nbytes)
            serial = next(iter(index.entries))
            self.nbytes -= index.remove(serial).nbytes
            if not index.entries:
                del self._tenants[name]

    def clear(self) -> None:
        """Drop every text of every tenant."""
        with self._lock:
            self._tenants.clear()
            self.nbytes = 0

    def remove_document(self, tenant: str, document: str) -> int:
        """Drop every text of ``document`` from the tenant's index; how many were dropped."""
        return self._remove(tenant, lambda e: e.document == document)

    def remove_chunks(self, tenant: str, chunks: Iterable[str]) -> int:
        """Drop the tenant's texts named by any of ``chunks``; how many were dropped."""
        names = set(chunks)
        return self._remove(tenant, lambda e: e.chunk in names)

    def chunk_names(self, tenant: str, prefix: str = "") -> set[str]:
        """The chunk names of the tenant's texts (those starting with ``prefix``)."""
        with self._lock:
            index = self._tenants.get(tenant)
            return set() if index is None else {e.chunk for e in index.entries.values() if e.chunk.startswith(prefix)}

    def _remove(self, tenant: str, which: Any) -> int:
        with self._lock:
            index = self._tenants.get(tenant)
            if index is None:
                return 0
            gone = [s for s, e in index.entries.items() if which(e)]
            for serial in gone:
                self.nbytes -= index.remove(serial).nbytes
            if not index.entries:
                del self._tenants[tenant]
            return len(gone)

    def match(self, tenant: str, messages: Sequence[str]) -> list[Match]:
        """The tenant's texts found in ``messages`` (by message index, then position): in
        each message the non-overlapping runs covering the most characters, each cut to
        whole tokens of its text (a run that is not its text whole: at least
        ``min_span_tokens`` of them)."""
        out: list[Match] = []
        with self._lock:
            index = self._tenants.get(tenant)
            if index is None:
                return out
            for m, text in enumerate(messages):
                runs = index.candidates(text)
                chosen = best_spans([(start, end, i) for i, (start, end, _, _) in enumerate(runs)])
                same: dict[tuple[int, int], list[int]] = {}
                for i, (start, end, _, _) in enumerate(runs):
                    same.setdefault((start, end), []).append(i)
                prev = None
                for k, (start, end, i) in enumerate(chosen):
                    following = runs[chosen[k + 1][2]] if k + 1 < len(chosen) else None
                    for j in continuity_order(index, runs, same[(start, end)], i, prev, following):
                        match = self._cut(index, m, runs[j])
                        if match is not None:
                            out.append(match)
                            prev = runs[j]
                            break
        return out

    def _cut(self, index: _TenantIndex, message: int, run: tuple[int, int, int, int]) -> Match | None:
        start, end, serial, t_start = run
        entry = index.entries[serial]
        cut = _token_run(entry, t_start, t_start + end - start)
        if cut is None:
            return None
        first, last, c_first, c_end = cut
        whole = first == 0 and last == len(entry.ids)
        if not whole and last - first < self.min_span_tokens:
            return None
        index.entries.move_to_end(serial)
        ids = tuple(entry.ids)
        return Match(message, start + c_first - t_start, start + c_end - t_start, ids[first:last], entry.chunk,
                     entry.document, ids, first)


def _entry(text: IndexedText, tokenizer: Any = None) -> _Entry:
    anchors, fixed = text_anchors(text.text)
    hashes, offsets = array("Q", [h for h, _ in anchors]), array("I", [o for _, o in anchors])
    ids = array("I", text.token_ids)
    cuts = token_cuts(tokenizer, text.text, text.token_ids) if tokenizer is not None else []
    cut_tokens, cut_chars = array("I", [j for j, _ in cuts]), array("I", [c for _, c in cuts])
    nbytes = (sys.getsizeof(text.text) + 2 * ids.itemsize * len(ids) + 8 * len(cuts)  # ids: also the content key
              + ANCHOR_BYTES * len(anchors) + ENTRY_OVERHEAD)
    return _Entry(text.text, ids, text.chunk, text.document, hashes, offsets, fixed, cut_tokens, cut_chars, nbytes)
