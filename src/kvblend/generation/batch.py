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

A scheduler feeds each row of the logits to the request's ``DecodeSlot`` (``slot.py``,
re-exported here), the one implementation of the decode rules that ``stream_from`` uses
too: sampling, stop strings, EOS and max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvblend.errors import ContextLengthError
from kvblend.generation.slot import DecodeSlot
from kvblend.models.attention import attend_planned, plan_attention
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer

__all__ = ["DecodeSlot", "decode_batch"]


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
