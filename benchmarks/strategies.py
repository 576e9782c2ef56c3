"""Selection strategies x recompute ratios against full prefill (issue #12): KL, agree-F1,
first-token agreement, gold F1 and TTFT/full, with the Pareto frontier (KL vs TTFT/full).

    PYTHONPATH=src .venv/bin/python benchmarks/strategies.py --out runs/strategies \\
        [--dataset ../shared/data/musique_dev.json] [--limit 40] [--docs 2,6,10] \\
        [--ratios 0.05,0.15,0.3] [--strategies 'cacheblend:{r},blend:{r}:q,...'] [--model qwen2.5-coder-0.5b]

One resumable run per document count (``OUT/runs/docs-N``; full prefill, the reference, is
computed once per example and shared by every strategy), then ``OUT/report.md`` with one
table per document count, the Pareto rows and a KL-vs-TTFT/full plot per count.
``{r}`` in a strategy stands for the ratio. Ends with one JSON line of the summaries.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from kvblend.eval.harness import EvalConfig
from kvblend.eval.report import COLUMNS, Column, machine_info, markdown_table, plot_lines
from kvblend.eval.sweeps import RunSpec, pareto, run_spec, strategy_labels
from kvblend.models import DEFAULT_MODEL, load_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"
STRATEGIES = ("cacheblend:{r}", "blend:{r}:q", "blend:{r}:q+budget+sinks4", "blend:{r}:q+budget+sinks4+shift",
              "blend:{r}:q+shift", "blend:{r}:oracle")
PARETO_COLUMNS = (Column("ttft_over_full", "TTFT/full", "{:.3f}"), *(c for c in COLUMNS if c.key in (
    "n", "kl", "agree_f1", "first_token_agree", "gold_f1", "recompute_frac")), Column("frontier", "Pareto", "{}"))


def methods_for(strategies: list[str], ratios: list[float]) -> tuple[str, ...]:
    labels = ["full", "reuse"]
    for s in strategies:
        labels += [label for _, label in strategy_labels(s, ratios) if label not in labels]
    return tuple(labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--docs", default="6", help="comma-separated document counts")
    ap.add_argument("--ratios", default="0.05,0.15,0.3")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="templates, {r} = the ratio")
    ap.add_argument("--extra", default="", help="more method specs to run once, e.g. blend:0.05:q")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = methods_for(args.strategies.split(","), ratios) + tuple(m for m in args.extra.split(";") if m)
    loaded = load_model(args.model)
    out = Path(args.out)
    lines = [f"# Selection strategies ({loaded.name})", "",
             f"- dataset: {args.dataset}, first {args.limit} questions; machine: {machine_info()}", ""]
    dump = {}
    for n_docs in (int(d) for d in args.docs.split(",")):
        run = RunSpec(f"docs-{n_docs}", args.dataset, methods, n_docs=n_docs, limit=args.limit)
        result = run_spec(loaded, run, out / "runs" / run.name, EvalConfig(methods, args.max_tokens))
        rows = pareto(result.summary)
        dump[n_docs] = rows
        for r in rows:
            r["series"] = r["method"].split(":")[0] + (":" + r["method"].split(":", 2)[2]
                                                       if r["method"].count(":") > 1 else "")
            r["x"] = r["ttft_over_full"]
        png = plot_lines(rows, "TTFT / full prefill", ("kl", "agree_f1"), out / f"pareto_docs{n_docs}.png",
                         f"{loaded.name}, {n_docs} passages, {result.summary['full']['n']} questions")
        lines += [f"## {n_docs} passages ({result.summary['full']['n']} questions)", "",
                  markdown_table(rows, PARETO_COLUMNS, Column("method", "method", "{}")), "", f"![]({png.name})", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    print(json.dumps({n: [{k: r[k] for k in ("method", "ttft_over_full", "kl", "agree_f1", "first_token_agree",
                                              "frontier")} for r in rows] for n, rows in dump.items()}))


if __name__ == "__main__":
    main()
