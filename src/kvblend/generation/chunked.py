"""Chunked prefill: a forward over many tokens split into steps of at most N tokens.

``forward_chunks(model, ids, cache, chunk_tokens, logits_for)`` is a generator: each
``next()`` runs ONE chunk (and the one after the last returns at once) of at most ``chunk_tokens`` tokens over the growing cache
(positions continue from ``cache.length``, every earlier token's KV already in it), so
a caller that owns the model (the scheduler's worker) can do other work between chunks.
Its return value (``StopIteration.value``, or ``yield from``) is what one forward over
all of ``ids`` returns: the last token's logits (1, V) with ``logits_for="last"``, every
token's (T, V) with ``"all"``. Causal attention makes the chunks' results those of one
forward (up to float rounding: ≤ 1e-4 on logits, tested), except under dynamic NTK RoPE
past its window, whose frequencies depend on the sequence length: such a forward runs
in one chunk.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from kvblend import rope as rope_lib
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer


def chunk_size(model: Transformer, end: int, chunk_tokens: int) -> int:
    """The chunk length to use for a forward that ends at position ``end``: ``chunk_tokens``,
    or everything when some layer's RoPE depends on the sequence length there."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if any(rope_lib.length_dependent(layer.rope, end) for layer in model.layers):
        return max(end, 1)
    return chunk_tokens


def forward_chunks(model: Transformer, ids: torch.Tensor, cache: KVCache, chunk_tokens: int,
                   logits_for: str = "last") -> Generator[None, None, torch.Tensor]:
    """Append ``ids`` (T,) to ``cache`` in chunks of at most ``chunk_tokens``, one per
    ``next()``; returns the logits one ``model(ids, cache, logits_for)`` would."""
    if logits_for not in ("last", "all"):
        raise ValueError(f"logits_for must be 'last' or 'all', got {logits_for!r}")
    n = ids.shape[0]
    if n == 0:
        raise ValueError("forward_chunks needs at least one token")
    size = chunk_size(model, cache.length + n, chunk_tokens)
    rows: list[torch.Tensor] = []
    for start in range(0, n, size):
        part = ids[start : start + size]  # (t,)
        last = start + size >= n
        which = logits_for if logits_for == "all" or last else "none"
        out = model(part, cache, logits_for=which)  # (1, V), (t, V) or empty
        if which != "none":
            rows.append(out)
        yield  # after every chunk, the last too: whatever the caller does next is a new step
    return rows[0] if len(rows) == 1 else torch.cat(rows)  # (1, V) or (T, V)
