"""Finding a tenant's stored documents inside a prompt's text, on characters.

RAG frameworks paste retrieved passages into the message text. Matching token ids (a
rolling hash over ids, as LMCache's blend server does) misses a passage that tokenizes
differently inside the message than alone; matching characters does not, and each matched
span is then tokenized alone (its stored chunk's ids) by the layout.

Every indexed text (a stored chunk's text) is registered under one *anchor*: a window of
``WINDOW`` characters inside it, chosen by content (Rabin–Karp hashes over code points:
the windows whose mixed hash has its top ``ANCHOR_BITS`` bits zero are anchors, and the
text keeps the one with the smallest mixed hash). A text without such a window (short
ones, rarely) is anchored at its first window instead (``fixed``). Matching a message:

    h       = window_hashes(message)                   # (n - WINDOW + 1,) one numpy pass
    anchors = positions where h is an anchor           # ~ n / 2**ANCHOR_BITS of them
    known   = anchors whose hash passes the tenant's bit filter   # one vector gather
    for each known position p, for each text t in its bucket:
        s = p - t.anchor_offset; verify message[s : s + len(t)] == t   # a full comparison
    keep the non-overlapping verified spans that cover the most characters

so the cost grows with the message's length (and the number of spans found), not with the
number of stored texts: the bit filter (``FILTER_BITS`` bits per text, so about
1/``FILTER_BITS`` of the anchors pass it falsely) keeps Python's per-anchor work to the
anchors of stored texts. Texts sharing an anchor window share a bucket (a bucket holds at
most ``MAX_BUCKET`` texts; the newest win).

Memory is bounded: ``DocumentIndex(max_bytes)`` counts each text's characters, its token
ids (4 bytes each) and ``ENTRY_OVERHEAD``; past the bound it drops the least recently
matched or added texts of the tenant holding the most bytes. Each tenant has its own
index: a lookup never reads another tenant's texts.
"""

from __future__ import annotations

import bisect
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

WINDOW = 32  # characters per anchor window (a power of two: hashes are built by doubling)
ANCHOR_BITS = 3  # a window is an anchor with probability 2**-ANCHOR_BITS
MIN_CHARS = WINDOW  # shorter texts are not indexed
FILTER_BITS = 64  # bits of the anchor filter per indexed text (a power of two)
MIN_FILTER = 1 << 12
MAX_BUCKET = 64  # texts per anchor hash
ENTRY_OVERHEAD = 400  # bytes per text besides its characters and ids (objects, dict slots)
DEFAULT_MAX_BYTES = 256 << 20
_BASE = np.uint64(0x100000001B3)  # polynomial base (odd)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: top bits of h * _MIX depend on all of h
_SHIFT = np.uint64(64 - ANCHOR_BITS)
_MIX2 = np.uint64(0xD6E8FEB86659FD93)  # another odd multiplier: the filter's bits


class IndexedText(NamedTuple):
    """A text to index: a stored chunk's characters and the token ids its KV was computed
    from, with the document and chunk it is (``document`` None: seen inline or discovered)."""

    text: str
    token_ids: tuple[int, ...]
    chunk: str
    document: str | None = None


class Match(NamedTuple):
    """A stored text found at ``[start, end)`` of message ``message``."""

    message: int
    start: int
    end: int
    token_ids: tuple[int, ...]
    chunk: str
    document: str | None


class _Entry(NamedTuple):
    text: str
    ids: array  # token ids, 4 bytes each
    chunk: str
    document: str | None
    offset: int  # the anchor window's start in the text
    anchor: int  # the anchor window's hash
    fixed: bool  # anchored at its first window (no content-defined anchor)
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


def choose_anchor(text: str) -> tuple[int, int, bool]:
    """(offset, hash, fixed) of ``text``'s anchor window: the content-defined anchor with
    the smallest mixed hash, else its first window (``fixed``)."""
    with np.errstate(over="ignore"):
        h = window_hashes(code_points(text))
        positions = np.flatnonzero(anchor_mask(h))
        if positions.size == 0:
            return 0, int(h[0]), True
        best = int(positions[np.argmin(_mixed(h[positions]))])
    return best, int(h[best]), False


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



class _TenantIndex:
    """One tenant's texts: entries in recency order, buckets by anchor hash."""

    def __init__(self) -> None:
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.anchors: dict[int, list[int]] = {}
        self.fixed: dict[int, list[int]] = {}
        self.by_content: dict[tuple[str, bytes], int] = {}
        self._fixed_sorted: np.ndarray | None = None
        self._filter = _BitFilter()
        self.nbytes = 0

    def add(self, serial: int, entry: _Entry) -> int:
        """Index ``entry``; the bytes this frees (the oldest text of a full bucket)."""
        buckets = self.fixed if entry.fixed else self.anchors
        bucket = buckets.setdefault(entry.anchor, [])
        freed = self.remove(bucket[0]).nbytes if len(bucket) >= MAX_BUCKET else 0
        buckets.setdefault(entry.anchor, []).append(serial)
        self.entries[serial] = entry
        if not entry.fixed:
            self._note_anchor(entry.anchor)
        self.by_content[(entry.text, entry.ids.tobytes())] = serial
        self.nbytes += entry.nbytes
        if entry.fixed:
            self._fixed_sorted = None
        return freed

    def remove(self, serial: int) -> _Entry:
        entry = self.entries.pop(serial)
        buckets = self.fixed if entry.fixed else self.anchors
        bucket = buckets[entry.anchor]
        bucket.remove(serial)
        if not bucket:
            del buckets[entry.anchor]
        self.by_content.pop((entry.text, entry.ids.tobytes()), None)
        self.nbytes -= entry.nbytes
        if entry.fixed:
            self._fixed_sorted = None
        return entry

    def _note_anchor(self, anchor: int) -> None:
        """Put ``anchor`` in the filter, rebuilt twice as large when it holds too few bits per text."""
        if FILTER_BITS * len(self.anchors) > self._filter.bits.size * 8:
            self._filter = _BitFilter.of(self.anchors, len(self.anchors))
        else:
            self._filter.add(np.array([anchor], dtype=np.uint64))

    def fixed_hashes(self) -> np.ndarray:
        """The sorted anchor hashes of the fixed-anchored texts (cached until they change)."""
        if self._fixed_sorted is None:
            self._fixed_sorted = np.array(sorted(self.fixed), dtype=np.uint64)
        return self._fixed_sorted

    def candidates(self, message: str) -> list[tuple[int, int, int]]:
        """Every verified (start, end, serial) occurrence of an indexed text in ``message``."""
        if len(message) < MIN_CHARS:
            return []
        with np.errstate(over="ignore"):
            h = window_hashes(code_points(message))
            positions = np.flatnonzero(anchor_mask(h))
            positions = positions[self._filter.contains(h[positions])]
            found: list[tuple[int, int, int]] = []
            ends: dict[int, int] = {}
            limit = candidate_limit(len(message))
            self._verify(message, positions.tolist(), h[positions].tolist(), self.anchors, found, ends, limit)
            if self.fixed:
                fixed = self.fixed_hashes()
                at = np.searchsorted(fixed, h).clip(max=len(fixed) - 1)
                hit = np.flatnonzero(fixed[at] == h)
                self._verify(message, hit.tolist(), h[hit].tolist(), self.fixed, found, ends, limit)
        return found

    def _verify(self, message: str, positions: list[int], hashes: list[int], buckets: dict[int, list[int]],
                found: list[tuple[int, int, int]], ends: dict[int, int], limit: int) -> None:
        """Append verified occurrences to ``found``, at most ``limit`` in all. An occurrence
        of a text that starts inside the last one found of the same text is skipped (the
        two overlap: at most one could be chosen), so a repetitive message cannot make the
        candidates grow with its length times the bucket size."""
        for pos, value in zip(positions, hashes):
            for serial in buckets.get(value, ()):
                entry = self.entries[serial]
                start = pos - entry.offset
                if start < 0 or start < ends.get(serial, 0) or not message.startswith(entry.text, start):
                    continue
                found.append((start, start + len(entry.text), serial))
                ends[serial] = start + len(entry.text)
                if len(found) >= limit:
                    return


def candidate_limit(chars: int) -> int:
    """Verified occurrences kept per message: twice the most non-overlapping texts it can
    hold, plus a bucket's worth. Past it later occurrences are not matched (computed, never
    wrong)."""
    return 2 * (chars // MIN_CHARS) + MAX_BUCKET


class DocumentIndex:
    """Per-tenant character index of stored texts, bounded to ``max_bytes`` in all.

    ``add`` indexes texts (a text already there, with the same ids, only becomes the most
    recent); ``match`` finds them in messages; ``remove_document`` drops a document's
    texts. Thread-safe (one lock; a lookup holds it for one message's candidates)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
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

    def add(self, tenant: str, texts: Iterable[IndexedText]) -> int:
        """Index ``texts`` for ``tenant`` (shorter than ``MIN_CHARS`` or without ids: skipped);
        the number indexed. May evict the least recent texts to stay within ``max_bytes``."""
        prepared = [(t, _entry(t)) for t in texts if len(t.text) >= MIN_CHARS and t.token_ids]
        with self._lock:
            index = self._tenants.setdefault(tenant, _TenantIndex())
            for text, entry in prepared:
                self._add_locked(index, entry)
            self._evict_locked()
            if not index.entries:
                self._tenants.pop(tenant, None)
        return len(prepared)

    def _add_locked(self, index: _TenantIndex, entry: _Entry) -> None:
        serial = index.by_content.get((entry.text, entry.ids.tobytes()))
        if serial is not None:  # already indexed: refresh its recency and names
            old = index.remove(serial)
            self.nbytes -= old.nbytes
            if entry.document is None:  # seen inline again: it is still the stored document's text
                entry = entry._replace(document=old.document)
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
        with self._lock:
            index = self._tenants.get(tenant)
            if index is None:
                return 0
            gone = [s for s, e in index.entries.items() if e.document == document]
            for serial in gone:
                self.nbytes -= index.remove(serial).nbytes
            return len(gone)

    def match(self, tenant: str, messages: Sequence[str]) -> list[Match]:
        """The tenant's texts found in ``messages`` (by message index, then position): in
        each message the non-overlapping verified occurrences covering the most characters."""
        out: list[Match] = []
        with self._lock:
            index = self._tenants.get(tenant)
            if index is None:
                return out
            for m, text in enumerate(messages):
                for start, end, serial in best_spans(index.candidates(text)):
                    entry = index.entries[serial]
                    index.entries.move_to_end(serial)
                    out.append(Match(m, start, end, tuple(entry.ids), entry.chunk, entry.document))
        return out


def _entry(text: IndexedText) -> _Entry:
    offset, anchor, fixed = choose_anchor(text.text)
    ids = array("I", text.token_ids)
    nbytes = sys.getsizeof(text.text) + ids.itemsize * len(ids) + ENTRY_OVERHEAD
    return _Entry(text.text, ids, text.chunk, text.document, offset, anchor, fixed, nbytes)
