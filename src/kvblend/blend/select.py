"""Pure selection math: KV deviation and top-k token choice (CacheBlend's HKVD tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def deviation(
    fresh_k: torch.Tensor | None, fresh_v: torch.Tensor, cached_k: torch.Tensor | None, cached_v: torch.Tensor,
    signal: str,
) -> torch.Tensor:
    """Per-token squared L2 distance between fresh and cached K/V, summed over heads and dims.

    Inputs are (Hkv, T, d); returns (T,) float32. ``signal``: "v", "k" or "kv" (sum of both).
    The keys may be None when the signal is "v".
    """
    dev = torch.zeros(fresh_v.shape[1], dtype=torch.float32, device=fresh_v.device)
    if signal in ("v", "kv"):
        dev += (fresh_v - cached_v).float().pow(2).sum(dim=(0, 2))
    if signal in ("k", "kv"):
        dev += (fresh_k - cached_k).float().pow(2).sum(dim=(0, 2))
    return dev


def select_tokens(dev: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (sorted ascending) of the ``k`` largest deviations. Ties keep the earlier token.

    A stable descending sort, not ``torch.topk``: topk breaks ties in no promised order."""
    k = max(0, min(k, dev.shape[0]))
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=dev.device)
    top = torch.sort(dev, descending=True, stable=True).indices[:k]  # (k,) equal values by position
    return top.sort().values


def kept_count(ratio: float, n_candidates: int) -> int:
    """How many of ``n_candidates`` document tokens a ratio keeps (rounded to nearest)."""
    return int(round(ratio * n_candidates))


class SelectionDetail(NamedTuple):
    """Which candidates one selection ranked, what it chose, and the deviation it measured,
    token by token: what a request that asks to explain its blend is shown. Tensors the
    selection computed anyway, left on the model's device (nothing is copied unless read)."""

    positions: torch.Tensor  # (T,) the candidates' prompt positions, ascending
    scores: torch.Tensor  # (T,) the score that ranked them (deviation, question attention, hybrid rank)
    chosen: torch.Tensor  # (K,) indices into ``positions`` of the tokens chosen for recompute
    measured: torch.Tensor  # (M,) prompt positions whose deviation was measured at the stats' layer
    deviation: torch.Tensor  # (M,)
    forced: torch.Tensor | None = None  # (N,) bool: positions chosen before any score (the shift's sample)


class SelectionStats(NamedTuple):
    """What one check layer saw and kept: for request stats and the quality guard.

    The score and span fields are tensors left on the model's device, so that fusion
    never waits for the device to report them; read them (``float``, ``tolist``) after."""

    layer: int
    candidates: int  # cached document tokens still active at this layer
    kept: int
    mean_score: torch.Tensor  # () deviation over the candidates (0 when there are none)
    max_score: torch.Tensor  # ()
    kept_per_span: torch.Tensor  # (S,) kept tokens inside each (start, end) span, in order
    detail: SelectionDetail | None = None  # token by token (the engine reads it only to explain a request)


def selection_stats(
    layer: int, dev: torch.Tensor, kept_positions: torch.Tensor, spans: Sequence[tuple[int, int]]
) -> SelectionStats:
    """Summarise a check: ``dev`` (T,) deviations of the candidates, ``kept_positions``
    (K,) prompt positions kept, ``spans`` the documents' [start, end) position ranges."""
    n = dev.shape[0]
    mean, top = (dev.mean(), dev.max()) if n else (dev.new_zeros(()), dev.new_zeros(()))
    bounds = torch.tensor(spans, dtype=torch.long).reshape(-1, 2).to(kept_positions.device)  # (S, 2)
    pos = kept_positions[:, None]  # (K, 1)
    inside = (pos >= bounds[:, 0]) & (pos < bounds[:, 1])  # (K, S)
    return SelectionStats(layer, n, kept_positions.shape[0], mean, top, inside.sum(0))
