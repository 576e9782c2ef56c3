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

A shadow check never changes a served answer: it runs after it, on its own caches (a
full prefill touches no cache; re-preparing the blended request adds only what serving
it already added). It costs one full prefill, one blended prompt, a greedy decode and
two teacher-forced passes over the answer (the other side's own answer is decoded from
the same prefill as its teacher forcing).

``shadow_steps`` is the same check as a step generator (``generation.chunked``) for the
scheduler's low-priority lane (``Scheduler.submit_background``): each step is one piece
of model work — a ``Forward`` slice of at most ``chunk_tokens`` tokens (or layers of such
a chunk run in place, when a callable ``chunk_tokens`` answers ``InPlace``: the
scheduler's pace while streams decode) of the full prefill or of a teacher-forced pass, a
slice or layer of the blended re-prepare (``Engine.prepare_steps``), or one greedy decode
token — and its return value is the
``ShadowResult``. ``shadow_check`` runs those steps to the end inline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any, NamedTuple

import torch

from kvblend.engine.engine import Engine
from kvblend.engine.request import Request, RequestStats, Result
from kvblend.errors import ContextLengthError, InvalidRequestError, NonFiniteLogitsError
from kvblend.metrics import kl_divergence, token_f1
from kvblend.generation import SamplingParams, collect, stream_from
from kvblend.generation.chunked import SliceSize, forward_chunks, run_steps
from kvblend.models.kv_cache import KVCache

BLENDED = ("reuse", "blend")
DEFAULT_CHUNK_TOKENS = 256  # tokens per prefill / teacher-forcing step of a shadow job

Steps = Generator[Any, Any, "ShadowResult"]  # generation.chunked's steps


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


class _Prompt(NamedTuple):
    cache: KVCache
    logits: torch.Tensor  # (V,) after the prompt's last token
    stats: RequestStats | None  # the engine's stats (blended prompts); None for the chunked full prefill


def _full_prompt(engine: Engine, request: Request, extra: int,
                 chunk_tokens: SliceSize) -> Generator[Any, Any, _Prompt]:
    """Full prefill of the request's prompt, ``chunk_tokens`` per step, into a fresh cache
    with room for ``extra`` more tokens (what ``Engine.prepare`` of a full request builds)."""
    layout = engine.layout(request)
    n, limit = len(layout), engine.model.cfg.context_length
    if n + 1 > limit:
        raise ContextLengthError(f"the prompt has {n} tokens; the model's context is {limit} tokens")
    cache = engine.model.new_cache(n + max(0, min(extra, limit - n)))
    ids = torch.tensor(layout.ids, dtype=torch.long, device=engine.model.device)  # (n,)
    logits = yield from forward_chunks(engine.model, ids, cache, chunk_tokens)  # (1, V)
    return _Prompt(cache, logits[0], None)


def _engine_prompt(engine: Engine, request: Request, extra: int,
                   chunk_tokens: SliceSize) -> Generator[Any, Any, _Prompt]:
    """The request's prompt by its own method, through ``Engine.prepare_steps``."""
    prepared = yield from engine.prepare_steps(request, extra_capacity=extra, slice_tokens=chunk_tokens)
    return _Prompt(prepared.cache, prepared.logits, prepared.stats)


def _teacher_forced(engine: Engine, prompt: Generator[Any, Any, _Prompt], answer: list[int], own_answer: bool,
                    chunk_tokens: SliceSize,
                    ) -> Generator[Any, Any, tuple[torch.Tensor, RequestStats | None, str | None]]:
    """Next-token logits (T, V) before each of ``answer``'s T tokens, the prompt built by
    ``prompt`` and then fed the answer's tokens; the prompt's stats; and, with
    ``own_answer``, the prompt's own greedy answer of up to T tokens, decoded first from
    the same prefill, one token per step (the cache is then cut back to the prompt)."""
    built = yield from prompt
    n, text = built.cache.length, None
    if own_answer:
        events = []
        for event in stream_from(engine.model, engine.tokenizer, built.cache, built.logits,
                                 SamplingParams(max_tokens=len(answer)), engine.loaded.eos_token_ids):
            events.append(event)
            yield
        text = collect(iter(events), n).text
        built.cache.truncate(n)
    rows = [built.logits.reshape(1, -1)]  # (1, V)
    if len(answer) > 1:
        ids = torch.tensor(answer[:-1], dtype=torch.long, device=engine.model.device)  # (T-1,)
        rows.append((yield from forward_chunks(engine.model, ids, built.cache, chunk_tokens, "all")))  # (T-1, V)
    return torch.cat(rows).float(), built.stats, text


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


@torch.inference_mode()
def shadow_steps(engine: Engine, request: Request, served: Result, probe: Request | None = None,
                 chunk_tokens: SliceSize = DEFAULT_CHUNK_TOKENS) -> Steps:
    """The shadow check of ``request`` as a job of small steps (see the module doc; a
    callable ``chunk_tokens`` is asked before each slice, as ``forward_chunks`` does);
    raises (on the first ``next()``) what ``shadow_check`` raises."""
    if isinstance(chunk_tokens, int) and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    full_req, blended_req, served_blended = _roles(request, probe)
    answer = list(served.token_ids)
    if not answer:
        raise InvalidRequestError("the served answer is empty: there is nothing to compare along")
    full_logits, _, full_text = yield from _teacher_forced(  # (T, V)
        engine, _full_prompt(engine, full_req, len(answer), chunk_tokens), answer, served_blended, chunk_tokens)
    blended_logits, stats, blended_text = yield from _teacher_forced(  # (T, V)
        engine, _engine_prompt(engine, blended_req, len(answer), chunk_tokens), answer, not served_blended,
        chunk_tokens)
    if not bool(torch.isfinite(full_logits).all() and torch.isfinite(blended_logits).all()):  # no verdict
        raise NonFiniteLogitsError("a shadow check's teacher-forced logits were not finite; the check is not counted")
    agree = int(full_logits[0].argmax()) == int(blended_logits[0].argmax())
    f1 = token_f1(served.text, full_text if served_blended else blended_text)
    return ShadowResult(engine.loaded.name, request.tenant, blended_req.method, f1, agree,
                        kl_divergence(full_logits, blended_logits), len(answer), first_score(stats))


def shadow_check(engine: Engine, request: Request, served: Result, probe: Request | None = None,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> ShadowResult:
    """Compare the blended and full-prefill answers to ``request`` (see the module doc), inline."""
    return run_steps(shadow_steps(engine, request, served, probe, chunk_tokens), engine.model)
