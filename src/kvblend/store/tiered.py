"""Tiers composed into one store: lookups go memory → disk → remote, hits are promoted."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from kvblend.store import codec
from kvblend.store.base import ChunkStore, Counters, EntryInfo, StoreStats, merge_stats
from kvblend.store.chunk import ChunkKV
from kvblend.store.entry import decode_entry, encode_chunk
from kvblend.store.keys import ChunkKey
from kvblend.store.layers import LayeredChunk
from kvblend.store.policy import SightingsAdmission
from kvblend.store.tier import Tier


class Lookup(NamedTuple):
    """Result of :meth:`TieredStore.lookup`: the chunk (None on a miss) and the tier that
    served it (None on a miss), for per-request reporting."""

    chunk: ChunkKV | None
    tier: str | None


class Located(NamedTuple):
    """Result of :meth:`TieredStore.locate`: a whole chunk lent by an immediate tier, or a
    handle that reads a slower tier's entry layer by layer, or neither (a miss)."""

    chunk: ChunkKV | None
    layered: LayeredChunk | None
    tier: str | None


class TieredStore(ChunkStore):
    """Tiers in lookup order, fastest first. Implements the ChunkStore contract.

    - ``get``/``lookup``: the first tier with a verified entry serves it; the entry is then
      written to every faster tier (promotion, no re-encoding). Corrupt entries are
      removed by the tier that found them and the lookup continues below it.
    - ``get_layer``: the first tier that has the layer; no promotion (a per-layer read
      should stay cheap).
    - ``sighting``: a miss seen by a caller that would compute the chunk; True when the
      chunk is admitted (``admit_after`` sightings), so KV is computed only then.
    - ``put``: admission first (uses up an admission granted by ``sighting``, else counts
      as a sighting); the chunk is encoded once and written through to every tier (or to
      the ``tiers`` named: placement); True when at least one tier stored it.
    - ``delete``/``evict``/``clear``: applied to every tier.
    - ``stats``: hits/misses/puts/rejected counted here, the rest summed over tiers
      (an entry held by two tiers counts twice in entries/bytes); ``tier_stats`` per tier.
    """

    def __init__(self, tiers: Sequence[Tier], *, kv_dtype: str = "fp32", compute_dtype: str = "fp32",
                 admission: SightingsAdmission | None = None, writeback_queue: int = 64,
                 costs: dict[str, float] | None = None) -> None:
        """``costs``: price per GB of each tier, for placement (``kvblend.pipeline.controller``);
        with costs, a chunk read layer by layer from a slow tier is not promoted (placement
        chose where it lives)."""
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique; got {names}")
        if writeback_queue < 1:
            raise ValueError("writeback_queue must be >= 1")
        self.tiers = tuple(tiers)
        self.kv_dtype = kv_dtype
        self.compute_dtype = codec.compute_dtype(compute_dtype)
        self.admission = admission or SightingsAdmission(1)
        self.writeback_queue = writeback_queue  # bound for a WriteBack over this store (StoreConfig)
        self.counters = Counters()
        self.costs = dict(costs or {})

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def lookup(self, key: ChunkKey, token_ids: Sequence[int] | None = None, *, borrow: bool = False) -> Lookup:
        """Like ``get`` but also says which tier served the chunk.

        ``borrow=True`` is for callers that only read the chunk's tensors (fusion copies
        them into the prompt's cache): a tier's own tensors already in the compute dtype
        are then lent instead of copied (the memory tier saves a full copy, ~141 MB for
        six 512-token SmolLM2 chunks). The caller must never write to them. An entry
        evicted meanwhile stays in memory, outside the tier's byte count, until the caller
        drops it."""
        for depth, tier in enumerate(self.tiers):
            entry = tier.load(key, token_ids)
            if entry is None:
                continue
            if any([faster.store(entry) for faster in self.tiers[:depth]]):  # every faster tier tries
                entry = entry.shared()  # a faster tier keeps these tensors now
            self.counters.add(key.tenant, "hits")
            return Lookup(decode_entry(entry, self.compute_dtype, borrow), tier.name)
        self.counters.add(key.tenant, "misses")
        return Lookup(None, None)

    def locate(self, key: ChunkKey, token_ids: Sequence[int], base_position: int, n_layers: int) -> Located:
        """Find the chunk without reading a slow tier: an immediate tier (memory) that holds
        it lends it whole (borrowed, as ``lookup(borrow=True)``); otherwise the first tier
        whose ``contains`` says yes gives a :class:`LayeredChunk` that verifies each layer as
        it is read and, once complete, promotes the entry to the faster tiers. Counted as a
        hit when found (a layer that later fails is counted by its tier)."""
        for depth, tier in enumerate(self.tiers):
            if tier.immediate:
                entry = tier.load(key, token_ids)
                if entry is None:
                    continue
                self.counters.add(key.tenant, "hits")
                return Located(decode_entry(entry, self.compute_dtype, True), None, tier.name)
            if tier.contains(key):
                self.counters.add(key.tenant, "hits")
                faster = self.tiers[:depth]
                promote = (lambda entry: [t.store(entry) for t in faster]) if faster and not self.costs else None
                return Located(None, LayeredChunk(tier, key, token_ids, base_position, n_layers,
                                                  self.compute_dtype, promote), tier.name)
        self.counters.add(key.tenant, "misses")
        return Located(None, None, None)

    def contains(self, key: ChunkKey) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def get(self, key: ChunkKey, token_ids: Sequence[int] | None = None) -> ChunkKV | None:
        return self.lookup(key, token_ids).chunk

    def get_layer(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        for tier in self.tiers:
            kv = tier.get_layer(key, layer)
            if kv is not None:
                self.counters.add(key.tenant, "layer_hits")
                return kv[0].to(self.compute_dtype), kv[1].to(self.compute_dtype)
        self.counters.add(key.tenant, "layer_misses")
        return None

    def sighting(self, key: ChunkKey) -> bool:
        if self.admission.sight(key):
            return True
        self.counters.add(key.tenant, "rejected")
        return False

    def put(self, key: ChunkKey, chunk: ChunkKV, tiers: Sequence[str] | None = None) -> bool:
        if not self.admission.admit(key):
            self.counters.add(key.tenant, "rejected")
            return False
        entry = encode_chunk(key, chunk, self.kv_dtype)
        stored = [tier.store(entry) for tier in self.tiers if tiers is None or tier.name in tiers]
        self.counters.add(key.tenant, "puts" if any(stored) else "rejected")
        return any(stored)

    def delete(self, key: ChunkKey) -> bool:
        return any([tier.delete(key) for tier in self.tiers])

    def keys(self, tenant: str) -> list[ChunkKey]:
        return list(dict.fromkeys(k for tier in self.tiers for k in tier.keys(tenant)))

    def entries(self, tenant: str) -> dict[str, list[EntryInfo]]:
        """``tenant``'s entries per tier name."""
        return {tier.name: tier.entries(tenant) for tier in self.tiers}

    def evict(self, tenant: str, target_bytes: int = 0) -> int:
        return sum(tier.evict(tenant, target_bytes) for tier in self.tiers)

    def clear(self, tenant: str) -> int:
        return len([k for k in self.keys(tenant) if self.delete(k)])

    def tier_stats(self, tenant: str | None = None) -> dict[str, StoreStats]:
        return {tier.name: tier.stats(tenant) for tier in self.tiers}

    def stats(self, tenant: str | None = None) -> StoreStats:
        summed = merge_stats(self.tier_stats(tenant).values())
        own = self.counters.stats(tenant, summed.entries, summed.bytes)
        return own._replace(evictions=summed.evictions, errors=summed.errors, warnings=summed.warnings)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
