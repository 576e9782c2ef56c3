"""Batched steps: the next tokens of many requests in one forward, each over its own cache.

Continuous batching (Orca, OSDI '22; vLLM) runs the decode steps of every running request
together. Requests here keep their own ``KVCache`` (own capacity, own length), so only the
token-wise work is batched:

    h = embed(tokens)                          # (B, D): one row per request
    q, k, v = layer.project(h, cos, sin)       # projections over the whole batch
    a[b] = attend(q[b], cache_b.write(k[b]))   # attention per request, over its cache
    h = layer.finish(h, a)                     # output projection + MLP over the batch

Rows never mix, so each row equals a one-token ``Transformer.forward`` of its request
(up to GEMM rounding; tests hold logits within 1e-4 and greedy tokens identical).
``forward_batch`` is the general form: each member is a ``Forward`` of any number of
tokens, so one slice of a long prefill rides in the same pass as the decode tokens.

A scheduler feeds each row of the logits to the request's ``DecodeSlot`` (``slot.py``,
re-exported here), the one implementation of the decode rules that ``stream_from`` uses
too: sampling, stop strings, EOS and max_tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvblend.errors import ContextLengthError
from kvblend.generation.chunked import Forward
from kvblend.generation.slot import DecodeSlot
from kvblend.models.attention import AttentionPlan, attend_cache, plan_attention
from kvblend.models.kv_cache import KVCache
from kvblend.models.packed import decode_pass, decoding
from kvblend.models.transformer import DecodeRows, Transformer

__all__ = ["DecodeSlot", "decode_batch", "forward_batch"]


@torch.inference_mode()
def decode_batch(model: Transformer, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
    """Append ``tokens[b]`` to ``caches[b]`` for every b in one forward; return (B, V) logits.

    Each cache is extended in place by one position, exactly as ``model(ids, cache)``
    with a single id would. Caches must be distinct objects."""
    if len(tokens) != len(caches) or not tokens:
        raise ValueError(f"need one token per cache, got {len(tokens)} tokens and {len(caches)} caches")
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)  # (B,)
    return torch.cat(forward_batch(model, [Forward(ids[b : b + 1], c) for b, c in enumerate(caches)]))  # (B, V)


@torch.inference_mode()
def forward_batch(model: Transformer, forwards: Sequence[Forward]) -> list[torch.Tensor]:
    """Run several ``Forward`` steps (each some tokens appended to its own cache) in one
    forward: projections and MLP over all their rows, attention per step over its cache.
    Returns, per step, what ``model(f.ids, f.cache, f.logits_for)`` returns (up to GEMM
    rounding). So a prefill slice and many requests' decode tokens share one scheduler step
    (chunked prefill piggybacking decodes, as Sarathi-Serve does): one pass over the weights,
    or, with packed decode weights, a prefill pass and a decode pass (``_split_decodes``: a
    decode token never depends on what rides beside it). Caches must be distinct objects;
    each is extended in place."""
    if not forwards:
        raise ValueError("forward_batch needs at least one step")
    if len({id(f.cache) for f in forwards}) != len(forwards):
        raise ValueError("a cache appears twice in one batch")
    split = _split_decodes(model, forwards)
    if split is not None:
        return split
    starts = [f.cache.length for f in forwards]
    sizes = [int(f.ids.shape[0]) for f in forwards]
    for start, size in zip(starts, sizes):
        _check_context(model, start + size)
    positions = [torch.arange(s, s + t, device=model.device) for s, t in zip(starts, sizes)]
    tables = _rope_rows(model, positions)
    plans: dict[int | None, list[AttentionPlan]] = {}  # per window, each step's attention plan: made on first use

    def plan(window: int | None, b: int) -> AttentionPlan:
        if window not in plans:
            plans[window] = [plan_attention(p, s + t, window, model.dtype, heads_per_kv=model.cfg.heads_per_kv)
                             for p, s, t in zip(positions, starts, sizes)]
        return plans[window][b]

    rows = list(itertools.accumulate(sizes, initial=0))  # row offsets of each step
    decode = decode_pass(sizes)
    decode_rows = DecodeRows([f.cache for f in forwards], starts) if decode else None
    with decoding(decode):  # decode steps alone read the packed decode weights
        h = model.embed(torch.cat([f.ids for f in forwards]))  # (R, D): every step's rows
        stacked = model.decode_layers(h, tables, decode_rows) if decode_rows is not None else None
        if stacked is not None:
            h = stacked
        for i, layer in enumerate(model.layers if stacked is None else ()):  # else every layer ran above
            # decode rows alone: the whole layer, every row's K/V write and attention, in one
            # native call where it can
            stepped = layer.decode_rows(h, *tables[i], decode_rows, i) if decode_rows is not None else None
            if stepped is not None:
                h = stepped
                continue
            q, k, v = layer.project(h, *tables[i])  # (Hq, R, d), (Hkv, R, d), (Hkv, R, d)
            if len(forwards) == 1:  # one step: its attention is the whole output, no copy
                parts = forwards[0].cache.write_parts(i, starts[0], k, v)
                h = layer.finish(h, attend_cache(q, parts, plan(layer.window, 0), starts[0], layer.window))
                continue
            attn = q.new_empty(rows[-1], q.shape[0] * q.shape[2])  # (R, Hq*d)
            for b, f in enumerate(forwards):
                a, z = rows[b], rows[b + 1]
                parts = f.cache.write_parts(i, starts[b], k[:, a:z], v[:, a:z])
                attn[a:z] = attend_cache(q[:, a:z], parts, plan(layer.window, b), starts[b], layer.window)
            h = layer.finish(h, attn)
        for f, start, size in zip(forwards, starts, sizes):
            f.cache.length = start + size
        return _logits(model, h, forwards, rows)


def _split_decodes(model: Transformer, forwards: Sequence[Forward]) -> list[torch.Tensor] | None:
    """A pass mixing one-token steps with longer ones, on a model with packed decode
    weights, as two passes: the one-token steps a decode pass (``models.packed.decode_pass``),
    the rest a prefill pass; outputs in the steps' order. So a decode token's logits and
    KV never depend on whether a prefill slice rode in its pass: one pass would multiply
    its row by the fp32 weights, and a greedy answer under load would differ from the same
    request's answer on a quiet server wherever a near tie met the weights' rounding (the
    int8 kernels' rows never depend on the rows beside them). None: nothing to split."""
    sizes = [int(f.ids.shape[0]) for f in forwards]
    ones = [b for b, t in enumerate(sizes) if t == 1]
    if model.decode_weights == "fp32" or not ones or len(ones) == len(sizes):
        return None
    rest = [b for b, t in enumerate(sizes) if t != 1]
    out: list[torch.Tensor | None] = [None] * len(forwards)
    for b, o in zip(rest, forward_batch(model, [forwards[b] for b in rest])):
        out[b] = o
    try:
        decoded = forward_batch(model, [forwards[b] for b in ones])
    except BaseException:
        for b in rest:  # as one failed pass would: no cache extended (the caller may retry each step)
            forwards[b].cache.length -= sizes[b]
        raise
    for b, o in zip(ones, decoded):
        out[b] = o
    return out  # type: ignore[return-value]


def _logits(model: Transformer, h: torch.Tensor, forwards: Sequence[Forward], rows: list[int]) -> list[torch.Tensor]:
    """Per step, (1, V) for "last", (T, V) for "all" or an empty tensor for "none", from
    the final hidden rows ``h`` (R, D), through one pass over the output head for every
    step's wanted rows: the head is the largest matrix of a small model, and a pass over
    it per request made a batch of 8 decodes cost about 3 single ones."""
    wanted = []
    for b, f in enumerate(forwards):
        if f.logits_for not in ("last", "all", "none"):
            raise ValueError(f"logits_for must be 'last', 'all' or 'none', got {f.logits_for!r}")
        wanted.append([] if f.logits_for == "none" else
                      [rows[b + 1] - 1] if f.logits_for == "last" else list(range(rows[b], rows[b + 1])))
    flat = [r for w in wanted for r in w]
    logits = model.logits(h[torch.tensor(flat, device=h.device)]) if flat else h.new_empty(0, 0)
    out, at = [], 0
    for w in wanted:
        out.append(logits[at : at + len(w)] if w else h.new_empty(0))
        at += len(w)
    return out


def _rope_rows(model: Transformer, positions: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, cos/sin (R, rd/2) for every step's rows, each step's computed alone
    (dynamic NTK scales by the step's own positions, as its single forward would) with
    the layer's own RoPE (Gemma 3's local and global layers differ). Layers sharing a
    RoPE config share one table. Without dynamic NTK a position's table is the same in
    any step, so all rows are computed at once (eight decode rows: one call, not eight)."""
    if all(layer.rope.rope_type != "dynamic" for layer in model.layers):
        return model.layer_rope_tables(torch.cat(positions))
    per_step = [model.layer_rope_tables(p) for p in positions]
    out, shared = [], {}
    for i, layer in enumerate(model.layers):
        if layer.rope not in shared:
            shared[layer.rope] = (torch.cat([t[i][0] for t in per_step]), torch.cat([t[i][1] for t in per_step]))
        out.append(shared[layer.rope])
    return out


def _check_context(model: Transformer, length: int) -> None:
    limit = model.cfg.context_length
    if length > limit:
        raise ContextLengthError(f"{length} tokens exceed the model's context of {limit} tokens")
