"""benchmarks/blend.py: what each timed name runs (the TTFT part itself is a benchmark, not a test)."""

from __future__ import annotations

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("blend")


def test_also_times_one_more_method_beside_the_default_blend(bench) -> None:
    specs = bench.blend_specs(0.15, None, "blend:0.3:q+budget+sinks4+shift")
    assert list(specs) == ["blend", "cacheblend", "also"]
    assert specs["blend"].blend.ratio == 0.15 and specs["also"].blend.ratio == 0.3
    assert specs["cacheblend"].blend.selection == "deviation" and specs["also"].blend.selection == "question"
    assert "also" not in bench.blend_specs(0.15, None)


def test_a_bad_method_fails_before_any_model_work(bench) -> None:
    with pytest.raises(ValueError):
        bench.blend_specs(0.15, "full")
    with pytest.raises(ValueError):
        bench.blend_specs(0.15, None, "blend:2")
