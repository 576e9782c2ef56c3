"""Batched decode: the next token of many requests in one forward, each over its own cache.

Continuous batching (Orca, OSDI '22; vLLM) runs the decode steps of every running request
together. Requests here keep their own ``KVCache`` (own capacity, own length), so only the
token-wise work is batched:

    h = embed(tokens)                          # (B, D): one row per request
    q, k, v = layer.project(h, cos, sin)       # projections over the whole batch
    a[b] = attend(q[b], cache_b.write(k[b]))   # attention per request, over its cache
    h = layer.finish(h, a)                     # output projection + MLP over the batch

Rows never mix, so each row equals a one-token ``Transformer.forward`` of its request
(up to GEMM rounding; tests hold logits within 1e-4 and greedy tokens identical).

``DecodeSlot`` is one request's per-token bookkeeping — sampler, incremental text with
stop strings, EOS and length — applying the same rules as ``stream_from``, so that a
scheduler can feed it logits from a batched step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvblend.errors import ContextLengthError
from kvblend.generation.sampling import Sampler, SamplingParams
from kvblend.generation.stream import StreamEvent, cap_new_tokens
from kvblend.generation.text import TextStream
from kvblend.models.attention import attend_planned, plan_attention
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer


@torch.inference_mode()
def decode_batch(model: Transformer, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
    """Append ``tokens[b]`` to ``caches[b]`` for every b in one forward; return (B, V) logits.

    Each cache is extended in place by one position, exactly as ``model(ids, cache)``
    with a single id would. Caches must be distinct objects."""
    if len(tokens) != len(caches) or not tokens:
        raise ValueError(f"need one token per cache, got {len(tokens)} tokens and {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("a cache appears twice in one batch")
    starts = [c.length for c in caches]
    _check_context(model, max(starts) + 1)
    tables = _rope_rows(model, starts)
    plans = {w: [_decode_plan(model, s, w) for s in starts] for w in {layer.window for layer in model.layers}}
    h = model.embed(torch.tensor(list(tokens), dtype=torch.long, device=model.device))  # (B, D)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.project(h, *tables[i])  # (Hq, B, d), (Hkv, B, d), (Hkv, B, d)
        attn = q.new_empty(len(caches), q.shape[0] * q.shape[2])  # (B, Hq*d)
        for b, cache in enumerate(caches):
            keys, values = cache.write(i, starts[b], k[:, b : b + 1], v[:, b : b + 1])
            attn[b] = attend_planned(q[:, b : b + 1], keys, values, plans[layer.window][b])[0]
        h = layer.finish(h, attn)
    for cache, start in zip(caches, starts):
        cache.length = start + 1
    return model.logits(h)  # (B, V)


def _rope_rows(model: Transformer, starts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, cos/sin (B, rd/2) for one new token per request, each computed alone
    (dynamic NTK scales by the request's own length, as its single-request forward would)
    with the layer's own RoPE (Gemma 3's local and global layers differ). Layers sharing a
    RoPE config share one table."""
    per_request = [model.layer_rope_tables(torch.tensor([s], device=model.device)) for s in starts]
    out, shared = [], {}
    for i, layer in enumerate(model.layers):
        if layer.rope not in shared:
            shared[layer.rope] = (torch.cat([t[i][0] for t in per_request]), torch.cat([t[i][1] for t in per_request]))
        out.append(shared[layer.rope])
    return out


def _decode_plan(model: Transformer, start: int, window: int | None):
    """The attention plan ``Transformer.forward`` uses for one query at ``start`` in a
    layer with sliding ``window`` (None: every key)."""
    positions = torch.tensor([start], device=model.device)
    return plan_attention(positions, start + 1, window, model.dtype, heads_per_kv=model.cfg.heads_per_kv)


def _check_context(model: Transformer, length: int) -> None:
    limit = model.cfg.context_length
    if length > limit:
        raise ContextLengthError(f"{length} tokens exceed the model's context of {limit} tokens")


class DecodeSlot:
    """One request's decode state between batched steps.

    Feed it the logits of its next position; it samples a token and returns the event,
    applying ``stream_from``'s rules: max_tokens capped to the context left after the
    prompt, EOS (unless ``ignore_eos``) and stop strings end with "stop", the last
    allowed token ends with "length" and flushes held-back text. After an event with a
    ``finish_reason``, ``finished`` is True and the slot takes no more logits.
    """

    def __init__(self, tokenizer: Any, cache: KVCache, params: SamplingParams, eos_ids: Sequence[int],
                 context_length: int) -> None:
        self.cache = cache
        self.params = cap_new_tokens(params, cache.length, context_length)
        self.sampler = Sampler(self.params)
        self.text = TextStream(tokenizer, self.params.stop)
        self.eos = frozenset() if self.params.ignore_eos else frozenset(eos_ids)
        self.count = 0
        self.last_token: int | None = None
        self.finished = False

    def next_event(self, logits: torch.Tensor) -> StreamEvent:
        """Sample from (V,) logits and account for the token."""
        if self.finished:
            raise RuntimeError("this request has already finished decoding")
        token = self.sampler(logits.reshape(-1))
        self.count += 1
        self.last_token = token
        delta = self.text.push(token) if token not in self.eos else ""
        if token in self.eos or self.text.stopped:
            self.finished = True
            return StreamEvent(token, delta, "stop")
        if self.count == self.params.max_tokens:
            self.finished = True
            return StreamEvent(token, delta + self.text.finish(), "length")
        return StreamEvent(token, delta)
