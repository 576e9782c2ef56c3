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


def test_each_timed_blend_recomputes_what_it_names(bench) -> None:
    # ``prefix`` once ran under the blends' tenant: its whole prompt then served the next
    # method as an exact prefix hit, and every blend "took" 0.025x full prefill, computing nothing
    from types import SimpleNamespace

    from kvblend.engine import Engine
    from tests.conftest import make_loaded

    eng = Engine(make_loaded(max_position_embeddings=4096), self_check=False, calibrate=False)
    words = [w for w in eng.tokenizer.get_vocab() if w.isalpha()]  # the tiny tokenizer's own words
    docs = [" ".join(words[(i * i + 7 * d) % len(words)] for i in range(1100)) for d in range(6)]
    examples = [SimpleNamespace(documents=docs, question="which city ?")]
    _, _, recomputed, _ = bench.ttft_section(eng, examples, 0.15, repeats=1)
    assert recomputed["full"] == 1.0 and recomputed["prefix"] > 0.9
    assert recomputed["blend"] >= 0.15 and recomputed["cacheblend"] >= 0.15
    assert recomputed["reuse"] < 0.05
