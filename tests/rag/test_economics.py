"""Precompute economics: the share a blend hit still computes, and break-even hits."""

from __future__ import annotations

import pytest

from kvblend.rag.economics import estimate, recompute_share


def test_break_even_from_measured_costs():
    assert recompute_share(0.0, 30) == pytest.approx(1 / 30)
    assert recompute_share(1.0, 30) == pytest.approx(1.0)
    e = estimate(prefill_s=1.0, load_s=0.05, tokens=512, ratio=0.15, layers=30)
    assert e.saved_s == pytest.approx(1.0 * (1 - (1 + 0.15 * 29) / 30) - 0.05)
    assert e.break_even_hits == 2 and "pays for itself after 2 hit(s)" in e.describe()
    slow_load = estimate(prefill_s=0.1, load_s=0.2, tokens=512, ratio=0.15, layers=30)
    assert slow_load.break_even_hits is None and "does not pay" in slow_load.describe()
