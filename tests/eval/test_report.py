"""Summaries, tables and plots (no model involved)."""

from __future__ import annotations

import math
from pathlib import Path

from kvblend.eval.report import (
    Column, _label_groups, machine_info, markdown_table, plot_lines, plot_quality_vs_ttft, speedups, summarize, summary_table,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RECORDS = [
    {"example_id": "a", "method": "full", "agree_f1": 1.0, "first_token_agree": True, "kl": 0.0, "ttft_s": 4.0,
     "answer": "paris", "sources": ["computed"]},
    {"example_id": "b", "method": "full", "agree_f1": 1.0, "first_token_agree": True, "kl": 0.0, "ttft_s": 2.0},
    {"example_id": "a", "method": "blend", "agree_f1": 0.5, "first_token_agree": False, "kl": 0.25, "ttft_s": 1.0,
     "gold_nll": float("nan"), "picked": 3},
    {"example_id": "b", "method": "blend", "agree_f1": 1.0, "first_token_agree": True, "kl": 0.75, "ttft_s": 0.5,
     "gold_nll": 2.0, "picked": 1},
]


def test_summarize_hand_computed() -> None:
    s = summarize(RECORDS)
    assert list(s) == ["full", "blend"]
    assert s["blend"] == {"agree_f1": 0.75, "first_token_agree": 0.5, "kl": 0.5, "ttft_s": 0.75, "gold_nll": 2.0,
                          "n": 2, "errors": 0, "nonfinite": 1}  # NaN skipped from the mean and counted,
    # bools as 0/1, strings/lists/`picked` not averaged
    assert s["full"]["ttft_s"] == 3.0 and s["full"]["n"] == 2


def test_summarize_follows_labels_and_keeps_empty_methods() -> None:
    s = summarize(RECORDS, ["blend", "prefix"])
    assert list(s) == ["blend", "prefix"] and s["prefix"] == {"n": 0, "errors": 0, "nonfinite": 0}
    assert summarize([{"method": "m", "kl": math.inf}])["m"]["kl"] is None


def test_broken_and_failed_records_are_counted_not_hidden() -> None:
    """A NaN or infinite KL vanished from the mean while ``n`` counted it: the worst
    examples disappeared and the method looked better than it was."""
    s = summarize([{"method": "m", "kl": 0.01}, {"method": "m", "kl": math.inf}, {"method": "m", "kl": math.nan},
                   {"method": "m", "error": "past the context"}])["m"]
    assert (s["kl"], s["n"], s["nonfinite"], s["errors"]) == (0.01, 4, 2, 1)
    table = summary_table({"m": s})
    assert "| errors | non-finite |" in table and table.endswith("| 1 | 2 |")


def test_speedups_and_table() -> None:
    s = summarize(RECORDS)
    assert speedups(s) == {"full": 1.0, "blend": 4.0}
    table = summary_table(s).splitlines()
    assert table[0].startswith("| method | n | agree F1 |")
    assert table[3].startswith("| blend | 2 | 0.750 | 0.50 | 0.5000 | 2.000 | – |")
    assert "| 4.00 |" in table[3]
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)


def test_markdown_table_formats_and_dashes() -> None:
    rows = [{"name": "x", "v": 0.123456, "w": None}, {"name": "y", "v": float("nan"), "w": "text"}]
    cols = [Column("v", "V", "{:.2f}"), Column("w", "W", "{:.1f}")]
    assert markdown_table(rows, cols, Column("name", "name", "{}")).splitlines() == [
        "| name | V | W |", "|---|---|---|", "| x | 0.12 | – |", "| y | – | text |"]


def test_plots_are_pngs(tmp_path: Path) -> None:
    head = plot_quality_vs_ttft(summarize(RECORDS), tmp_path / "q.png")
    rows = [{"x": x, "series": s, "ttft_s": x * (2 if s == "full" else 1)} for s in ("full", "blend") for x in (2, 4)]
    lines = plot_lines(rows + [{"x": 6, "series": "blend", "ttft_s": None}], "docs", ["ttft_s"], tmp_path / "l.png")
    cats = plot_lines([{"x": "k", "series": "b", "kl": 1.0}, {"x": "v", "series": "b", "kl": 0.5}], "signal", ["kl"],
                      tmp_path / "sub" / "c.png")
    for path in (head, lines, cats):
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_nearby_points_share_one_label() -> None:
    points = {"full": (3.0, 1.0), "reuse": (0.3, 0.86), "prefix": (3.02, 1.0), "blend": (0.9, 0.95)}
    assert _label_groups(points) == {"full, prefix": (3.0, 1.0), "reuse": (0.3, 0.86), "blend": (0.9, 0.95)}


def test_write_report_lists_methods_and_links_its_plot(tmp_path: Path) -> None:
    path = write_report(tmp_path, summarize(RECORDS), {"title": "T", "dataset": "d.json"})
    text = path.read_text()
    assert text.startswith("# T\n") and "- dataset: d.json" in text
    assert "| full |" in text and "| blend |" in text
    assert "(quality_vs_ttft.png)" in text and (tmp_path / "quality_vs_ttft.png").exists()


def test_machine_info() -> None:
    info = machine_info()
    assert info["nproc"] >= 1 and info["cpu"] and info["torch_threads"] >= 1
