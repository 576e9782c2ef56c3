"""A request with explicit documents, and what the engine reports back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvblend.blend.config import METHODS, BlendConfig
from kvblend.errors import InvalidRequestError
from kvblend.pipeline.controller import RatioChoice
from kvblend.pipeline.loader import LoadStats


@dataclass(frozen=True)
class Request:
    """``system`` (optional) + ``documents`` + a ``question`` or chat ``messages``.

    Documents are texts or token-id lists; each is tokenized alone and placed, in
    order, at the start of the last user turn. ``method`` is one of full, prefix,
    reuse, blend; ``blend`` holds the selective-recompute knobs.
    """

    documents: Sequence[str | Sequence[int]] = ()
    question: str | None = None
    messages: Sequence[dict[str, str]] | None = None
    system: str | None = None
    method: str = "blend"
    blend: BlendConfig = field(default_factory=BlendConfig)
    tenant: str = "default"
    use_chat_template: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if isinstance(self.documents, str):
            raise InvalidRequestError("documents must be a list of texts or token-id lists, not one string")
        object.__setattr__(self, "documents", tuple(
            d if isinstance(d, str) else tuple(d) for d in self.documents))
        if (self.question is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of question or messages")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))


class DocStat(NamedTuple):
    """One document: its length and whether its KV came from the store."""

    index: int
    tokens: int
    hit: bool
    source: str  # the tier that served it ("memory", "disk", "redis"), "computed" (a miss,
    # recomputed in full), "fallback" (found, but a layer failed to load: recomputed in
    # full), "skipped" (stored on a tier slower than recomputing it: computed, see the
    # controller), "request" (a repeat within this request) or "empty"


class RequestStats(NamedTuple):
    method: str
    prompt_tokens: int
    prefix_hit_tokens: int
    docs: list[DocStat]
    recomputed_per_layer: list[int]
    candidates: int  # document tokens whose cached KV was available for reuse
    lookup_s: float
    load_s: float
    prefill_s: float  # full prefill or fusion/recompute
    ttft_s: float  # request start -> first token sampled
    loading: LoadStats | None = None  # pipelined loading: worker waits per layer, fallbacks
    controller: RatioChoice | None = None  # ratio "auto": the ratio chosen and its inputs

    @property
    def recompute_frac(self) -> float:
        """Share of token-layer work done, over the context not covered by the prefix cache."""
        work = self.prompt_tokens - self.prefix_hit_tokens
        if not self.recomputed_per_layer or work <= 0:
            return 0.0
        return sum(self.recomputed_per_layer) / (work * len(self.recomputed_per_layer))

    def to_dict(self) -> dict[str, Any]:
        out = self._asdict()
        out["docs"] = [d._asdict() for d in self.docs]
        out["loading"] = None if self.loading is None else self.loading.to_dict()
        out["controller"] = None if self.controller is None else self.controller.to_dict()
        out["recompute_frac"] = self.recompute_frac
        return out


class Result(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}

