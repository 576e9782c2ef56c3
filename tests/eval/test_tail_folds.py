"""benchmarks/tail.py --folds: figures from held-out folds, never from the questions a
policy was chosen on (issue #44)."""

from __future__ import annotations

from tests.benchmarks import load_benchmark

bt = load_benchmark("tail")
A, B = "blend:0.15:q+budget", "blend:0.15:q+sinks4"


def rec(i: int, method: str, kl: float, risk: float | None = None) -> dict:
    row = {"id": f"musique_dev-{i}", "method": method, "kl": kl, "recompute_frac": 0.15}
    if risk is not None:
        row["pass_kl"], row["strategy"] = None, None
        row["risk"] = risk
    return row


def test_one_fixed_policy_pools_to_its_plain_figures() -> None:
    records = [rec(i, "reuse", 1.0) for i in range(20)] + [rec(i, A, 0.1 + 0.01 * i) for i in range(20)]
    line = bt.folds(records, None, [A], [None], 5)
    assert line["n"] == 20 and line["chosen"] == [A] * 5
    assert line["mean_ratio"] == round(sum(0.1 + 0.01 * i for i in range(20)) / 20, 3)
    assert line["max_ratio"] == 0.29 and line["worse_than_reuse"] == 0


def test_a_choice_is_scored_only_on_questions_it_was_not_chosen_on() -> None:
    """B is perfect on four questions and worse than A on the rest: chosen on training folds
    rich in those four, and then scored on held-out ones that are not; the pooled figure is
    what a brute-force replay of the same folds gives, and no better than A alone."""
    records = [rec(i, "reuse", 1.0) for i in range(10)]
    records += [rec(i, A, 0.2) for i in range(10)]
    records += [rec(i, B, 0.0 if i < 4 else 0.35) for i in range(10)]
    line = bt.folds(records, None, [A, B], [None], 5, seed=1)
    kl = {(r["id"], r["method"]): r["kl"] for r in records}
    qids = [f"musique_dev-{i}" for i in range(10)]
    import torch
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    parts = [[qids[j] for j in order[f::5]] for f in range(5)]
    held, chosen = [], []
    for f, part in enumerate(parts):
        train = [q for g, p in enumerate(parts) if g != f for q in p]
        best = min((A, B), key=lambda m: sum(kl[(q, m)] for q in train))
        chosen.append(best)
        held += [kl[(q, best)] for q in part]
    assert line["chosen"] == chosen and B in chosen  # B wins some training folds
    assert line["mean_ratio"] == round(sum(held) / 10, 3) >= 0.2


def test_escalation_takes_the_doubled_record_above_the_windows_quantile() -> None:
    wide = bt.doubled(A)
    rows = {f"musique_dev-{i}": {"reuse": rec(i, "reuse", 1.0), A: rec(i, A, 0.5, risk=i / 20),
                                 wide: rec(i, wide, 0.1)} for i in range(20)}
    served = bt.served_under((A, 0.9), rows)
    escalated = [i for i, r in served.items() if r["method"] == wide]
    assert sorted(escalated) == ["musique_dev-18", "musique_dev-19"]  # above the 0.9 quantile of 0, 0.05, ... 0.95
    # the threshold comes from the window given: a window of low risks escalates everything above them
    low = {k: {m: ({**r, "risk": 0.0} if m == A else r) for m, r in v.items()} for k, v in rows.items()}
    assert len([r for r in bt.served_under((A, 0.9), rows, window=low).values() if r["method"] == wide]) == 19


def test_the_moved_risk_ranks_shift_blends_by_how_little_they_moved_from_reuse() -> None:
    # --risk moved: exp(-pass_kl) for every question-selected blend, the shift's too; the
    # engine's kind keeps the shift's own risk ((1 - ratio) x shift_left)
    shifted = {"id": "musique_dev-0", "method": "blend:0.15:q+shift", "kl": 0.1, "recompute_frac": 0.15,
               "strategy": "question+shift", "pass_kl": 0.5, "shift_left": 0.4}
    assert bt.with_risk(shifted)["risk"] == 0.85 * 0.4
    assert abs(bt.with_risk(shifted, "moved")["risk"] - 0.6065306597) < 1e-9
    assert bt.with_risk({**shifted, "pass_kl": None}, "moved")["risk"] is None


def test_with_a_p90_goal_the_cheapest_policy_meeting_it_is_chosen() -> None:
    # A (15 % recomputed) misses a p90 of 0.3 on every fold, C (30 %) meets it, D (50 %)
    # meets it with a lower mean: the goal picks C, the mean alone D
    C, D = "blend:0.3:q+budget", "blend:0.5:q+budget"
    records = [rec(i, "reuse", 1.0) for i in range(20)]
    records += [rec(i, A, 0.1 if i % 5 else 0.6) for i in range(20)]
    records += [{**rec(i, C, 0.2), "recompute_frac": 0.3} for i in range(20)]
    records += [{**rec(i, D, 0.1), "recompute_frac": 0.5} for i in range(20)]
    assert bt.folds(records, None, [A, C, D], [None], 5)["chosen"] == [D] * 5
    line = bt.folds(records, None, [A, C, D], [None], 5, p90_goal=0.3)
    assert line["chosen"] == [C] * 5 and line["p90_ratio"] == 0.2 and line["recompute_frac"] == 0.3
