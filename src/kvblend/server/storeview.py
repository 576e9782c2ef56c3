"""``GET /v1/kvblend/store``: what the chunk store holds for the caller, beside the shared caps.

The caller's own numbers only (documents, entries, bytes, hits and misses per tier, from
the store's per-tenant counters); of the other tenants only the shared occupancy of each
tier (total entries and bytes against its cap), never an id, key or count of theirs.
"""

from __future__ import annotations

from typing import Any

from kvblend.engine import Engine
from kvblend.server.documents import DocumentRegistry
from kvblend.settings import Settings
from kvblend.store.base import StoreStats

def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 6) if hits + misses else None


def _own(stats: StoreStats) -> dict[str, Any]:
    return {"entries": stats.entries, "bytes": stats.bytes, "hits": stats.hits, "misses": stats.misses,
            "layer_hits": stats.layer_hits, "layer_misses": stats.layer_misses, "evictions": stats.evictions,
            "hit_rate": _rate(stats.hits, stats.misses)}


def _tier(tier: Any, tenant: str) -> dict[str, Any]:
    shared = tier.stats(None)
    return {"name": tier.name, "capacity_bytes": getattr(tier, "capacity_bytes", None),
            "used_bytes": shared.bytes, "used_entries": shared.entries, "tenant": _own(tier.stats(tenant))}


def documents_summary(registry: DocumentRegistry, tenant: str) -> dict[str, Any]:
    """The tenant's stored documents: how many, and their tokens and chunks, exact for any
    number of documents (the registry keeps the totals). ``summed_over`` (the documents
    the sums cover, once the first 1000 only) is the count. A registry read: run on the
    registry's threads."""
    count, tokens, chunks = registry.totals(tenant)
    return {"count": count, "tokens": tokens, "chunks": chunks, "summed_over": count}


def store_summary(engine: Engine, settings: Settings, tenant: str, documents: dict[str, Any]) -> dict[str, Any]:
    """The body of ``GET /v1/kvblend/store`` for ``tenant``, with its ``documents_summary``
    (reads every tier: run off the loop)."""
    store = engine.store
    tiers = [_tier(t, tenant) for t in getattr(store, "tiers", ())]
    return {"object": "kvblend.store", "documents": documents, "tiers": tiers,
            "lookups": _own(store.stats(tenant)), "tenant_bytes_cap": settings.store.tenant_bytes}
