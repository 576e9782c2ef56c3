"""Is precomputing a chunk's KV worth it? Measured cost against the TTFT a hit saves.

A hit replaces the chunk's share of prefill by a load plus the blend's recompute: layer 0
runs every token and the other layers ``ratio`` of them, so a hit still costs
``(1 + ratio * (L - 1)) / L`` of the prefill. The saving per hit is the rest, less the
load time; precompute pays for itself after ``ceil(cost / saving)`` hits.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple


class Economics(NamedTuple):
    chunk_tokens: float
    prefill_s: float  # computing one chunk's KV (measured)
    load_s: float  # reading it back from the slowest enabled tier (measured)
    recompute_share: float
    saved_s: float  # TTFT saved by one hit
    break_even_hits: int | None  # None: a hit saves nothing on this setup

    def describe(self) -> str:
        head = (f"economics: computing a chunk's KV took {self.prefill_s * 1e3:.0f} ms "
                f"({self.chunk_tokens:.0f} tokens, measured); a hit loads it in {self.load_s * 1e3:.0f} ms and "
                f"recomputes {self.recompute_share:.0%}, saving ~{self.saved_s * 1e3:.0f} ms of TTFT")
        if self.break_even_hits is None:
            return head + "; on this setup a hit saves nothing: precompute does not pay"
        return head + f"; precompute pays for itself after {self.break_even_hits} hit(s)"


def recompute_share(ratio: float, layers: int) -> float:
    """Share of a chunk's token-layer work a blend hit still does (layer 0 in full)."""
    return (1 + ratio * (layers - 1)) / layers


def estimate(prefill_s: float, load_s: float, tokens: float, ratio: float, layers: int) -> Economics:
    share = recompute_share(ratio, layers)
    saved = prefill_s * (1 - share) - load_s
    hits = math.ceil(prefill_s / saved) if saved > 0 else None
    return Economics(tokens, prefill_s, load_s, share, saved, hits)


def measure_load(store, key, token_ids) -> float:
    """Seconds to read one chunk from the last (slowest) tier that holds it."""
    for tier in reversed(getattr(store, "tiers", [store])):
        if tier.contains(key):
            t = time.perf_counter()
            tier.get(key, token_ids)
            return time.perf_counter() - t
    return 0.0
