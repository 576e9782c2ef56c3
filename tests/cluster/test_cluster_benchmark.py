"""benchmarks/cluster.py: its per-router figures and the final line (no Ray, no model)."""

from __future__ import annotations

import math

import pytest
from tests.benchmarks import load_benchmark

bc = load_benchmark("cluster")


Row = tuple[str, str | None, list[str], tuple[int, ...]]  # status, replica, document sources, passages


def _make(router: str, rows: list[Row]):
    """A phase whose i-th request had TTFT 1 + 2i s and 100 tokens per document."""
    outcomes = [bc.Outcome(status, 1.0 + 2 * i, [(s, 100) for s in sources], replica=replica)
                for i, (status, replica, sources, _) in enumerate(rows)]
    return bc.Phase(router, outcomes, wall_s=10.0, ready_s=1.0, passages=[r[3] for r in rows])


def _phase(router: str, rows: list[Row], warmup: int = 1) -> dict:
    return _make(router, rows).figures(warmup)


def test_figures_count_memory_hits_of_measured_requests_and_placement() -> None:
    f = _phase("affinity", [
        ("ok", "r1", ["computed", "computed"], (0, 1)),  # warm-up: not in the rates
        ("ok", "r1", ["memory", "computed"], (0, 2)),
        ("ok", "r2", ["memory", "empty"], (3, 4)),
        ("lost", None, [], (0, 1)),
        ("ok", "r1", ["memory", "memory"], (0, 1)),
    ])
    assert f["hit_rate"] == 0.8 and f["sources"] == {"computed": 1, "memory": 4}  # "empty" is no document
    assert (f["ok"], f["lost"], f["measured"]) == (4, 1, 4)
    assert f["requests_per_replica"] == [3, 1]
    assert f["replicas_per_passage"] == 1.0  # passages 0 and 1 were asked again, always on r1
    assert f["throughput_req_s"] == 0.4


def test_the_final_line_carries_both_routers_and_their_ratios() -> None:
    plan = bc.Plan(requests=4, warmup=0)
    phases = {
        "affinity": _make("affinity", [("ok", "r1", ["memory"], (0,)), ("ok", "r1", ["memory"], (0,))]),
        "default": _make("default", [("ok", "r1", ["memory"], (0,)), ("ok", "r2", ["computed"], (0,))]),
    }
    out = bc.result(phases, plan)
    assert (out["affinity_hit_rate"], out["default_hit_rate"], out["hit_rate_ratio"]) == (1.0, 0.5, 2.0)
    assert out["lost_requests"] == 0 and out["p95_ttft_ratio"] == 1.0
    assert out["phases"]["default"]["replicas_per_passage"] == 2.0
    assert not math.isnan(out["affinity_p95_ttft_s"])


def test_plans_must_not_fit_one_replica_but_fit_two() -> None:
    with pytest.raises(ValueError, match="memory_fraction"):
        bc.Plan(memory_fraction=1.0)
    with pytest.raises(ValueError, match="memory_fraction"):
        bc.Plan(memory_fraction=0.5)
    with pytest.raises(ValueError):
        bc.Plan(requests=10, warmup=10)
    assert bc.Plan.quick().requests < bc.Plan().requests


def test_dump_writes_each_request_with_its_passages_and_block(tmp_path) -> None:
    import json

    phase = _make("affinity", [("ok", "r1", ["memory"], (3, 5)), ("lost", None, [], (1,))])
    phase.outcomes[0].block.update({"queue_s": 2.5, "doc_misses": 0})
    path = tmp_path / "dump.jsonl"
    bc.dump(str(path), phase)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["router"], r["i"], r["passages"], r["status"]) for r in rows] == [
        ("affinity", 0, [3, 5], "ok"), ("affinity", 1, [1], "lost")]
    assert rows[0]["block"]["queue_s"] == 2.5 and rows[0]["ttft_s"] == 1.0 and rows[1]["sent_s"] is None  # NaN: not sent timed


@pytest.mark.parametrize("flag, want", [([], False), (["--recompute-misses", "false"], False),
                                        (["--recompute-misses", "TRUE"], True)])
def test_recompute_misses_reaches_the_replicas_settings(flag: list[str], want: bool) -> None:
    from kvblend.settings import Settings

    args, _ = bc.parse_args(["--quick", *flag])
    overrides = bc.settings_for("smollm2-135m", 1 << 20, "/tmp/x", args.recompute_misses)
    settings = Settings.load(**overrides)
    assert settings.blend.recompute_misses is want and settings.blend.blend_config().recompute_misses is want


def test_the_lru_estimate_matches_its_closed_forms_and_bounds_the_ratio() -> None:
    """Che's approximation: with equal popularity and sizes an LRU tier holding a fraction f
    of the passages hits f of the time; a pool that fits hits always; skew raises it."""
    uniform = [(i, (i + 1) % 10) for i in range(0, 10, 2)] * 40  # ten passages, each looked up 40 times
    assert bc.lru_hit_estimate(uniform, [100] * 10, 600) == pytest.approx(0.6, abs=1e-6)
    assert bc.lru_hit_estimate(uniform, [100] * 10, 1000) == 1.0
    skewed = [(0, 1)] * 30 + [(2, 3)] * 5 + [(4, 5), (6, 7), (8, 9)] * 2
    assert 0.6 < bc.lru_hit_estimate(skewed, [100] * 10, 600) < 1.0
    assert math.isnan(bc.lru_hit_estimate([], [100] * 10, 600))
    out = bc.result({}, bc.Plan(), 0.78)
    assert (out["default_hit_rate_lru_estimate"], out["hit_rate_ratio_ceiling"]) == (0.78, round(1 / 0.78, 3))
