"""A selection token by token, per document: what ``Request(explain=True)`` adds to the
stats (``CheckStat.tokens``), read from the tensors the selection kept (``SelectionDetail``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from kvblend.blend.select import SelectionDetail
from kvblend.engine.request import DocSelection


class _Host:
    """A detail's tensors as Python lists (one device read each)."""

    def __init__(self, detail: SelectionDetail) -> None:
        self.positions: list[int] = detail.positions.tolist()
        self.scores: list[float] = detail.scores.float().tolist()
        self.chosen = set(detail.chosen.tolist())
        self.measured: list[int] = detail.measured.tolist()
        self.deviation: list[float] = detail.deviation.float().tolist()
        forced = detail.forced
        self.forced = set() if forced is None else set(forced.nonzero().squeeze(1).tolist())


def _in_span(host: _Host, start: int, end: int) -> DocSelection:
    """The candidates at prompt positions [start, end), as offsets from ``start``."""
    lo, hi = bisect_left(host.positions, start), bisect_left(host.positions, end)
    kept, kept_scores, reused, reused_scores = [], [], [], []
    for i in range(lo, hi):
        offsets, scores = (kept, kept_scores) if i in host.chosen else (reused, reused_scores)
        offsets.append(host.positions[i] - start)
        scores.append(host.scores[i])
    pairs = [(p - start, d) for p, d in zip(host.measured, host.deviation) if start <= p < end]
    forced = [o for o in kept if o + start in host.forced]
    return DocSelection(kept, kept_scores, reused, reused_scores, [p for p, _ in pairs], [d for _, d in pairs], forced)


def doc_selections(detail: SelectionDetail, spans: Sequence[tuple[int, int]], docs: Sequence[int],
                   n_docs: int) -> tuple[DocSelection | None, ...]:
    """Per request document, the selection over its placed span (None for a document that
    was not reused). ``spans``: the placed chunks' [start, end); ``docs``: the document of each."""
    host = _Host(detail)
    out: list[DocSelection | None] = [None] * n_docs
    for (start, end), doc in zip(spans, docs):
        out[doc] = _in_span(host, start, end)
    return tuple(out)
