"""benchmarks/interference.py: its statistics, prompts and arrival times, and one smoke
run on the tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from tests.benchmarks import BENCHMARKS, load_benchmark

bi = load_benchmark("interference")
SCRIPT = BENCHMARKS / "interference.py"


def _stream(steady: float, n_before: int, stall: float, n_after: int) -> list[float]:
    """Arrival times: ``n_before`` gaps of ``steady``, one ``stall``, ``n_after`` more of ``steady``."""
    times = [0.0]
    for g in [steady] * n_before + [stall] + [steady] * n_after:
        times.append(times[-1] + g)
    return times


def test_max_gap_is_over_the_median_of_the_steady_gaps_only() -> None:
    times = _stream(0.1, 20, 5.0, 20)
    fig = bi.gap_figures(times, (times[20], times[21]))  # the long request ran across the stall
    assert fig["max_gap_s"] == pytest.approx(5.0) and fig["median_gap_s"] == pytest.approx(0.1)
    assert fig["max_gap_over_median"] == pytest.approx(50.0)
    assert fig["gaps"] == 41 and fig["steady_gaps"] == 40 and fig["max_gap_start_s"] == pytest.approx(0.0)
    # a gap that overlaps the window by any amount is not steady
    assert bi.gap_figures(times, (times[20] - 0.01, times[21] + 0.01))["steady_gaps"] == 38


def test_slow_gaps_inside_the_busy_window_do_not_move_the_median() -> None:
    """Chunked prefill makes many gaps a little longer while the long request runs: the
    median still comes from the gaps before and after it."""
    times = [0.0]
    for g in [0.1] * 10 + [0.3] * 50 + [0.1] * 10:
        times.append(times[-1] + g)
    busy = (times[10], times[60])
    fig = bi.gap_figures(times, busy)
    assert fig["median_gap_s"] == pytest.approx(0.1) and fig["median_gap_all_s"] == pytest.approx(0.3)
    assert fig["max_gap_over_median"] == pytest.approx(3.0) and fig["steady_gaps"] == 20
    assert bi.gap_figures(times, None)["median_gap_s"] == pytest.approx(0.3)


def test_gap_figures_without_data_are_nan() -> None:
    fig = bi.gap_figures([1.0], None)
    assert fig["gaps"] == 0 and math.isnan(fig["max_gap_over_median"])
    times = _stream(0.1, 3, 1.0, 0)
    assert math.isnan(bi.gap_figures(times, (times[0], times[-1]))["max_gap_over_median"])  # no steady gap


def test_long_ttft_ratios_and_the_worst_one() -> None:
    ok = lambda t: bi.Sample("ok", t, t + 1.0, 4)  # noqa: E731
    unloaded, loaded = {3000: ok(10.0), 8000: ok(60.0)}, {3000: ok(12.0), 8000: ok(66.0)}
    ratios = bi.ttft_ratios(loaded, unloaded)
    assert ratios == {3000: pytest.approx(1.2), 8000: pytest.approx(1.1)} and bi.worst(ratios) == pytest.approx(1.2)
    loaded[8000] = bi.Sample("rejected")
    assert math.isnan(bi.worst(bi.ttft_ratios(loaded, unloaded)))  # no answer fails the goal


def test_arrival_times_are_bounded_and_at_the_asked_rate() -> None:
    times = bi.poisson_times(5.0, 100.0, seed=0, limit=10_000)
    assert all(0 < a < b < 100.0 for a, b in zip(times, times[1:]))
    assert 400 < len(times) < 600  # 500 expected; the sd is ~22
    assert len(bi.poisson_times(5.0, 100.0, seed=0, limit=50)) == 50
    assert bi.even_times(0.1, 100.0) == pytest.approx([5.0 + 10 * i for i in range(10)])
    assert bi.even_times(0.01, 20.0) == [10.0]  # at least one


def test_the_period_gives_light_its_requests_within_bounds() -> None:
    plan = bi.Plan(light_requests=16, period_min_s=30.0, period_max_s=100.0, max_heavy=800)
    assert bi.period_s(plan, 1.0) == pytest.approx(100.0)  # 160 s wanted
    assert bi.period_s(plan, 4.0) == pytest.approx(40.0)  # 16 / 0.4
    assert bi.period_s(plan, 20.0) == pytest.approx(8.0)  # heavy's 800 arrivals at 100/s bound it


def test_tally_and_count_by_status() -> None:
    samples = [bi.Sample("ok", 1.0), bi.Sample("ok", 3.0), bi.Sample("rejected"), bi.Sample("lost"),
               bi.Sample("error")]
    t = bi.tally(samples)
    assert (t["sent"], t["ok"], t["rejected"], t["error"], t["lost"]) == (5, 2, 1, 1, 1)
    assert t["ttft_p95_s"] == 3.0 and t["ttft_p50_s"] == 1.0 and bi.count(samples, "ok") == 2


def test_prompts_fit_their_token_count_and_never_share_a_prefix() -> None:
    from tests.conftest import make_tokenizer

    prompts = bi.Prompts(make_tokenizer(), seed=0)
    a, b = prompts.make(300), prompts.make(300)
    assert a != b and a.split(":")[0] != b.split(":")[0]
    for text in (a, b):
        assert 300 - 12 <= prompts.tokens(text) <= 300 + 2


def test_plan_rejects_bad_sizes() -> None:
    for bad in ({"long_tokens": ()}, {"lead_tokens": 0}, {"light_x": 6.0}, {"period_min_s": 300.0}):
        with pytest.raises(ValueError):
            bi.Plan(**bad)


def test_quick_run_end_to_end_on_the_tiny_model(tiny_model_dir) -> None:
    """The whole benchmark against a real server: one JSON line with the headline keys,
    nothing lost, the stream running before and after the long requests."""
    cmd = [sys.executable, str(SCRIPT), "--quick", "--model", tiny_model_dir, "--long-tokens", "300,900",
           "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("max_gap_over_median", "long_ttft_over_unloaded", "light_p95_over_unloaded", "light_429",
                "heavy_429", "lost_requests"):
        assert key in result
    assert result["lost_requests"] == 0 and result["error_requests"] == 0
    gap = result["gap"]
    assert gap["stream_outlived_long"] and gap["stream_status"] == "closed"
    assert gap["steady_gaps"] >= 2 * 16 - 2 and gap["max_gap_over_median"] >= 1.0
    assert set(result["long"]) == {"300", "900"}
    assert all(v["ratio"] is not None and v["prompt_tokens"] >= 300 for v in result["long"].values())
    fair = result["fair"]
    assert fair["light"]["sent"] >= 1 and fair["heavy"]["sent"] >= fair["light"]["sent"]
    assert fair["light"]["ok"] + fair["light"]["rejected"] == fair["light"]["sent"]
