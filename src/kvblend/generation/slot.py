"""The decode rules of one request, in one place: sampling, stop strings, EOS, max_tokens.

Every decode loop — ``stream_from`` (one request, a forward per token),
``decode_steps``, and the server's scheduler (many requests, one batched forward) —
feeds a ``DecodeSlot`` the logits of the request's next position and gets back the
``StreamEvent`` for the token it drew. How the logits were computed is the loop's
business; what a token means for the request is the slot's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from kvblend.errors import ContextLengthError
from kvblend.generation.grammar import Constraint, grammars
from kvblend.generation.sampling import Sampler, SamplingParams, TokenLogprobs, token_logprobs
from kvblend.generation.text import TextStream
from kvblend.generation.threads import serial_ops
from kvblend.models.kv_cache import ForkedCache, KVCache


class StreamEvent(NamedTuple):
    """One generated token and the text it made safe to show.

    ``finish_reason`` is set on the last event: "stop" (EOS or a stop string) or
    "length" (max_tokens or the context limit). ``index``: the choice it belongs to (a
    request of ``n`` choices); ``logprobs``: the token's, when the request asked for them.
    """

    token_id: int
    text: str
    finish_reason: str | None = None
    index: int = 0
    logprobs: TokenLogprobs | None = None


def cap_new_tokens(params: SamplingParams, used: int, context: int) -> SamplingParams:
    """Fit max_tokens into the context left after ``used`` positions; error if none is left."""
    room = context - used
    if room < 1:
        raise ContextLengthError(f"the prompt has {used} tokens; the model's context is {context} tokens")
    return params if params.max_tokens <= room else replace(params, max_tokens=room)


def fork_cache(cache: KVCache, extra: int) -> KVCache:
    """Another choice's cache after one prefill, with room for ``extra`` more positions: a
    ``ForkedCache`` that reads ``cache``'s prompt positions in place (no copy: the prompt's
    KV is read-only once prefilled, and ``cache``'s own decode only appends after it) and
    writes its own tokens apart."""
    return ForkedCache(cache, extra)


class DecodeSlot:
    """One request's decode state between steps, whoever computes the logits.

    Feed it the logits of its next position; it samples a token and returns the event:

    * max_tokens is capped to the context left after ``cache.length`` positions
      (``ContextLengthError`` when none is left);
    * EOS (any of ``eos_ids``, unless ``ignore_eos``) ends with "stop" and flushes the
      text held back for a possible stop string; the EOS token itself adds no text;
    * a stop string ends with "stop"; only the text before it is ever emitted;
    * the last allowed token ends with "length" and flushes the held-back text.

    After an event with a ``finish_reason``, ``finished`` is True and the slot takes no
    more logits. The slot never touches ``cache``: the caller appends ``last_token`` to
    it before asking for the next event. With ``tokenizer=None`` the events carry no
    text (token ids only), and stop strings are refused.

    ``index`` is the choice this slot decodes (of ``params.n``; its sampler is seeded with
    ``seed + index``); ``prompt_ids`` what the repetition penalty counts besides the
    output. With ``params.logprobs`` set, each event carries the drawn token's logprobs
    (``sampling.token_logprobs``) of the logits the draw used (after the mask, bias and
    penalties), or of the raw logits given with ``logprobs_mode="raw"``. With
    ``params.response_format``, a grammar (``grammar.Constraint``) masks each step's
    logits before the draw, and the answer ends ("stop") when the grammar does, at a
    stop token, even with ``ignore_eos``.
    """

    def __init__(self, tokenizer: Any, cache: KVCache, params: SamplingParams, eos_ids: Sequence[int],
                 context_length: int, prompt_ids: Sequence[int] = (), index: int = 0) -> None:
        if tokenizer is None and (params.stop or params.response_format is not None):
            raise ValueError("stop strings and response formats need a tokenizer")
        self.cache = cache
        self.tokenizer = tokenizer
        self.stop_ids = tuple(eos_ids)  # a grammar's end, even with ignore_eos
        self.constraint: Constraint | None = None  # made at the first logits (their width is the vocabulary)
        self.index = index
        self.params = cap_new_tokens(params, cache.length, context_length)
        self.sampler = Sampler(self.params, prompt_ids, index)
        self.text = TextStream(tokenizer, self.params.stop) if tokenizer is not None else None
        self.eos = frozenset() if self.params.ignore_eos else frozenset(eos_ids)
        self.count = 0
        self.tokens: list[int] = []  # every sampled token, in order
        self.last_token: int | None = None
        self.finished = False

    def next_event(self, logits: torch.Tensor) -> StreamEvent:
        """Sample from the (V,) logits of the next position and account for the token."""
        if self.finished:
            raise RuntimeError("this request has already finished decoding")
        with serial_ops():  # a handful of ops over the vocabulary: not worth waking a thread team for each
            return self._next_event(logits)

    def _next_event(self, logits: torch.Tensor) -> StreamEvent:
        allowed = self._allowed(logits)
        token = self.sampler(logits.reshape(-1)) if allowed is None else self.sampler(logits.reshape(-1), allowed)
        if self.constraint is not None:
            self.constraint.accept(token)
        self.count += 1
        self.tokens.append(token)
        self.last_token = token
        lp = None if self.params.logprobs is None else self._logprobs(logits, token)
        if token in self.eos or (self.constraint is not None and self.constraint.terminated):
            return self._finish(token, self._flush(), "stop", lp)
        delta = self._push(token)
        if self.text is not None and self.text.stopped:
            return self._finish(token, delta, "stop", lp)
        if self.count == self.params.max_tokens:
            return self._finish(token, delta + self._flush(), "length", lp)
        return StreamEvent(token, delta, None, self.index, lp)

    def _logprobs(self, logits: torch.Tensor, token: int) -> TokenLogprobs:
        used = logits if self.params.logprobs_mode == "raw" else self.sampler.used
        return token_logprobs(used, token, self.params.logprobs)

    def _allowed(self, logits: torch.Tensor) -> torch.Tensor | None:
        """(V,) bool of the tokens the request's response format allows next, or None."""
        fmt = self.params.response_format
        if fmt is None:
            return None
        if self.constraint is None:
            self.constraint = grammars(self.tokenizer, logits.shape[-1], self.stop_ids).constraint(fmt)
        return self.constraint.allowed()

    def _push(self, token: int) -> str:
        return self.text.push(token) if self.text is not None else ""

    def _flush(self) -> str:
        return self.text.finish() if self.text is not None else ""

    def _finish(self, token: int, text: str, reason: str, lp: TokenLogprobs | None) -> StreamEvent:
        self.finished = True
        return StreamEvent(token, text, reason, self.index, lp)
