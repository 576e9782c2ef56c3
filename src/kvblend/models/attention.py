"""Attention against an explicit key/value set, planned once per set of query positions.

Queries may sit anywhere in the sequence (CacheBlend recomputes scattered tokens), so
the mask must be exact over global positions. An explicit mask forfeits SDPA's causal
fast path, so ``plan_attention`` picks the cheapest exact form:

* ``unmasked`` — one query at the last position (decode): it sees every key;
* ``tail``    — the same past a sliding window: it sees the window's last keys, unmasked;
* ``causal``  — queries are exactly positions 0..N-1: ``is_causal``;
* ``padded``  — queries are a block p0..N-1 with a short head: pad the queries with p0
  dummy rows, run ``is_causal`` and drop the dummies (exact, wastes ~p0²/2);
* ``groups``  — scattered queries: split them into position-ordered groups, each
  attending only to keys up to its last query, with a precomputed additive mask.
  Group boundaries minimise the (query, key) pairs computed plus a per-call cost
  (``_partition``): on a blend's scattered 15 % that is ~12 % fewer pairs than fixed
  groups of 128 and measured 6-14 % less attention time. The query heads sharing a KV
  head are stacked along the query axis, so one call serves them all and each key
  block is loaded once for all of them (~8 % faster than SDPA's own GQA handling for
  128-query groups; 2-core CPU).
* ``split``   — the same groups on CPU, where the flash kernel also returns each row's
  log-sum-exp: the keys before a group's first query, which every query of the group
  sees, run unmasked (the kernel's fused fast path); only the keys from the first
  query on carry a mask. The two parts are merged exactly by their log-sum-exps. On a
  blend's selection ~3/4 of the pairs then need no mask (a masked pair costs ~1.16x
  an unmasked one), and the masks shrink from ~12 MB to ~3 MB per layer: 0.95x the
  blend request's time, paired over 12 interleaved rounds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


# The CPU flash kernel behind SDPA, which also returns each row's log-sum-exp (None when
# this build lacks it: plans then fall back to "groups").
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q: (Hq, Tq, d); k, v: (Hkv, Tk, d); mask: (Tq, Tk), bool (True = may attend) or
    additive float. ``causal`` is the fast path for Tq == Tk with no mask.
    Returns (Tq, Hq * d).
    """
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal, enable_gqa=q.shape[0] != k.shape[0]
    )  # (1, Hq, Tq, d)
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def first_visible(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees under a sliding ``window``."""
    return 0 if window is None else max(0, position - window + 1)


def attend_parts(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], position: int,
                 window: int | None) -> torch.Tensor:
    """One query q (Hq, 1, d) at ``position`` against keys held in consecutive parts
    [(K, V) each (Hkv, n_i, d)] that together are slots 0..position (a forked cache:
    the shared prompt, then the choice's own tokens), with the layer's sliding ``window``.
    Exact: the parts' scores are one softmax, so the result equals ``attend`` over the
    concatenated keys up to rounding, without concatenating them. (1, Hq*d)."""
    if q.shape[1] != 1:  # the visible keys below are one query's (and unmasked)
        raise ValueError(f"attention over cache parts takes one query (a decode step), got {q.shape[1]}")
    first = first_visible(position, window)
    visible, at = [], 0
    for k, v in parts:
        skip = max(first - at, 0)
        if skip < k.shape[1]:
            visible.append((k[:, skip:], v[:, skip:]))
        at += k.shape[1]
    if len(visible) == 1:
        return attend(q, *visible[0])
    return _attend_one(q, visible)


def _attend_one(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One query q (Hq, 1, d) against keys in consecutive parts [(K, V) each (Hkv, n_i, d)],
    every key visible: the parts' scores as one softmax (float32), so two parts equal their
    concatenation without copying the keys. (1, Hq*d)."""
    hq, _, d = q.shape
    hkv = parts[0][0].shape[0]
    stacked = q.reshape(hkv, hq // hkv, d)  # (Hkv, g, d): query head i serves KV head i // g
    scores = [torch.matmul(stacked, k.transpose(1, 2)) for k, _ in parts]  # (Hkv, g, n_i) each
    joined = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)
    probs = torch.softmax(joined.float().mul_(1.0 / math.sqrt(d)), dim=-1).to(q.dtype)
    out, at = None, 0
    for k, v in parts:
        part = torch.matmul(probs[..., at : at + k.shape[1]], v)  # (Hkv, g, d)
        out = part if out is None else out.add_(part)
        at += k.shape[1]
    return out.reshape(1, hq * d)


def attend_cache(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], plan: AttentionPlan,
                 start: int, window: int | None) -> torch.Tensor:
    """q (Hq, T, d) of the tokens written at ``start`` against a cache's ``write_parts``:
    one part by ``plan``; a forked cache's two by ``attend_parts`` (a decode step)."""
    if len(parts) == 1:
        return attend_planned(q, *parts[0], plan)
    return attend_parts(q, parts, start, window)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Exact mask over global positions: query at p sees keys at positions <= p.

    With a sliding ``window``, also only keys with p - k < window. (Tq, Tk) bool.
    """
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    return allowed & (diff < window) if window else allowed


class QueryGroup(NamedTuple):
    start: int  # first query row of the group
    end: int
    key_start: int  # keys before it are visible to every query of the group
    key_end: int  # keys 0..key_end-1 are visible to some query of the group
    mask: torch.Tensor  # (heads_per_kv * (end - start), key_end - key_start) additive float mask


class AttentionPlan(NamedTuple):
    kind: str  # "unmasked" | "tail" | "causal" | "padded" | "groups" | "split"
    pad: int = 0  # "padded": dummy query rows; "tail": keys before the window
    groups: tuple[QueryGroup, ...] = ()
    heads_per_kv: int = 1  # query heads per KV head the group masks were stacked for


def _is_block(q_pos: torch.Tensor, n_keys: int) -> bool:
    n = q_pos.shape[0]
    return n > 0 and int(q_pos[-1]) == n_keys - 1 and int(q_pos[0]) == n_keys - n


def plan_attention(
    q_pos: torch.Tensor, n_keys: int, window: int | None, dtype: torch.dtype, group_size: int = 256,
    heads_per_kv: int = 1,
) -> AttentionPlan:
    """Choose how queries at sorted positions ``q_pos`` attend to keys 0..n_keys-1.

    ``group_size`` caps the queries of one group (scattered queries only).
    ``heads_per_kv`` (query heads / KV heads) must match the q passed to ``attend_planned``."""
    free_window = window is None or n_keys <= window
    if not free_window and q_pos.shape[0] == 1 and int(q_pos[0]) == n_keys - 1:
        return AttentionPlan("tail", pad=n_keys - window)  # a decode step past the window: its last keys
    if free_window and _is_block(q_pos, n_keys):
        pad = n_keys - q_pos.shape[0]
        if q_pos.shape[0] == 1:
            return AttentionPlan("unmasked")
        if pad == 0:
            return AttentionPlan("causal")
        if pad <= q_pos.shape[0]:
            return AttentionPlan("padded", pad=pad)
    split = (free_window and q_pos.device.type == "cpu" and dtype in _FLASH_DTYPES
             and _FLASH_CPU is not None)
    groups = []
    for s, e in _partition(q_pos, group_size):
        pos = q_pos[s:e]
        key_start, key_end = int(pos[0]) if split else 0, int(pos[-1]) + 1
        allowed = causal_mask(pos, torch.arange(key_start, key_end, device=pos.device), window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill_(~allowed, float("-inf"))
        groups.append(QueryGroup(s, s + pos.shape[0], key_start, key_end, mask.repeat(heads_per_kv, 1)))
    return AttentionPlan("split" if split else "groups", groups=tuple(groups), heads_per_kv=heads_per_kv)


# What one more group costs beyond its pairs, in (query, key) pairs of work: fitted on
# SmolLM2's blend queries (2-core CPU), where anything from 12k to 20k gave the same
# times; with the split form (two calls per group) 8k to 32k measured the same too.
CALL_COST_PAIRS = 16384


def _partition(q_pos: torch.Tensor, max_rows: int) -> list[tuple[int, int]]:
    """Split sorted query positions into runs [s, e) of at most ``max_rows`` that minimise
    sum((e - s) * (q_pos[e - 1] + 1)) + CALL_COST_PAIRS * number_of_runs.

    A run computes every query against keys up to its last query, so long gaps inside a
    run are wasted work; each run is one kernel call. Dynamic programming over run ends,
    vectorised over run starts: O(len * max_rows)."""
    key_end = q_pos.cpu().numpy().astype(np.float64) + 1
    m = key_end.shape[0]
    best = np.zeros(m + 1)
    start = np.zeros(m + 1, dtype=np.int64)
    for e in range(1, m + 1):
        s = np.arange(max(0, e - max_rows), e)
        cost = best[s] + (e - s) * key_end[e - 1] + CALL_COST_PAIRS
        i = int(np.argmin(cost))
        best[e], start[e] = cost[i], s[i]
    runs, e = [], m
    while e > 0:
        runs.append((int(start[e]), e))
        e = int(start[e])
    return runs[::-1]


def attend_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Attention of q (Hq, Tq, d) against k, v (Hkv, N, d) following ``plan``. (Tq, Hq*d)."""
    if plan.kind == "unmasked":
        return attend(q, k, v)
    if plan.kind == "tail":
        return attend(q, k[:, plan.pad :], v[:, plan.pad :])
    if plan.kind == "causal":
        return attend(q, k, v, causal=True)
    if plan.kind == "padded":
        padded = torch.cat((q.new_zeros(q.shape[0], plan.pad, q.shape[2]), q), dim=1)  # (Hq, N, d)
        return attend(padded, k, v, causal=True)[plan.pad :]
    if q.shape[0] != plan.heads_per_kv * k.shape[0]:
        raise ValueError(f"plan made for {plan.heads_per_kv} query heads per KV head, got "
                         f"{q.shape[0]} query and {k.shape[0]} KV heads")
    if plan.kind == "split":
        return _attend_split(q, k, v, plan.groups)
    parts = [_attend_stacked(q[:, g.start : g.end], k[:, : g.key_end], v[:, : g.key_end], g.mask)
             for g in plan.groups]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _stack(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(Hq, T, d) -> (1, Hkv, Hq/Hkv * T, d): the query heads of each KV head as one block
    (query head i serves KV head i // (Hq/Hkv))."""
    hq, t, d = q.shape
    return q.reshape(hkv, hq // hkv * t, d)[None]


def _attend_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (Hq, T, d) against k, v (Hkv, N, d) with the query heads of each KV head stacked
    into one (Hq/Hkv * T)-row query block; ``mask`` is stacked the same way. (T, Hq*d)."""
    hq, t, d = q.shape
    out = F.scaled_dot_product_attention(_stack(q, k.shape[0]), k[None], v[None], attn_mask=mask)[0]
    return out.view(hq, t, d).transpose(0, 1).reshape(t, hq * d)


def _attend_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: tuple[QueryGroup, ...]) -> torch.Tensor:
    """Each group's unmasked head (keys < key_start) and masked tail (key_start..key_end-1),
    merged by their log-sum-exps l1, l2: out = o1 + (o2 - o1) * sigmoid(l2 - l1), which is
    (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2). Every tail holds the group's first query's own
    key, so no row is fully masked there. Written straight into a (Tq, Hq, d) buffer:
    returns its (Tq, Hq*d) view."""
    hq, tq, d = q.shape
    hkv = k.shape[0]
    out = q.new_empty(tq, hq, d)
    for g in groups:
        t, stacked = g.end - g.start, _stack(q[:, g.start : g.end], hkv)
        ks, ke = g.key_start, g.key_end
        dest = out[g.start : g.end].transpose(0, 1)  # (Hq, t, d) view
        o2, l2 = _FLASH_CPU(stacked, k[None, :, ks:ke], v[None, :, ks:ke], attn_mask=g.mask)[:2]
        o2 = o2[0].view(hq, t, d)
        if not ks:
            dest.copy_(o2)
            continue
        o1, l1 = _FLASH_CPU(stacked, k[None, :, :ks], v[None, :, :ks])[:2]
        weight = torch.sub(l2, l1).sigmoid_().reshape(hq, t, 1).to(q.dtype)  # lse is fp32
        torch.lerp(o1[0].view(hq, t, d), o2, weight, out=dest)
    return out.view(tq, hq * d)
