"""The loading controller (CacheBlend §5): the recompute ratio that hides loading, and
the cheapest tier whose loading still hides behind recompute.

With layer-pipelined loading, layer i+1's KV is read while layer i is recomputed, so a
request waits on loads only where one layer's load takes longer than one layer's
recompute. Per request, with a profile (``kvblend.pipeline.profile``):

    load   = Σ over documents on slow tiers of  latency(tier) + layer_bytes(tokens, kv_dtype) / bandwidth(tier)
    t(r)   = layer_s(forced + r × candidates, context)         # one layer at ratio r
    r_hide = the r with t(r) = load                            # recompute exactly fills the wait
    r      = min(r_max, max(r_min, r_hide))

Below r_hide the worker would idle while loading, so recomputing more costs no time and
only improves quality; ``r_min`` is the quality floor. The loader reads documents one
after another, hence the sum. Layer bytes depend on the storage dtype (int8 is a quarter
of fp32 plus a 4-byte scale per token and KV head).

Placement: a chunk of n tokens goes to the cheapest tier (cost per GB) whose layer load
hides behind recomputing ``r_min × n`` of its tokens over a context of n; when none does,
to the fastest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvblend.models.config import ModelConfig
from kvblend.pipeline.profile import Profile, TierSpeed, layer_bytes


class DocLoad(NamedTuple):
    """One cached document of a request: where it is loaded from and its size."""

    index: int
    tier: str
    tokens: int


class RatioChoice(NamedTuple):
    """The controller's decision for one request and what it was based on."""

    ratio: float
    r_min: float
    r_max: float
    r_hide: float  # ratio at which one layer's recompute takes as long as its loads (may be > 1)
    load_layer_s: float  # estimated seconds to load one layer of every cached document
    recompute_layer_s: float  # estimated seconds of one layer at the chosen ratio
    recompute_floor_s: float  # ... and at r_min
    forced_tokens: int
    candidate_tokens: int
    kv_dtype: str
    docs: tuple[DocLoad, ...]

    def to_dict(self) -> dict[str, object]:
        out = self._asdict()
        out["docs"] = [d._asdict() for d in self.docs]
        return out


def load_layer_s(profile: Profile, cfg: ModelConfig, docs: Sequence[DocLoad], kv_dtype: str) -> float:
    """Seconds for the loader to read one layer of every document (read one after another).
    A tier missing from the profile counts as immediate (no estimate: no reason to recompute more)."""
    immediate = TierSpeed(immediate=True)
    return sum(profile.tiers.get(d.tier, immediate).layer_s(layer_bytes(cfg, d.tokens, kv_dtype)) for d in docs)


def choose_ratio(profile: Profile, cfg: ModelConfig, docs: Sequence[DocLoad], forced: int, context: int,
                 kv_dtype: str, r_min: float, r_max: float) -> RatioChoice:
    """``r = min(r_max, max(r_min, r_hide))`` (see the module docstring). ``forced``: tokens
    computed at every layer (question, misses); ``context``: keys each active token sees."""
    if not 0.0 <= r_min <= r_max <= 1.0:
        raise ValueError(f"need 0 <= r_min <= r_max <= 1; got {r_min}, {r_max}")
    candidates = sum(d.tokens for d in docs)
    load = load_layer_s(profile, cfg, docs, kv_dtype)
    if candidates == 0:
        r_hide = 0.0
    else:
        r_hide = (profile.active_for(load, context) - forced) / candidates if load > 0 else 0.0
        r_hide = max(0.0, r_hide)
    ratio = min(r_max, max(r_min, r_hide))
    at = lambda r: profile.layer_s(forced + r * candidates, context)  # noqa: E731
    return RatioChoice(ratio, r_min, r_max, r_hide, load, at(ratio), at(r_min), forced, candidates, kv_dtype,
                       tuple(docs))


def choose_tier(profile: Profile, cfg: ModelConfig, tokens: int, kv_dtype: str, r_min: float,
                costs: Mapping[str, float], tiers: Sequence[str]) -> str | None:
    """The cheapest of ``tiers`` (by ``costs``, per GB) whose layer load of a ``tokens``-token
    chunk hides behind recomputing ``r_min`` of it; the fastest when none does; None when
    no tier has both a cost and a profile (then the caller writes everywhere)."""
    known = [t for t in tiers if t in costs and t in profile.tiers]
    if not known:
        return None
    nbytes = layer_bytes(cfg, tokens, kv_dtype)
    budget = profile.layer_s(r_min * tokens, tokens)
    load = {t: profile.tiers[t].layer_s(nbytes) for t in known}
    hiding = [t for t in known if load[t] <= budget]
    if hiding:
        return min(hiding, key=lambda t: (costs[t], load[t]))
    return min(known, key=lambda t: (load[t], costs[t]))

