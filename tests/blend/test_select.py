"""Deviation and top-k selection, on hand-made tensors."""

from __future__ import annotations

import torch

from kvblend.blend.select import deviation, kept_count, select_tokens


def test_deviation_sums_squared_error_over_heads_and_dims() -> None:
    cached = torch.zeros(2, 3, 4)
    fresh_v = torch.zeros(2, 3, 4)
    fresh_v[0, 1, 0], fresh_v[1, 1, 3], fresh_v[1, 2, 2] = 1.0, 2.0, 3.0
    fresh_k = torch.zeros(2, 3, 4)
    fresh_k[0, 0, 0] = 5.0
    assert deviation(fresh_k, fresh_v, cached, cached, "v").tolist() == [0.0, 5.0, 9.0]
    assert deviation(fresh_k, fresh_v, cached, cached, "k").tolist() == [25.0, 0.0, 0.0]
    assert deviation(fresh_k, fresh_v, cached, cached, "kv").tolist() == [25.0, 5.0, 9.0]


def test_select_tokens_returns_the_largest_sorted_by_position() -> None:
    dev = torch.tensor([0.1, 7.0, 0.3, 9.0, 2.0])
    assert select_tokens(dev, 2).tolist() == [1, 3]
    assert select_tokens(dev, 0).tolist() == []
    assert select_tokens(dev, 99).tolist() == [0, 1, 2, 3, 4]


def test_kept_count_rounds_the_ratio() -> None:
    assert [kept_count(r, 200) for r in (0.0, 0.15, 0.5, 1.0)] == [0, 30, 100, 200]


def test_selection_stats_count_kept_tokens_per_span() -> None:
    from kvblend.blend.select import selection_stats

    dev = torch.tensor([1.0, 5.0, 3.0, 0.0])
    stats = selection_stats(2, dev, torch.tensor([4, 11, 12]), [(3, 7), (10, 20), (20, 22)])
    assert stats.layer == 2 and stats.candidates == 4 and stats.kept == 3
    assert float(stats.mean_score) == 2.25 and float(stats.max_score) == 5.0
    assert stats.kept_per_span.tolist() == [1, 2, 0]
    empty = selection_stats(1, torch.empty(0), torch.empty(0, dtype=torch.long), [])
    assert empty[:3] == (1, 0, 0) and float(empty.mean_score) == float(empty.max_score) == 0.0
    assert empty.kept_per_span.tolist() == []


def test_ties_keep_the_earlier_tokens() -> None:
    assert torch.equal(select_tokens(torch.zeros(5000), 700), torch.arange(700))
    alternating = torch.tensor([1.0, 0.0] * 500)
    assert torch.equal(select_tokens(alternating, 100), torch.arange(0, 200, 2))
    mixed = torch.tensor([3.0] * 10 + [5.0] * 3 + [3.0] * 10)
    assert select_tokens(mixed, 8).tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
