"""OpenAI ``usage`` and kvblend's per-request accounting block, from ``RequestStats``."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvblend.engine.request import DocStat, RequestStats

_NOT_REUSED = ("computed", "empty")
_MISSED = ("computed", "chunk")  # no tier held it: computed in the prompt, or alone and blended


def reused_docs(stats: RequestStats) -> list[DocStat]:
    """The documents whose chunk KV came from the store (or from an earlier copy in the same request)."""
    return [d for d in stats.docs if d.hit and d.source not in _NOT_REUSED]


def cached_tokens(stats: RequestStats) -> int:
    """Prompt tokens whose KV was reused: the exact prefix hit plus every reused document."""
    return stats.prefix_hit_tokens + sum(d.tokens for d in reused_docs(stats))


def usage(stats: RequestStats | None, completion_tokens: int) -> dict[str, Any]:
    prompt = stats.prompt_tokens if stats is not None else 0
    cached = cached_tokens(stats) if stats is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def kvblend_block(stats: RequestStats | None, queue_s: float) -> dict[str, Any]:
    """Method, document hits by tier, recompute fraction, the blend's risk (when it measured
    one: ``RequestStats.risk``, its estimate of how much of reuse's error it left, and whether
    it escalated: recomputed again at twice its ratio, ``RequestStats.escalated``) and the time
    breakdown; ``choices``: how many choices decoded from the request's one prefill."""
    if stats is None:
        return {"queue_s": round(queue_s, 6)}
    hits = Counter(d.source for d in reused_docs(stats))
    return {
        "method": stats.method,
        **({"strategy": stats.strategy} if stats.strategy else {}),
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "documents": [{"index": d.index, "tokens": d.tokens, "source": d.source} for d in stats.docs],
        "doc_hits": dict(hits),
        "doc_misses": sum(1 for d in stats.docs if d.source in _MISSED),
        "recompute_fraction": round(stats.recompute_frac, 6),
        "choices": stats.choices,
        **({"risk": round(stats.risk, 6), "escalated": bool(getattr(stats, "escalated", False))}
           if getattr(stats, "risk", None) is not None else {}),
        "queue_s": round(queue_s, 6),
        "lookup_s": round(stats.lookup_s, 6),
        "load_s": round(stats.load_s, 6),
        "prefill_s": round(stats.prefill_s, 6),
        "ttft_s": round(stats.ttft_s, 6),
    }
