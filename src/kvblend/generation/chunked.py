"""Model work as steps: a forward over many tokens split into slices of at most N tokens.

A *step generator* is how any long piece of model work (a request's prefill or fusion,
a document's chunk KV, a shadow check) is written so that the one thread owning the
model can interleave it with other work. Each value it yields is one step:

* ``Forward(ids, cache, logits_for)`` — "append ``ids`` to ``cache``": whoever drives the
  generator runs that forward (alone, or in one batch with other requests' rows) and
  sends back its logits, exactly what ``model(ids, cache, logits_for)`` returns;
* an ``int`` — that many token-layers of work were just done in place (a fusion layer, or
  a layer of a chunk run in place: ``LayerDone``);
* ``None`` — some other piece of work was just done in place.

Its return value (``StopIteration.value``) is the work's result. ``run_steps`` drives one
alone, here. ``forward_chunks(model, ids, cache, chunk_tokens, logits_for)`` yields the
slices of one forward over the growing cache (positions continue from ``cache.length``)
and returns what one forward over all of ``ids`` returns: the last token's logits (1, V)
with ``logits_for="last"``, every token's (T, V) with ``"all"``. Causal attention makes
the slices' results those of one forward (up to float rounding: ≤ 1e-4 on logits,
tested), except under dynamic NTK RoPE past its window, whose frequencies depend on the
sequence length: such a forward runs in one slice.

A slice can also be run *in place*: when the size callable answers ``InPlace(n)``, the
next n tokens run here through ``Transformer.forward_steps``, which yields a ``LayerDone``
after each layer, so the driver can run other work (the running streams' decode steps)
between two layers of one large chunk instead of in the same pass as a small slice.
Which is cheaper is the device's: see ``kvblend.engine.scheduler``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NamedTuple, Union

import torch

from kvblend import rope as rope_lib
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer


class Forward(NamedTuple):
    """A step asking its driver to append ``ids`` (T,) to ``cache`` and send back the
    logits: (1, V) for "last", (T, V) for "all", an empty tensor for "none"."""

    ids: torch.Tensor
    cache: KVCache
    logits_for: str = "last"


Step = Union[Forward, int, None]
Steps = Generator[Step, Any, Any]


def run_steps(steps: Steps, model: Transformer) -> Any:
    """Drive a step generator to its end on this thread (each ``Forward`` through
    ``model``, alone); returns its value."""
    reply = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = model(step.ids, step.cache, step.logits_for) if isinstance(step, Forward) else None


def chunk_size(model: Transformer, end: int, chunk_tokens: int | None) -> int:
    """The slice length to use for a forward that ends at position ``end``: ``chunk_tokens``
    (None: no slicing), or everything when some layer's RoPE depends on the sequence
    length there."""
    if chunk_tokens is None:
        return max(end, 1)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if any(rope_lib.length_dependent(layer.rope, end) for layer in model.layers):
        return max(end, 1)
    return chunk_tokens


class InPlace(NamedTuple):
    """A size callable's answer: run the next ``tokens`` tokens here, layer by layer (each
    layer yielded as token-layers done in place), not as a ``Forward`` for the driver."""

    tokens: int


SliceSize = Union[int, None, Callable[[], Union[int, InPlace]]]


def forward_chunks(model: Transformer, ids: torch.Tensor, cache: KVCache, chunk_tokens: SliceSize,
                   logits_for: str = "last") -> Generator[Step, Any, torch.Tensor]:
    """Append ``ids`` (T,) to ``cache`` in steps of at most ``chunk_tokens`` (None: one step;
    a callable: asked before each slice, so the driver can size slices to what it measures,
    and answering ``InPlace(n)`` to have the next n tokens run here layer by layer); returns
    the logits one ``model(ids, cache, logits_for)`` would. A ``Forward`` slice is run by
    the driver; an in-place one by ``model`` here."""
    if logits_for not in ("last", "all", "none"):
        raise ValueError(f"logits_for must be 'last', 'all' or 'none', got {logits_for!r}")
    n = ids.shape[0]
    if n == 0:
        raise ValueError("forward_chunks needs at least one token")
    rows: list[torch.Tensor] = []
    start = 0
    while start < n:
        asked = chunk_tokens() if callable(chunk_tokens) else chunk_tokens
        here = isinstance(asked, InPlace)
        size = chunk_size(model, cache.length + n - start, asked.tokens if here else asked)
        last = start + size >= n
        which = logits_for if logits_for == "all" or last else "none"
        piece = ids[start : start + size]
        if here:
            out = yield from model.forward_steps(piece, cache, which)
        else:
            out = yield Forward(piece, cache, which)  # (1, V), (t, V) or empty
        start += size
        if which != "none":
            rows.append(out)
    if not rows:  # logits_for="none": the last slice's empty tensor
        return out
    return rows[0] if len(rows) == 1 else torch.cat(rows)  # (1, V) or (T, V)
