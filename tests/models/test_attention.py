"""Every attention plan equals attention with the exact causal mask."""

from __future__ import annotations

import pytest
import torch

from kvblend.models.attention import attend, attend_planned, causal_mask, plan_attention

N = 50


def reference(q, k, v, pos, window=None):
    return attend(q, k, v, causal_mask(pos, torch.arange(N), window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 3])
@pytest.mark.parametrize("case", ["all", "block-short-head", "block-long-head", "scattered", "from-zero",
                                  "windowed", "decode", "decode-windowed"])
def test_plan_matches_explicit_mask(case: str, heads_per_kv: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, N, 8, generator=g, dtype=dtype), torch.randn(2, N, 8, generator=g, dtype=dtype)
    pos = {
        "all": torch.arange(N),
        "block-short-head": torch.arange(10, N),
        "block-long-head": torch.arange(40, N),
        "scattered": torch.randperm(N, generator=g)[:17].sort().values,
        "from-zero": torch.tensor([0, 1, 4, 9, 10, 11, 30, 31, 49]),
        "windowed": torch.arange(5, N),
        "decode": torch.tensor([N - 1]),
        "decode-windowed": torch.tensor([N - 1]),
    }[case]
    window = 7 if case in ("windowed", "decode-windowed") else None
    q = torch.randn(2 * heads_per_kv, pos.shape[0], 8, generator=g, dtype=dtype)
    plan = plan_attention(pos, N, window, dtype, group_size=6, heads_per_kv=heads_per_kv)
    # Scattered queries: the split form on CPU for the flash kernel's dtypes, masked groups
    # otherwise (other dtypes, other devices, a sliding window that cuts the keys).
    scattered = "split" if dtype == torch.float32 and window is None else "groups"
    expected_kind = {"all": "causal", "block-short-head": "padded", "decode": "unmasked",
                     "decode-windowed": "tail"}.get(case, scattered)
    assert plan.kind == expected_kind
    assert torch.allclose(attend_planned(q, k, v, plan), reference(q, k, v, pos, window), atol=1e-5)


def test_split_groups_mask_only_from_their_first_query() -> None:
    pos = torch.tensor([20, 21, 25, 40, 44])
    plan = plan_attention(pos, N, None, torch.float32, group_size=3, heads_per_kv=2)
    assert plan.kind == "split"
    for grp in plan.groups:
        first, last = int(pos[grp.start]), int(pos[grp.end - 1])
        assert (grp.key_start, grp.key_end) == (first, last + 1)
        assert grp.mask.shape == (2 * (grp.end - grp.start), last + 1 - first)


def test_group_plan_rejects_other_head_grouping() -> None:
    pos = torch.tensor([3, 9, 20])
    plan = plan_attention(pos, N, None, torch.float32, heads_per_kv=2)
    k = v = torch.zeros(2, N, 8)
    with pytest.raises(ValueError, match="2 query heads per KV head"):
        attend_planned(torch.zeros(6, 3, 8), k, v, plan)


def _cost(runs, pos, call_cost):
    return sum((e - s) * (int(pos[e - 1]) + 1) + call_cost for s, e in runs)


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_optimal_against_brute_force(seed: int) -> None:
    import itertools

    from kvblend.models import attention

    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(4000, generator=g)[:9].sort().values
    runs = attention._partition(pos, max_rows=4)
    assert runs[0][0] == 0 and runs[-1][1] == len(pos)
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:])) and all(0 < e - s <= 4 for s, e in runs)
    best = None
    for cuts in itertools.product([0, 1], repeat=len(pos) - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [len(pos)]
        cand = list(zip(bounds, bounds[1:]))
        if all(e - s <= 4 for s, e in cand):
            c = _cost(cand, pos, attention.CALL_COST_PAIRS)
            best = c if best is None else min(best, c)
    assert _cost(runs, pos, attention.CALL_COST_PAIRS) == best


def test_partition_splits_distant_clusters() -> None:
    from kvblend.models import attention

    pos = torch.cat((torch.arange(100, 164), torch.arange(3000, 3064)))
    assert attention._partition(pos, max_rows=256) == [(0, 64), (64, 128)]
    assert attention._partition(torch.arange(5, 69), max_rows=256) == [(0, 64)]


def test_split_plan_in_bfloat16_matches_the_masked_reference() -> None:
    g = torch.Generator().manual_seed(3)
    pos = torch.randperm(N, generator=g)[:19].sort().values
    q, k, v = (torch.randn(h, t, 16, generator=g).bfloat16() for h, t in ((4, 19), (2, N), (2, N)))
    plan = plan_attention(pos, N, None, torch.bfloat16, group_size=5, heads_per_kv=2)
    assert plan.kind == "split"
    out = attend_planned(q, k, v, plan)
    assert out.dtype == torch.bfloat16
    expected = reference(q.float(), k.float(), v.float(), pos)
    assert torch.allclose(out.float(), expected, atol=3e-2)


def test_attention_over_cache_parts_refuses_more_than_one_query() -> None:
    """A forked cache's parts are attended unmasked, which is right for one query at the
    last position only: two queries are refused, also when a window leaves one part visible."""
    from kvblend.models.attention import attend_parts

    k, v = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    parts = [(k[:, :6], v[:, :6]), (k[:, 6:], v[:, 6:])]
    q = torch.randn(2, 1, 8)
    torch.testing.assert_close(attend_parts(q, parts, 9, None), attend(q, k, v), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attend_parts(q, parts, 9, 3), attend(q, k[:, 7:], v[:, 7:]), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="one query"):
        attend_parts(torch.randn(2, 2, 8), parts, 9, 3)
