"""benchmarks/traffic.py: the request sequence, the request bodies, the fresh home and the
report's arithmetic (no server, no model)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from tests.benchmarks import load_benchmark

bt = load_benchmark("traffic")


def test_the_sequence_is_the_seeds_and_zipf_popular() -> None:
    a = bt.draw_sequence(10, 3, 5000, 1.0, 0.3, "shuffled", seed=0)
    assert a == bt.draw_sequence(10, 3, 5000, 1.0, 0.3, "shuffled", seed=0)
    assert a != bt.draw_sequence(10, 3, 5000, 1.0, 0.3, "shuffled", seed=1)
    counts = Counter(d.question for d in a)
    harmonic = sum(1 / r for r in range(1, 11))
    assert counts[0] / 5000 == pytest.approx(1 / harmonic, abs=0.03)  # rank 1's share: 1 / H_10 = 0.341
    assert counts[1] / 5000 == pytest.approx(0.5 / harmonic, abs=0.03)
    assert counts[0] > counts[1] > counts[4] > counts[9] > 0
    assert sum(d.documents_field for d in a) / 5000 == pytest.approx(0.3, abs=0.03)
    assert all(sorted(d.order) == [0, 1, 2] for d in a) and len({d.order for d in a}) == 6


def test_the_share_and_the_order_leave_the_questions_alone() -> None:
    base = bt.draw_sequence(20, 4, 300, 1.1, 0.3, "shuffled", seed=7)
    other = bt.draw_sequence(20, 4, 300, 1.1, 0.0, "retrieved", seed=7)
    assert [d.question for d in base] == [d.question for d in other]
    assert all(d.order == (0, 1, 2, 3) and not d.documents_field for d in other)
    with pytest.raises(ValueError):
        bt.draw_sequence(20, 4, 3, 1.0, 0.3, "random", seed=0)


def test_zipf_weights_are_rank_to_the_minus_s() -> None:
    assert bt.zipf_weights(3, 2.0) == [1.0, 0.25, 1 / 9]


CORPUS = bt.Corpus(("Who?", "Where?"), (("P0a\n\n", "P0b\n\n"), ("P1a\n\n", "P1b\n\n")))


def test_a_plain_request_pastes_its_passages_and_a_documents_request_sends_them() -> None:
    plain = bt.chat_body("m", CORPUS, bt.Draw(1, (1, 0), False), 16)
    user = plain["messages"][1]["content"]
    assert "documents" not in plain and "kvblend" not in plain
    assert user.index("P1b") < user.index("P1a") < user.index("Question: Where?") and "P0a" not in user
    docs = bt.chat_body("m", CORPUS, bt.Draw(0, (0, 1), True), 16)
    assert docs["documents"] == ["P0a\n\n", "P0b\n\n"] and "P0a" not in docs["messages"][1]["content"]
    assert docs["messages"][0]["role"] == "system" and "Question: Who?" in docs["messages"][1]["content"]
    assert plain["stream"] and plain["stream_options"]["include_usage"] and plain["max_tokens"] == 16


def test_load_corpus_keeps_the_first_questions_and_passages(tmp_path: Path) -> None:
    ctxs = [{"title": f"T{i}", "text": f"text {i}"} for i in range(5)]
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"question": f"q{j}", "answers": ["a"], "ctxs": ctxs} for j in range(3)]))
    corpus = bt.load_corpus(path, questions=2, passages=3)
    assert corpus.questions == ("q0", "q1") and corpus.passages[1] == ("T0\n\ntext 0\n\n", "T1\n\ntext 1\n\n",
                                                                        "T2\n\ntext 2\n\n")


def _r(sent: float, ttft: float, prompt: int = 100, cached: int = 0, status: str = "ok", repeat: bool = False):
    return bt.Record(sent, status, ttft if status == "ok" else math.nan, prompt_tokens=prompt, cached_tokens=cached,
                     repeat=repeat, method="blend")


RECORDS = [_r(0, 4.0, 100, 0), _r(10, 3.0, 300, 30), _r(50, 0.0, 0, 0, "lost"),
           _r(70, 1.0, 200, 150, repeat=True), _r(80, 0.5, 200, 200, repeat=True), _r(130, 2.0, 100, 50)]


def test_the_figures_of_a_run() -> None:
    f = bt.figures(RECORDS, wall_s=150.0, slo_ttft_s=2.0, warmup_s=60.0, bin_s=60.0)
    assert (f["sent"], f["ok"], f["lost"]) == (6, 5, 1) and f["statuses"] == {"ok": 5, "lost": 1}
    assert f["cached_share"] == round(430 / 900, 4)  # the lost request's tokens are not counted
    assert f["cached_share_after_warmup"] == round(400 / 500, 4)
    assert f["repeat_share_after_warmup"] == round(400 / 500, 4)
    assert f["ttft_p50_s"] == 2.0 and f["ttft_p95_s"] == 4.0  # nearest rank of 0.5, 1, 2, 3, 4
    assert f["ttft_p95_after_warmup_s"] == 2.0
    assert f["goodput_req_s"] == round(3 / 150, 4)  # TTFT 1, 0.5 and 2 meet 2 s
    assert f["throughput_req_s"] == round(5 / 150, 4) and f["methods_seen"] == {"blend": 5}
    assert [(b["bin"], b["sent"], b["ok"]) for b in f["bins"]] == [(1, 3, 2), (2, 2, 2), (3, 1, 1)]
    assert f["bins"][0]["cached_share"] == round(30 / 400, 4) and f["bins"][1]["ttft_p95_s"] == 1.0


def test_empty_windows_are_nan_not_zero() -> None:
    assert math.isnan(bt.cached_share([])) and math.isnan(bt.cached_share([_r(0, 0, status="lost")]))
    assert bt.bins([], 60.0) == [] and math.isnan(bt.goodput(RECORDS, 2.0, 0.0))


def test_the_headline_ratios() -> None:
    by = {"blend": {"cached_share_after_warmup": 0.8, "ttft_p95_s": 1.0, "goodput_req_s": 0.6, "lost": 0},
          "prefix": {"ttft_p95_s": 4.0, "goodput_req_s": 0.2, "lost": 1},
          "full": {"ttft_p95_s": 5.0, "goodput_req_s": 0.0, "lost": 2}}
    h = bt.headline(by)
    assert h == {"cached_share_after_warmup": 0.8, "blend_p95_ttft_over_prefix": 0.25, "blend_p95_ttft_over_full": 0.2,
                 "goodput_blend_over_prefix": 3.0, "goodput_blend_over_full": None, "lost_requests": 3}
    assert bt.headline({"blend": by["blend"]})["blend_p95_ttft_over_prefix"] is None
    assert bt.ratio(1.0, math.nan) is None


def test_repeats_are_questions_asked_before() -> None:
    assert bt.mark_repeats([3, 1, 3, 3, 2, 1]) == [False, False, True, True, False, True]


def test_a_fresh_home_holds_the_models_results_and_no_store(tmp_path: Path) -> None:
    source = tmp_path / "home"
    for name in ("models/x", "selfcheck", "kv/chunks", "rag", "server"):
        (source / name).mkdir(parents=True)
    (source / "selfcheck" / "v.json").write_text("{}")
    (source / "gguf-digests.json").write_text("{}")
    carried = tmp_path / "carried"
    carried.mkdir()
    bt._copy_results(source, carried)
    fresh = tmp_path / "fresh"
    assert bt.seed_home(source, fresh, carried) == ["gguf-digests.json", "models", "selfcheck"]
    assert (fresh / "models").is_symlink() and (fresh / "selfcheck" / "v.json").is_file()
    assert bt.seed_home(source, tmp_path / "bare", None) == [] and not any((tmp_path / "bare").iterdir())
