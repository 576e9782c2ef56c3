"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seed,
``logit_bias``, presence/frequency/repetition penalties) and the logprobs of a token.

The logits a token is drawn from are adjusted in vLLM's order: ``logit_bias`` added
(OpenAI: token id -> bias in [-100, 100]), then the repetition penalty (vLLM's, after
CTRL: a positive logit of a token seen in the prompt or the output divided by it, a
negative one multiplied), then ``logit -= frequency_penalty * count + presence_penalty *
(count > 0)`` over the output's counts (OpenAI's), then temperature and top-k/top-p.
Logprobs (``token_logprobs``) are by default of the distribution the token was drawn from:
the logits after the response format's mask, ``logit_bias`` and the penalties (vLLM's
``processed_logprobs``), before temperature and top-k/top-p (which a greedy request has
no distribution for). A token the mask forbids has logprob -inf and is never listed among
the top alternatives. ``logprobs_mode="raw"`` reports the model's raw distribution
instead (vLLM's default ``raw_logprobs``: what the model thought, whatever the request did
to the draw).

Sampling is numerically safe for every finite logit vector at every allowed temperature:
temperatures below ``MIN_TEMPERATURE`` sample greedily (dividing by less overflows, and
the distribution is already the argmax's for any logit gap above ~1e-3), and the rest is
computed in float64 on logits shifted so that the largest is 0, so ``exp`` never
overflows and no probability is NaN. Logits that are not finite raise
``NonFiniteLogitsError``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvblend.errors import InvalidRequestError, NonFiniteLogitsError
from kvblend.generation.grammar import ResponseFormat

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy
MAX_TOKENS_LIMIT = 1 << 20  # no model context comes near; larger values are client errors
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_CHOICES = 16  # n: each choice decodes in its own row of the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI: a bias is in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGPROBS_MODES = ("processed", "raw")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature`` below ``MIN_TEMPERATURE`` (0 included) means greedy.

    ``n``: choices decoded from one prompt (a scheduler forks the decode after one
    prefill; choice i's sampler is seeded with ``seed + i``). ``logprobs``: how many top
    alternatives each token's ``TokenLogprobs`` lists (0 to ``MAX_TOP_LOGPROBS``; None:
    no logprobs); ``logprobs_mode``: of the logits the draw used ("processed": after the
    mask, bias and penalties) or of the raw ones ("raw"; the module docstring).
    ``logit_bias``: (token id, bias) pairs, ids checked against the vocabulary by whoever
    knows it (the server)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    logprobs_mode: str = "processed"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: ResponseFormat | None = None  # structured output: a grammar masks each step (grammar.py)

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
        self._check_choices()
        self._check_adjustments()
        object.__setattr__(self, "stop", tuple(self.stop))
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS
                                                    for s in self.stop):
            raise InvalidRequestError(
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")

    def _check_choices(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}", "n")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}", "top_logprobs")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                                      f"got {self.logprobs_mode!r}", "logprobs_mode")

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}", name)
        rp = self.repetition_penalty
        if not (isinstance(rp, (int, float)) and math.isfinite(rp) and rp > 0):
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {rp!r}",
                                      "repetition_penalty")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"logit_bias has at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
        for token, value in bias:
            if token < 0 or not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias maps token ids >= 0 to biases in [-100, 100]; got {token}: {value}", "logit_bias")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before the draw (bias or a penalty)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


class TokenLogprobs(NamedTuple):
    """A drawn token's logprob and the ``top`` alternatives' (id, logprob), best first,
    of one distribution (processed or raw: the module docstring)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-softmax under the (V,) ``logits`` (float64 on the CPU), and the
    ``top`` most likely tokens' (0: none); tokens at -inf (masked) are never listed."""
    lp = torch.log_softmax(logits.detach().reshape(-1).to("cpu", torch.float64), dim=-1)  # (V,)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[0]))
        best = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf"))
    return TokenLogprobs(token, float(lp[token]), best)


class Sampler:
    """Picks the next token from (V,) logits; owns one choice's random generator (seeded
    with ``seed + choice``), counts the tokens drawn (``drawn``, so that an error can say
    which one failed) and, for the penalties, how often each was drawn (``counts``);
    ``prompt_ids`` are what the repetition penalty counts as seen besides the output.
    ``used``: the (V,) logits the last draw used (after the mask, bias and penalties,
    before temperature and top-k/p): what processed logprobs are of."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), choice: int = 0) -> None:
        self.params = params
        self.drawn = 0
        self.counts: Counter[int] = Counter()
        self.prompt_ids = frozenset(prompt_ids) if params.repetition_penalty != 1 else frozenset()
        self._used: torch.Tensor | None = None
        self._unmasked: torch.Tensor | None = None  # a mask ``used`` has yet to apply (a greedy shortcut)
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed + choice)
        else:
            self.generator.seed()

    @property
    def used(self) -> torch.Tensor | None:
        if self._unmasked is not None and self._used is not None:
            self._used = self._used.masked_fill(~self._unmasked.to(self._used.device), float("-inf"))
            self._unmasked = None
        return self._used

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """The next token id; ``NonFiniteLogitsError`` if any logit is NaN or ±inf.
        ``allowed``: (V,) bool, the only tokens that may be drawn (a grammar's mask,
        applied before the bias and penalties, as vLLM does)."""
        self.drawn += 1
        if not math.isfinite(float(logits.sum(dtype=torch.float64))) and not bool(torch.isfinite(logits).all()):
            # a NaN or ±inf makes the sum so (one float64 sum over the vocabulary is cheap); only
            # float64 logits near its limit sum to inf while finite, hence the full check after
            raise NonFiniteLogitsError(
                f"the model produced non-finite logits (NaN or inf) at generated token {self.drawn}")
        p = self.params
        self._unmasked = None
        if allowed is not None and p.greedy and not p.adjusts:
            token = argmax(logits)  # the masked argmax too when the mask allows it (ties: the first index either way)
            if bool(allowed[token]):
                self._used, self._unmasked = logits, allowed  # masked only if logprobs ask (~80 µs a token)
                self.counts[token] += 1
                return token
        if allowed is not None:
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))  # (V,)
        if p.adjusts:
            logits = adjusted_logits(logits, p, self.prompt_ids, self.counts)  # (V,) float64
        self._used = logits
        if p.greedy:
            token = argmax(logits)
        else:
            ids, weights = candidates(scaled_logits(logits, p.temperature), p.top_k, p.top_p)
            token = draw(ids, weights, self.generator)
        self.counts[token] += 1
        return token


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: frozenset[int],
                    counts: Counter[int]) -> torch.Tensor:
    """(V,) logits in float64 on the CPU with ``logit_bias``, the repetition penalty (over
    ``prompt_ids`` and the output's tokens) and the presence/frequency penalties (over the
    output's ``counts``) applied, in that order (the module docstring). Bias ids past the
    vocabulary are the caller's error (an IndexError here)."""
    x = logits.detach().reshape(-1).to("cpu", torch.float64).clone()  # (V,)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        x.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64))
    if params.repetition_penalty != 1 and (prompt_ids or counts):
        seen = torch.tensor(sorted(prompt_ids | counts.keys()), dtype=torch.long)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if counts and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(list(counts.keys()), dtype=torch.long)
        c = torch.tensor(list(counts.values()), dtype=torch.float64)
        x[ids] -= params.frequency_penalty * c + params.presence_penalty
    return x


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Finite (V,) logits divided by ``temperature`` (>= ``MIN_TEMPERATURE``), in float64
    on the CPU and shifted so that the largest is exactly 0. Every value lies in
    [-inf, 0] (float32/16 logits stay finite, above -1e44), so a softmax over them has
    no NaN and puts mass on the largest."""
    x = logits.detach().to("cpu", torch.float64, copy=True)  # (V,)
    x.sub_(x.max())
    return x if temperature == 1.0 else x.div_(temperature)


def argmax(logits: torch.Tensor) -> int:
    """The first index of the (V,) logits' largest value (torch's and numpy's rule); in
    numpy for float CPU logits, where torch's reduction took ~20× longer."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())


def candidates(logits: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a draw from the (V,) ``scaled_logits`` may pick after top-k, then top-p:
    their ids (None: all V, in order) and unnormalized probabilities (float64 ``exp`` of
    the logits, the largest 1). Top-k keeps every token tied with the k-th; top-p keeps
    the smallest set of most likely tokens whose mass reaches p (a token is kept while
    the mass before it is below p)."""
    ids = None
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        ids = (logits >= kth).nonzero().squeeze(1)  # (k',) ascending
        logits = logits[ids]
    weights = logits.exp()
    if top_p < 1.0:
        kept = nucleus(weights, top_p * float(weights.sum()))
        weights = weights[kept]
        ids = kept if ids is None else ids[kept]
    return ids, weights


def nucleus(weights: torch.Tensor, mass: float) -> torch.Tensor:
    """Indices, heaviest first, of the fewest heaviest (n,) CPU ``weights`` whose sum
    reaches ``mass`` (each kept while the sum before it is below ``mass``). Looks among
    the heaviest 64, then 4,096, 262,144, ... and then all: a selection is O(n) where a sort of a 49k
    vocabulary took 0.5 ms (numpy) to 2.6 ms (torch), and nuclei of p = 0.95 held a few
    hundred to a few thousand tokens."""
    w = weights.numpy()
    n, k = w.shape[0], 64
    while True:
        if k < n:
            top = np.argpartition(w, n - k)[n - k:]  # the k heaviest, in no order
            order = top[np.argsort(-w[top])]
        else:
            order = np.argsort(-w)
        values = w[order]
        before = np.cumsum(values) - values  # the weight ahead of each
        if k >= n or before[-1] + values[-1] >= mass:  # every token past the k-th is outside
            return torch.from_numpy(order[: max(1, int(np.count_nonzero(before < mass)))])
        k *= 64


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of finite (V,) logits restricted to the top-k tokens, then the top-p
    nucleus, as a dense (V,) vector of the logits' dtype (``candidates``' normalized, zero
    elsewhere): the distribution a ``Sampler`` at temperature 1 draws from."""
    ids, weights = candidates(scaled_logits(logits, 1.0), top_k, top_p)
    probs = weights / weights.sum()
    if ids is not None:
        probs = torch.zeros(logits.shape[-1], dtype=probs.dtype).index_copy_(0, ids, probs)
    return probs.to(logits.dtype)


def draw(ids: torch.Tensor | None, weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``candidates``' output, with probability proportional to its weight,
    by inverse CDF on one uniform from ``generator`` (``torch.multinomial`` took ~1 ms a
    token on a 49k vocabulary). A token of weight 0 is never drawn."""
    cdf = weights.cumsum(0)  # (n,)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    i = int(torch.searchsorted(cdf, torch.tensor(u * float(cdf[-1]), dtype=cdf.dtype), right=True))
    if i >= weights.shape[0]:  # u * total rounded up to the total: the last token that has weight
        i = int(weights.nonzero()[-1])
    return i if ids is None else int(ids[i])
