"""benchmarks/serve.py: the load ladder's pure parts, and one smoke run on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


bs = _load()


def search(threshold: float, plan, start: float) -> tuple[list[tuple[float, bool]], str]:
    """Run next_load, then refine_load, against a server that sustains every load <= threshold."""
    history: list[tuple[float, bool]] = []
    while True:
        load, end = bs.next_load(history, plan, start)
        if load is None:
            break
        history.append((load, load <= threshold))
    load = bs.refine_load(history, plan)
    if load is not None:
        history.append((load, load <= threshold))
        assert bs.refine_load(history, plan) is None  # once
    return history, end


@pytest.mark.parametrize("start", [0.6, 0.1, 2.0])
@pytest.mark.parametrize("threshold", [0.13, 0.31, 0.5, 0.9])
def test_search_brackets_the_threshold_to_half_a_factor(threshold: float, start: float) -> None:
    plan = bs.Plan(max_steps=10)
    history, end = search(threshold, plan, start)
    found = bs.sustained_load(history)
    lo, hi = bs.bracket(history)
    assert end == "bracketed" and lo == found
    assert found <= threshold < hi <= found * math.sqrt(plan.factor) * 1.001
    # the search walks from start to the threshold, flips once, then one bisection step
    assert len(history) <= abs(math.log(start / threshold, plan.factor)) + 3


def test_search_without_refine_stops_at_the_first_flip() -> None:
    plan = bs.Plan(refine=False)
    history, end = search(0.31, plan, 0.6)
    assert end == "bracketed" and [ok for _, ok in history] == [False, False, True]
    assert bs.sustained_load(history) == pytest.approx(0.6 / 2)
    assert bs.bracket(history) == (pytest.approx(0.3), pytest.approx(0.6 / math.sqrt(2)))


def test_search_ends_at_the_floor_or_after_max_steps() -> None:
    history, end = search(0.01, bs.Plan(max_steps=10), 0.6)
    assert end == "floor" and bs.sustained_load(history) == 0.0
    assert bs.Plan().f_min * 0.999 <= min(f for f, _ in history) < bs.Plan().f_min * bs.Plan().factor
    history, end = search(100.0, bs.Plan(max_steps=3), 0.6)
    assert end == "max_steps" and len(history) == 3 and all(ok for _, ok in history)
    assert bs.refine_load(history, bs.Plan()) is None  # no fail above: nothing to bisect


def test_step_times_are_one_pattern_in_units_of_each_methods_service_time() -> None:
    plan = bs.Plan(min_step_s=0.0)
    pattern = bs.unit_arrivals(plan.max_arrivals, seed=0)
    slow, fast = bs.step_times(pattern, 0.5, 4.0, plan), bs.step_times(pattern, 0.5, 1.0, plan)
    assert len(slow) == len(fast) == plan.warmup + plan.arrivals
    assert slow == pytest.approx([4 * t for t in fast])
    # the same load in units of S is the same number of arrivals per service time
    assert len(fast) / fast[-1] == pytest.approx(0.5 / 1.0 * len(fast) / pattern[len(fast) - 1])


def test_step_times_span_the_minimum_duration_up_to_max_arrivals() -> None:
    plan = bs.Plan(min_step_s=30.0)
    pattern = bs.unit_arrivals(plan.max_arrivals, seed=1)
    times = bs.step_times(pattern, 1.0, 0.5, plan)  # 2 req/s: 22 arrivals span ~11 s
    assert times[-1] >= 30.0 and times[-2] < 30.0
    assert len(bs.step_times(pattern, 1.0, 0.01, plan)) == plan.max_arrivals


def test_allowed_late_matches_the_nearest_rank_p95() -> None:
    rng = random.Random(0)
    for n in (1, 6, 16, 19, 20, 21, 40, 41):
        for _ in range(50):
            xs = [rng.random() for _ in range(n)]
            limit = rng.random()
            assert (bs.pct(xs, 95) <= limit) == (sum(x > limit for x in xs) <= bs.allowed_late(n))
    assert bs.allowed_late(20) == 1 and bs.allowed_late(16) == 0


def _step(ttfts: list[float], statuses: list[str] | None = None, warmup: int = 1) -> object:
    statuses = statuses or ["ok"] * len(ttfts)
    step = bs.Step(load=0.5, rate=0.5, warmup=warmup, planned=len(ttfts))
    step.samples = [bs.Sample(s, t, t + 1.0, 32) for s, t in zip(statuses, ttfts)]
    return step


def test_passes_needs_p95_within_twice_s_and_every_request_ok() -> None:
    assert bs.passes(_step([9.0] + [1.0] * 20), 1.0)  # the warm-up arrival is not measured
    assert bs.passes(_step([1.0] * 20 + [2.5]), 1.0)  # one late of 20: p95 is the 19th
    assert not bs.passes(_step([1.0] * 19 + [2.5, 2.5]), 1.0)
    assert not bs.passes(_step([1.0] * 21, ["rejected"] + ["ok"] * 20), 1.0)
    assert not bs.passes(_step([1.0] * 21, ["ok"] * 20 + ["lost"]), 1.0)
    short = _step([1.0] * 21)
    short.planned = 22  # stopped before its last arrival
    assert not bs.passes(short, 1.0)


def test_a_flight_is_late_once_its_wait_passes_the_limit() -> None:
    f = bs.Flight(sent=10.0)
    assert not f.late(11.9, 2.0) and f.late(12.1, 2.0)
    f.first = 11.5
    assert not f.late(100.0, 2.0)
    f.sample = bs.Sample("rejected")
    assert f.late(10.0, 2.0)


def test_ratios_use_absolute_rates_and_say_none_without_a_pass() -> None:
    blend = bs.Ladder(history=[(0.6, False), (0.42, True)])  # S = 1 s: sustains 0.42 req/s, fails 0.6
    full = bs.Ladder(history=[(0.6, True), (0.85, False)])  # S = 4 s: sustains 0.15 req/s, fails 0.2125
    assert bs._ratio(0.42 / 1.0, 0.6 / 4.0) == pytest.approx(2.8)
    assert bs._ratio_bounds(blend, full, 1.0, 4.0) == [pytest.approx(0.42 / 0.2125, abs=1e-3),
                                                        pytest.approx(0.6 / 0.15, abs=1e-3)]
    assert bs._ratio(0.0, 0.15) is None and bs._ratio(0.42, 0.0) is None
    assert bs._ratio_bounds(bs.Ladder(history=[(0.6, False)]), full, 1.0, 4.0) == [None, pytest.approx(4.0)]


def test_plan_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        bs.Plan(arrivals=0)
    with pytest.raises(ValueError):
        bs.Plan(factor=1.0)
    with pytest.raises(ValueError):
        bs.Plan(warmup=5, arrivals=20, max_arrivals=24)


def test_quick_run_end_to_end_on_the_tiny_model(tiny_model_dir) -> None:
    """The whole benchmark against a real server: one JSON line, nothing lost, every
    rate on one scale (load / the method's unloaded TTFT)."""
    cmd = [sys.executable, str(SCRIPT), "--quick", "--model", tiny_model_dir, "--arrivals", "3", "--min-step-s", "0.5",
           "--max-steps", "2", "--budget-min", "3", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("blend_over_full_rate", "prefix_over_full_rate", "decode_batch8_over_1", "lost_requests"):
        assert key in result
    assert result["lost_requests"] == 0
    assert set(result["p95_ttft_s"]) == set(result["ladder"]) == {"full", "prefix", "blend"}
    for m, steps in result["ladder"].items():
        s = result["unloaded_ttft_s"][m]
        assert steps and all(st["rate"] == pytest.approx(st["load"] / s, rel=1e-3) for st in steps)
        assert result["sustained_rate_req_s"][m] == pytest.approx(result["sustained_load"][m] / s, rel=1e-3)
        assert result["search_end"][m] in ("bracketed", "max_steps", "floor", "budget")
        lo, hi = result["bracket_rate_req_s"][m]
        assert (lo or 0.0) == pytest.approx(result["sustained_rate_req_s"][m]) and (hi is None or hi > (lo or 0.0))
