"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seed).

Sampling is numerically safe for every finite logit vector at every allowed temperature:
temperatures below ``MIN_TEMPERATURE`` sample greedily (dividing by less overflows, and
the distribution is already the argmax's for any logit gap above ~1e-3), and the rest is
computed in float64 on logits shifted so that the largest is 0, so ``exp`` never
overflows and no probability is NaN. Logits that are not finite raise
``NonFiniteLogitsError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvblend.errors import InvalidRequestError, NonFiniteLogitsError

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy
MAX_TOKENS_LIMIT = 1 << 20  # no model context comes near; larger values are client errors
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature`` below ``MIN_TEMPERATURE`` (0 included) means greedy."""

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
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # what a torch generator takes
            raise InvalidRequestError(f"seed must be a signed 64-bit integer, got {self.seed}", "seed")
        object.__setattr__(self, "stop", tuple(self.stop))
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS
                                                    for s in self.stop):
            raise InvalidRequestError(
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


class Sampler:
    """Picks the next token from (V,) logits; owns the request's random generator and
    counts the tokens drawn (``drawn``), so that an error can say which one failed."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.drawn = 0
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id; ``NonFiniteLogitsError`` if any logit is NaN or ±inf."""
        self.drawn += 1
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError(
                f"the model produced non-finite logits (NaN or inf) at generated token {self.drawn}")
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        probs = filtered_probs(scaled_logits(logits, p.temperature), p.top_k, p.top_p)  # (V,)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Finite (V,) logits divided by ``temperature`` (>= ``MIN_TEMPERATURE``), in float64
    on the CPU and shifted so that the largest is exactly 0. Every value lies in
    [-inf, 0] (float32/16 logits stay finite, above -1e44), so a softmax over them has
    no NaN and puts mass on the largest."""
    x = logits.detach().to("cpu", torch.float64)  # (V,)
    return (x - x.max()) / temperature  # (V,)


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
