"""Shadow checks: judge a blended answer against full prefill, after it was served.

``shadow_check(engine, request, served)`` takes a request that was answered by a
blended method (``reuse``/``blend``) and the served ``Result``, and measures how far
blending moved the model from full prefill on that very request:

* ``answer_f1``: token F1 (SQuAD) between the served answer and full prefill's own
  greedy answer of the same length budget;
* ``first_token_agree``: whether both prompts' greedy first tokens are the same;
* ``kl``: mean next-token KL(full || blended) along the served answer, both prompts
  teacher-forced with the served tokens.

When the guard fell back to full prefill, the served answer is full's and ``probe``
is the blended request it would otherwise have served: the same measures are taken
with the roles of served and generated answers swapped, so that the guard keeps
learning whether blending has recovered.

A shadow check never changes a served answer: it runs after it, on its own caches
(``Engine.prepare`` of a full request touches no cache; re-preparing the blended
request adds only what serving it already added). It costs one full prefill, one
blended prompt, a greedy decode and two teacher-forced passes over the answer (the
other side's own answer is decoded from the same prefill as its teacher forcing).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from kvblend.engine.engine import Engine
from kvblend.engine.request import Request, RequestStats, Result
from kvblend.errors import InvalidRequestError
from kvblend.eval.metrics import kl_divergence, token_f1
from kvblend.generation import SamplingParams, collect, stream_from

BLENDED = ("reuse", "blend")


class ShadowResult(NamedTuple):
    """How a blended answer compared with full prefill on one request."""

    model: str
    tenant: str
    method: str  # the blended method judged
    answer_f1: float
    first_token_agree: bool
    kl: float  # nats, mean over the compared answer tokens
    tokens: int  # served answer tokens compared
    score: float | None = None  # the blended prompt's mean selection score at its first check layer


@torch.inference_mode()
def teacher_forced(engine: Engine, request: Request, answer: list[int],
                   own_answer: bool = False) -> tuple[torch.Tensor, RequestStats, str | None]:
    """Next-token logits (T, V) before each of ``answer``'s T tokens, the prompt built by
    the request's method and then fed the answer's tokens; the prompt's stats; and, with
    ``own_answer``, the prompt's own greedy answer of up to T tokens, decoded first from
    the same prefill (the cache is then cut back to the prompt)."""
    prepared = engine.prepare(request, extra_capacity=len(answer))
    n, text = prepared.cache.length, None
    if own_answer:
        events = stream_from(engine.model, engine.tokenizer, prepared.cache, prepared.logits,
                             SamplingParams(max_tokens=len(answer)), engine.loaded.eos_token_ids)
        text = collect(events, n).text
        prepared.cache.truncate(n)
    rows = [prepared.logits.reshape(1, -1)]  # (1, V)
    if len(answer) > 1:
        ids = torch.tensor(answer[:-1], dtype=torch.long, device=engine.model.device)
        rows.append(engine.model(ids, prepared.cache, logits_for="all"))  # (T-1, V)
    return torch.cat(rows).float(), prepared.stats, text


def first_score(stats: RequestStats) -> float | None:
    """Mean selection score at the first check layer (over every cached document token,
    before any selection, so it does not depend on the ratio); None without checks."""
    return stats.checks[0].mean_score if stats.checks else None


def _roles(request: Request, probe: Request | None) -> tuple[Request, Request, bool]:
    """(full request, blended request, whether the served answer was the blended one)."""
    if request.method in BLENDED:
        return dataclasses.replace(request, method="full"), request, True
    if probe is None or probe.method not in BLENDED:
        raise InvalidRequestError("a request served by full prefill needs a blended probe to shadow-check")
    return dataclasses.replace(request, method="full"), probe, False


def shadow_check(engine: Engine, request: Request, served: Result, probe: Request | None = None) -> ShadowResult:
    """Compare the blended and full-prefill answers to ``request`` (see the module doc)."""
    full_req, blended_req, served_blended = _roles(request, probe)
    answer = list(served.token_ids)
    if not answer:
        raise InvalidRequestError("the served answer is empty: there is nothing to compare along")
    full_logits, _, full_text = teacher_forced(engine, full_req, answer, own_answer=served_blended)  # (T, V)
    blended_logits, stats, blended_text = teacher_forced(engine, blended_req, answer, own_answer=not served_blended)
    agree = int(full_logits[0].argmax()) == int(blended_logits[0].argmax())
    f1 = token_f1(served.text, full_text if served_blended else blended_text)
    return ShadowResult(engine.loaded.name, request.tenant, blended_req.method, f1, agree,
                        kl_divergence(full_logits, blended_logits), len(answer), first_score(stats))
