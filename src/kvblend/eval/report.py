"""Summaries, Markdown tables and plots of evaluation results.

A *record* is one example × method (a line of ``examples.jsonl``); a *summary* maps
each method label to its metrics averaged over examples plus ``n``. Plots use
matplotlib's Agg backend and are written as PNG next to the Markdown that links them.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

Summary = dict[str, dict[str, float | None]]

NOT_METRICS = frozenset({"picked"})  # numeric fields that are not averaged


class Column(NamedTuple):
    key: str
    title: str
    fmt: str


COLUMNS = (
    Column("n", "n", "{:.0f}"),
    Column("agree_f1", "agree F1", "{:.3f}"),
    Column("first_token_agree", "1st token", "{:.2f}"),
    Column("kl", "KL(full‖m)", "{:.4f}"),
    Column("gold_nll", "gold NLL", "{:.3f}"),
    Column("gold_f1", "gold F1", "{:.3f}"),
    Column("rouge_l", "ROUGE-L", "{:.3f}"),
    Column("ttft_s", "TTFT s", "{:.2f}"),
    Column("speedup", "× full", "{:.2f}"),
    Column("lookup_s", "lookup s", "{:.3f}"),
    Column("load_s", "load s", "{:.3f}"),
    Column("prefill_s", "prefill s", "{:.2f}"),
    Column("recompute_frac", "recompute", "{:.3f}"),
    Column("errors", "errors", "{:.0f}"),  # records left out of the means (an error, not a score)
    Column("nonfinite", "non-finite", "{:.0f}"),  # records with a NaN or infinite score
)
SUMMARY_KEYS = tuple(c.key for c in COLUMNS if c.key not in ("n", "errors", "nonfinite", "speedup"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float))


def _mean(values: Iterable[float]) -> float | None:
    """Mean of the finite values (NaN and ±inf skipped); None when there are none."""
    finite = [float(v) for v in values if math.isfinite(float(v))]
    return sum(finite) / len(finite) if finite else None


def summarize(records: Iterable[Mapping[str, Any]], labels: Sequence[str] | None = None) -> Summary:
    """Per method label (in ``labels`` order, else first-seen order): every numeric field
    averaged over its records (booleans count as 0/1), plus ``n``."""
    by_label: dict[str, list[Mapping[str, Any]]] = {label: [] for label in labels or ()}
    for r in records:
        if labels is None or r["method"] in by_label:
            by_label.setdefault(r["method"], []).append(r)
    return {label: _summarize_one(rs) for label, rs in by_label.items()}


def _summarize_one(records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Means over the records that ran (an ``error`` record is only counted, in
    ``errors``), each metric over its finite values; ``nonfinite`` counts the records with
    a NaN or infinite metric (a broken result must not vanish from the table)."""
    scored = [r for r in records if "error" not in r]
    keys = dict.fromkeys(k for r in scored for k, v in r.items() if _is_number(v) and k not in NOT_METRICS)
    out: dict[str, float | None] = {k: _mean(r[k] for r in scored if _is_number(r.get(k))) for k in keys}
    out["n"] = len(records)
    out["errors"] = len(records) - len(scored)
    out["nonfinite"] = sum(1 for r in scored if any(_is_number(r.get(k)) and not math.isfinite(float(r[k]))
                                                    for k in keys))
    return out


def speedups(summary: Summary, reference: str = "full") -> dict[str, float | None]:
    """Mean TTFT of ``reference`` over each method's mean TTFT."""
    ref = summary.get(reference, {}).get("ttft_s")
    return {label: (ref / s["ttft_s"] if ref and s.get("ttft_s") else None) for label, s in summary.items()}


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], first: Column) -> str:
    """A Markdown table: ``first`` (e.g. the method) then ``columns``, one line per row."""
    cols = [first, *columns]
    lines = ["| " + " | ".join(c.title for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c.key), c.fmt) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def summary_table(summary: Summary, columns: Sequence[Column] = COLUMNS) -> str:
    """The per-method table of a summary, with TTFT speedup over full prefill."""
    speed = speedups(summary)
    rows = [{"method": label, **s, "speedup": speed[label]} for label, s in summary.items()]
    return markdown_table(rows, columns, Column("method", "method", "{}"))


def machine_info() -> dict[str, Any]:
    """CPU count, CPU model, OS and library versions, for the report header."""
    import torch

    return {"nproc": os.cpu_count(), "cpu": _cpu_model(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "os": platform.platform()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_quality_vs_ttft(summary: Summary, path: Path, title: str = "") -> Path:
    """The headline figure: agree F1 and KL(full‖method) against mean TTFT, one point
    per method (up and left is better for F1, down and left for KL)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in ((axes[0], "agree_f1", "agree F1 with full prefill"),
                           (axes[1], "kl", "KL(full ‖ method), nats")):
        points = {m: (s["ttft_s"], s[key]) for m, s in summary.items()
                  if s.get("ttft_s") is not None and s.get(key) is not None}
        for method, (x, y) in points.items():
            ax.scatter(x, y, s=40)
        for names, (x, y) in _label_groups(points).items():
            ax.annotate(names, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return _save(fig, path, title or "Quality vs time to first token")


def _label_groups(points: Mapping[str, tuple[float, float]], near: float = 0.03) -> dict[str, tuple[float, float]]:
    """One label per cluster of points closer than ``near`` of the axes' spans ("full, prefix")."""
    if not points:
        return {}
    xs, ys = zip(*points.values())
    span_x, span_y = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    groups: list[tuple[list[str], tuple[float, float]]] = []
    for name, (x, y) in points.items():
        for names, (gx, gy) in groups:
            if abs(x - gx) / span_x < near and abs(y - gy) / span_y < near:
                names.append(name)
                break
        else:
            groups.append(([name], (x, y)))
    return {", ".join(names): xy for names, xy in groups}


def _save(fig: Any, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_lines(rows: Sequence[Mapping[str, Any]], x_label: str, metrics: Sequence[str], path: Path,
               title: str = "") -> Path:
    """One panel per metric, one line per ``series`` (rows: ``x``, ``series``, metrics).
    String x values are drawn as categories in first-seen order."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    series = dict.fromkeys(r["series"] for r in rows)
    for ax, metric in zip(axes[0], metrics):
        for name in series:
            pts = [(r["x"], r.get(metric)) for r in rows if r["series"] == name and r.get(metric) is not None]
            if pts:
                ax.plot([str(x) if isinstance(x, str) else x for x, _ in pts], [y for _, y in pts], "o-", label=name)
        ax.set_xlabel(x_label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path, title)


def write_report(out_dir: Path, summary: Summary, meta: Mapping[str, Any]) -> Path:
    """``out_dir/report.md`` (header, per-method table) and the headline plot it links."""
    png = plot_quality_vs_ttft(summary, out_dir / "quality_vs_ttft.png", str(meta.get("title", "")))
    lines = [f"# {meta.get('title', 'Evaluation')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "title"]
    lines += ["", summary_table(summary), "", f"![quality vs TTFT]({png.name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
