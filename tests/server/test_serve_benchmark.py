"""benchmarks/serve.py: the goodput search's pure parts, the SLO test of a step, and one
smoke run on the tiny model."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
from tests.benchmarks import BENCHMARKS, load_benchmark

bs = load_benchmark("serve")
SCRIPT = BENCHMARKS / "serve.py"


def search(threshold: float, plan, start: float, floor: float = 0.01) -> tuple[list[tuple[float, bool]], str]:
    """Run next_rate against a server that meets the SLO at every rate <= threshold."""
    history: list[tuple[float, bool]] = []
    while True:
        rate, end = bs.next_rate(history, plan, start, floor)
        if rate is None:
            return history, end
        history.append((rate, rate <= threshold))


@pytest.mark.parametrize("start", [0.6, 0.1, 2.0])
@pytest.mark.parametrize("threshold", [0.13, 0.31, 0.5, 0.9, 1.7])
def test_search_brackets_the_goodput_within_the_resolution(threshold: float, start: float) -> None:
    plan = bs.Plan(max_steps=20)
    history, end = search(threshold, plan, start)
    lo, hi = bs.bracket(history)
    assert end == "bracketed" and lo == bs.goodput(history)
    assert lo <= threshold < hi <= lo * plan.resolution * 1.001
    # the search walks by factor 2 to the threshold, then halves the bracket's log-width to 1.2
    walk = math.ceil(abs(math.log(start / threshold, plan.factor)))
    assert len(history) <= walk + 1 + math.ceil(math.log2(math.log(plan.factor) / math.log(plan.resolution)))


def test_the_default_plan_settles_in_a_few_steps() -> None:
    """Start at half the unloaded rate: a goodput between 0.25x and 4x that start takes at most 6 steps."""
    plan = bs.Plan()
    for threshold in (0.3, 0.5, 0.9, 1.5, 2.9):
        history, end = search(threshold, plan, 0.5)
        assert end == "bracketed" and len(history) <= plan.max_steps, (threshold, history)


def test_search_ends_at_the_floor_or_after_max_steps() -> None:
    history, end = search(0.001, bs.Plan(max_steps=10), 0.6, floor=0.05)
    assert end == "floor" and bs.goodput(history) == 0.0
    assert 0.05 * 0.999 <= min(r for r, _ in history) < 0.05 * 2
    history, end = search(100.0, bs.Plan(max_steps=3), 0.6)
    assert end == "max_steps" and len(history) == 3 and all(ok for _, ok in history)
    assert bs.bracket(history)[1] is None  # no fail above: nothing to bisect


def test_a_coarse_resolution_stops_at_the_first_flip() -> None:
    plan = bs.Plan(resolution=2.0)
    history, end = search(0.31, plan, 0.6)
    assert end == "bracketed" and [ok for _, ok in history] == [False, True]
    assert bs.bracket(history) == (pytest.approx(0.3), pytest.approx(0.6))


def test_step_times_are_one_pattern_at_every_rate() -> None:
    plan = bs.Plan(min_step_s=0.0)
    pattern = bs.unit_arrivals(plan.max_arrivals, seed=0)
    slow, fast = bs.step_times(pattern, 0.25, plan), bs.step_times(pattern, 1.0, plan)
    assert len(slow) == len(fast) == plan.warmup + plan.arrivals
    assert slow == pytest.approx([4 * t for t in fast])
    assert fast == pytest.approx(pattern[:len(fast)])  # rate 1: the unit pattern itself


def test_step_times_span_the_minimum_duration_up_to_max_arrivals() -> None:
    plan = bs.Plan(min_step_s=20.0)
    pattern = bs.unit_arrivals(plan.max_arrivals, seed=1)
    times = bs.step_times(pattern, 2.0, plan)  # 2 req/s: 22 arrivals span ~11 s, ~40 span 20 s
    assert times[-1] >= 20.0 and times[-2] < 20.0 and len(times) > plan.warmup + plan.arrivals
    assert len(bs.step_times(pattern, 100.0, plan)) == plan.max_arrivals


def test_allowed_late_matches_the_nearest_rank_p95() -> None:
    rng = random.Random(0)
    for n in (1, 6, 16, 19, 20, 21, 40, 41, 620):
        for _ in range(50):
            xs = [rng.random() for _ in range(n)]
            limit = rng.random()
            assert (bs.pct(xs, 95) <= limit) == (sum(x > limit for x in xs) <= bs.allowed_late(n))
    assert bs.allowed_late(20) == 1 and bs.allowed_late(16) == 0


def _step(ttfts: list[float], statuses: list[str] | None = None, warmup: int = 1,
          gaps: list[list[float]] | None = None) -> object:
    statuses = statuses or ["ok"] * len(ttfts)
    gaps = gaps or [[0.1] * 31] * len(ttfts)
    step = bs.Step(rate=0.5, warmup=warmup, planned=len(ttfts))
    step.samples = [bs.Sample(s, t, t + 1.0, 32, gaps=g) for s, t, g in zip(statuses, ttfts, gaps)]
    return step


SLO = bs.Slo(ttft_s=2.0, itl_s=0.5)


def test_a_step_passes_with_both_p95s_within_the_one_slo_and_every_request_ok() -> None:
    assert bs.passes(_step([9.0] + [1.9] * 20), SLO)  # the warm-up arrival is not measured
    assert bs.passes(_step([1.0] * 20 + [2.5]), SLO)  # one late of 20: p95 is the 19th
    assert not bs.passes(_step([1.0] * 19 + [2.5, 2.5]), SLO)
    for status in ("rejected", "error", "lost", "abandoned"):
        assert not bs.passes(_step([1.0] * 21, [status] + ["ok"] * 20), SLO)
    short = _step([1.0] * 21)
    short.planned = 22  # stopped before its last arrival
    assert not bs.passes(short, SLO)


def test_p95_itl_pools_the_gaps_of_the_measured_requests() -> None:
    stall = [0.1] * 30 + [3.0]  # one stall per stream: 1 gap in 31 > 5 %? no: 20 of 620
    assert bs.passes(_step([1.0] * 21, gaps=[[0.1] * 31] * 21), SLO)
    step = _step([1.0] * 21, gaps=[[9.0] * 31] + [stall] * 20)  # the warm-up's gaps do not count
    assert step.p95_itl() == pytest.approx(0.1) and bs.passes(step, SLO)
    bad = _step([1.0] * 21, gaps=[[0.1] * 28 + [3.0] * 3] * 21)  # 3 of 31 gaps stalled: ~10 %
    assert bad.p95_itl() == pytest.approx(3.0) and not bs.passes(bad, SLO)


def test_token_gaps_and_the_late_checks_of_a_flight() -> None:
    assert bs.token_gaps([1.0, 1.5, 1.75, 3.0]) == pytest.approx([0.5, 0.25, 1.25])
    assert bs.token_gaps([1.0]) == []
    f = bs.Flight(sent=10.0)
    assert not f.late(11.9, 2.0) and f.late(12.1, 2.0)
    f.times = [11.5, 11.6, 13.0, 13.1]
    assert not f.late(100.0, 2.0) and f.late_gaps(1.0) == 1 and f.late_gaps(0.05) == 3
    f.sample = bs.Sample("rejected")
    assert f.late(10.0, 2.0)


def test_only_a_429_or_an_openai_shaped_error_is_not_lost() -> None:
    assert bs._http_error(429, b"{}", "3").status == "rejected"
    assert bs._http_error(503, b'{"error": {"message": "draining", "code": 503}}', "").status == "error"
    assert bs._http_error(500, b"Internal Server Error", "").status == "lost"
    assert bs._http_error(502, b'{"detail": "x"}', "").status == "lost"


def test_ratios_compare_goodputs_and_say_none_without_a_pass() -> None:
    blend = bs.Ladder(history=[(0.6, True), (1.2, False), (0.85, True)])  # meets the SLO at 0.85, not 1.2
    full = bs.Ladder(history=[(0.25, True), (0.5, False), (0.35, False)])  # at 0.25, not 0.35
    assert bs._ratio(bs.goodput(blend.history), bs.goodput(full.history)) == pytest.approx(3.4)
    assert bs._ratio_bounds(blend, full) == [pytest.approx(0.85 / 0.35, abs=1e-3), pytest.approx(1.2 / 0.25)]
    assert bs._ratio(0.0, 0.15) is None and bs._ratio(0.42, 0.0) is None
    assert bs._ratio_bounds(bs.Ladder(history=[(0.6, False)]), full) == [None, pytest.approx(0.6 / 0.25)]


def test_plan_and_slo_reject_bad_values() -> None:
    for bad in ({"arrivals": 0}, {"factor": 1.0}, {"resolution": 1.0},
                {"warmup": 5, "arrivals": 20, "max_arrivals": 24}):
        with pytest.raises(ValueError):
            bs.Plan(**bad)
    with pytest.raises(ValueError):
        bs.Slo(ttft_s=0.0)


def test_the_default_ttft_slo_is_twice_the_slowest_methods_unloaded_ttft() -> None:
    """One SLO for every method, from this run's slowest unloaded TTFT unless one is given."""
    assert bs.Slo().for_run([0.7, 3.0]) == bs.Slo(ttft_s=6.0)
    assert bs.Slo(ttft_s=4.0).for_run([0.7, 3.0]) == bs.Slo(ttft_s=4.0)


def test_quick_run_end_to_end_on_the_tiny_model(tiny_model_dir) -> None:
    """The whole benchmark against a real server: one JSON line, nothing lost, one SLO for
    every method, goodputs from the steps that passed."""
    cmd = [sys.executable, str(SCRIPT), "--quick", "--model", tiny_model_dir, "--arrivals", "3", "--min-step-s", "0.5",
           "--max-steps", "2", "--budget-min", "3", "--threads", "1", "--methods", "full,prefix,blend",
           "--slo-ttft-s", "5", "--slo-itl-s", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("blend_over_full_rate", "prefix_over_full_rate", "decode_batch8_over_1", "lost_requests"):
        assert key in result
    assert result["lost_requests"] == 0
    assert result["slo"] == {"p95_ttft_s": 5.0, "p95_itl_s": 2.0}
    assert set(result["goodput_req_s"]) == set(result["ladder"]) == {"full", "prefix", "blend"}
    for m, steps in result["ladder"].items():
        assert steps and result["search_end"][m] in ("bracketed", "max_steps", "floor", "budget")
        passed = [st["rate"] for st in steps if not st["stopped_early"] and st["rejected"] == st["lost"] == 0
                  and st["ttft_p95_s"] <= 5.0 and (st["itl_p95_s"] or 0.0) <= 2.0]
        assert result["goodput_req_s"][m] == pytest.approx(max(passed, default=0.0), rel=1e-3)
        lo, hi = result["bracket_rate_req_s"][m]
        assert (lo or 0.0) == pytest.approx(result["goodput_req_s"][m]) and (hi is None or hi > (lo or 0.0))


def test_tokens_are_counted_per_token_with_continuous_usage_and_per_text_chunk_without() -> None:
    """A token without text still counts when the chunk carries the running usage (so a run
    of such tokens is not timed as one long gap); without usage only text or the finish
    counts, and neither the role chunk nor the final usage chunk is a token."""
    def chunk(text, done=None, tokens=None):
        c = {"choices": [{"delta": {"content": text}, "finish_reason": done}]}
        return {**c, "usage": {"completion_tokens": tokens, "prompt_tokens": 5}} if tokens is not None else c

    continuous = [chunk("", tokens=0), chunk("a", tokens=1), chunk("", tokens=2), chunk("", tokens=3),
                  chunk("b", "length", tokens=4), {"choices": [], "usage": {"completion_tokens": 4}}]
    seen, counts = 0, []
    for c in continuous:
        counts.append(bs._tokens_in(c, seen))
        seen += counts[-1]
    assert counts == [0, 1, 1, 1, 1, 0]
    assert [bs._tokens_in(c, 0) for c in (chunk(""), chunk("a"), chunk("", "stop"), {"choices": []})] == [0, 1, 1, 0]


def test_a_slower_method_gets_a_larger_share_of_the_ladder_budget() -> None:
    """Steps last about (warmup + arrivals) / rate and rates scale as 1 / TTFT: blend (0.7 s)
    before full (3 s) gets 0.7 / 3.7 of the time left, full all that blend leaves."""
    assert bs.ladder_share(370.0, [0.7, 3.0]) == pytest.approx(70.0)
    assert bs.ladder_share(300.0, [3.0]) == pytest.approx(300.0)


def test_host_steal_is_the_share_of_cpu_ticks_the_hypervisor_took(tmp_path) -> None:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal (ticks)."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 20 800 0 0 0 80 0 0\ncpu0 50 0 10 400 0 0 0 40 0 0\n")
    steal = bs.HostSteal(stat)
    stat.write_text("cpu  150 0 30 900 0 0 0 120 0 0\ncpu0 75 0 15 450 0 0 0 60 0 0\n")
    assert steal.share() == pytest.approx(40 / 200)  # 40 of the 200 ticks that passed were stolen
    assert bs.HostSteal(tmp_path / "missing").share() is None
    stat.write_text("intr 1 2 3\n")
    assert bs.HostSteal(stat).share() is None
