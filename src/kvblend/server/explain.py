"""``"kvblend": {"explain": true}``: the response's ``kvblend.explain`` shows which tokens of
each document the blend recomputed, and why.

Per prompt document (a document, or one chunk of a long or stored one: ``origin`` is its
index in the request's ``documents``, ``offset`` its first token there): the token texts,
the tokens chosen for recompute (positions within the prompt document, their selection
scores, what chose each: a check layer, the question pass, a sink or the shift's sample),
the candidates left reused with their scores, and the deviation where a layer measured it.
Bounded by ``limits.explain_document_tokens`` per document and ``limits.explain_total_tokens``
in all (a document cut short says ``truncated``); it is built from the requester's own
request only, returned to the requester only, and never logged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvblend.blend.config import BlendConfig
from kvblend.engine import CheckStat, Request, RequestStats
from kvblend.engine.request import DocSelection
from kvblend.generation.text import REPLACEMENT
from kvblend.settings import LimitSettings


class Explainer(NamedTuple):
    """What the explain block needs besides the stats: the prompt documents' token ids and
    which given document each came from."""

    tokenizer: Any
    documents: tuple[tuple[int, ...], ...]
    origins: tuple[tuple[int, int], ...]  # (document given, token offset in it) per prompt document
    blend: BlendConfig
    limits: LimitSettings

    def block(self, stats: RequestStats) -> dict[str, Any]:
        return explain_block(self, stats)


def origins_of(first: Sequence[int], then: Sequence[int],
               documents: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """(given document, token offset) of each prompt document, from the two expansions' counts
    (documents given -> pieces, then ``ShapedRequest.pieces``); each its own when they disagree."""
    owner = [i for i, n in enumerate(first) for _ in range(n)]
    if len(owner) != len(then) or sum(then) != len(documents):
        return tuple((i, 0) for i in range(len(documents)))
    flat = [owner[j] for j, n in enumerate(then) for _ in range(n)]
    out, offset = [], {}
    for doc, ids in zip(flat, documents):
        out.append((doc, offset.get(doc, 0)))
        offset[doc] = offset.get(doc, 0) + len(ids)
    return tuple(out)


def token_texts(tokenizer: Any, ids: Sequence[int], before: Sequence[int] = (), context: int = 3) -> list[str]:
    """Each token's text, such that they join into the document's text: the text a token adds
    after up to ``context`` tokens before it (``before``: the ids that precede ``ids`` in the
    document, e.g. the previous chunk's). Two short decodes per token; a token that ends
    inside a multi-byte character shows empty and the next one carries the character."""
    lead = list(before[len(before) - context :]) if context else []
    ids = lead + list(ids)
    texts, done = [], len(lead)  # ids[:done] are shown
    for i in range(len(lead), len(ids)):
        start = max(0, min(i - context, done))
        shown = tokenizer.decode(ids[start:done], skip_special_tokens=False)
        text = tokenizer.decode(ids[start : i + 1], skip_special_tokens=False)
        if text.endswith(REPLACEMENT) and i + 1 < len(ids):
            texts.append("")
            continue
        texts.append(text[len(shown):] if text.startswith(shown) else text)
        done = i + 1
    return texts


def _number(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def score_name(blend: BlendConfig, check: CheckStat) -> str:
    if blend.selection == "question":
        return "question attention + V-deviation rank" if blend.vdev else "question attention"
    return f"{blend.signal.upper()} deviation at layer {check.layer}"


def _deviation_name(blend: BlendConfig, check: CheckStat) -> str:
    """What ``deviation`` measured: a deviation selection's own score, else the V deviation
    of the recomputed tokens at the probe's layer (``strategies.DeviationProbe``)."""
    return score_name(blend, check) if blend.selection == "deviation" else f"V deviation at layer {check.layer}"


def _reasons(sel: DocSelection, blend: BlendConfig, checks: Sequence[CheckStat], doc: int) -> list[str]:
    """What chose each kept token of ``sel`` (the first check's)."""
    forced = set(sel.forced)
    later = [(c.layer, set(c.tokens[doc].kept)) for c in checks[1:] if c.tokens and c.tokens[doc] is not None]
    base = "question pass" if blend.selection == "question" else f"layer {checks[0].layer}"
    out = []
    for offset in sel.kept:
        dropped = next((layer for layer, kept in later if offset not in kept), None)
        why = "sink" if offset < blend.sinks else "shift sample" if offset in forced else base
        out.append(why if dropped is None else f"{why} (dropped at layer {dropped})")
    return out


def _columns(offsets: Sequence[int], values: Sequence[float], shown: int, **more: Sequence[Any]) -> dict[str, list]:
    keep = [i for i, o in enumerate(offsets) if o < shown]
    out = {"positions": [offsets[i] for i in keep], "scores": [_number(values[i]) for i in keep]}
    out.update({name: [col[i] for i in keep] for name, col in more.items()})
    return out


def _document(ex: Explainer, stats: RequestStats, j: int, budget: int) -> dict[str, Any]:
    ids = ex.documents[j]
    shown = min(len(ids), ex.limits.explain_document_tokens, budget)
    origin, offset = ex.origins[j]
    before = ex.documents[j - 1] if j and ex.origins[j - 1][0] == origin else ()  # the same document's last chunk
    doc = {"index": j, "origin": origin, "offset": offset, "n_tokens": len(ids), "source": stats.docs[j].source,
           "tokens": token_texts(ex.tokenizer, ids[:shown], before), "truncated": shown < len(ids)}
    sel = stats.checks[0].tokens[j] if stats.checks and stats.checks[0].tokens else None
    if sel is None:
        return doc
    why = _reasons(sel, ex.blend, stats.checks, j)
    doc["kept"] = len(sel.kept)
    doc["selected"] = _columns(sel.kept, sel.kept_scores, shown, by=why)
    doc["reused"] = _columns(sel.reused, sel.reused_scores, shown)
    measured = _columns(sel.measured, sel.deviation, shown)
    doc["deviation"] = {"positions": measured["positions"], "values": measured["scores"]}
    return doc


def explain_block(ex: Explainer, stats: RequestStats) -> dict[str, Any]:
    """The ``kvblend.explain`` object of one response (see the module docstring)."""
    checks = stats.checks
    budget, documents = ex.limits.explain_total_tokens, []
    for j in range(len(ex.documents)):
        documents.append(_document(ex, stats, j, budget))
        budget -= len(documents[-1]["tokens"])
    block: dict[str, Any] = {
        "selection": ex.blend.selection if checks else None,
        "score": score_name(ex.blend, checks[0]) if checks else None,
        "deviation": _deviation_name(ex.blend, checks[0]) if checks else None,
        "sinks": ex.blend.sinks,
        "checks": [{"layer": c.layer, "candidates": c.candidates, "selected": c.selected,
                    "doc_selected": c.doc_selected, "doc_share": [round(x, 6) for x in c.doc_share]}
                   for c in checks],
        "documents": documents,
        "limits": {"document_tokens": ex.limits.explain_document_tokens,
                   "total_tokens": ex.limits.explain_total_tokens},
        "truncated": any(d["truncated"] for d in documents),
    }
    return block


def explainer(request: Request, tokenizer: Any, first: Sequence[int], then: Sequence[int],
              limits: LimitSettings) -> Explainer:
    """The explainer of a request that asked for one (its documents are token ids by now)."""
    docs = tuple(() if isinstance(d, str) else tuple(d) for d in request.documents)  # a text left has no tokens
    return Explainer(tokenizer, docs, origins_of(first, then, docs), request.blend, limits)
