"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvblend.errors import InvalidRequestError

MAX_TOKENS_LIMIT = 1 << 20  # no model context comes near; larger values are client errors
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidRequestError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS
                                                    for s in self.stop):
            raise InvalidRequestError(
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks the next token from (V,) logits; owns the request's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        probs = filtered_probs(logits.float().cpu() / p.temperature, p.top_k, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of (V,) logits restricted to the top-k tokens, then the top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before this token already >= p
        sorted_p[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs / probs.sum()
