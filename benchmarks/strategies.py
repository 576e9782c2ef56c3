"""Selection strategies x recompute ratios against full prefill (issue #12): KL, agree-F1,
first-token agreement, gold F1 and TTFT/full, with the Pareto frontier (KL vs TTFT/full).

    PYTHONPATH=src .venv/bin/python benchmarks/strategies.py --out runs/strategies \\
        [--dataset ../shared/data/musique_dev.json] [--limit 40] [--docs 2,6,10] \\
        [--ratios 0.05,0.15,0.3] [--strategies 'cacheblend:{r},blend:{r}:q,...'] [--model qwen2.5-coder-0.5b] \\
        [--layout after,before]

One resumable run per document count and question layout (``OUT/runs/docs-N`` with the
question after the documents, ``OUT/runs/docs-N-before`` with it before them; full prefill,
the reference, is computed once per example and shared by every strategy), then
``OUT/report.md`` with one table per run, the Pareto rows and a KL-vs-TTFT/full plot per run.
``{r}`` in a strategy stands for the ratio. Ends with one JSON line of the summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kvblend.engine import Engine, Request
from kvblend.eval.datasets import check_layout, load_musique, musique_prompt
from kvblend.eval.harness import EvalConfig
from kvblend.eval.runner import parse_method
from kvblend.eval.report import COLUMNS, Column, machine_info, markdown_table, plot_lines
from kvblend.eval.sweeps import RunSpec, pareto, run_spec, strategy_labels
from kvblend.models import DEFAULT_MODEL, load_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"
STRATEGIES = ("cacheblend:{r}", "blend:{r}:q", "blend:{r}:q+budget+sinks4", "blend:{r}:q+budget+sinks4+shift",
              "blend:{r}:q+shift", "blend:{r}:q+vdev", "blend:{r}:oracle")
PARETO_COLUMNS = (Column("ttft_over_full", "TTFT/full", "{:.3f}"), *(c for c in COLUMNS if c.key in (
    "n", "kl", "agree_f1", "first_token_agree", "gold_f1", "recompute_frac")), Column("frontier", "Pareto", "{}"))


def methods_for(strategies: list[str], ratios: list[float]) -> tuple[str, ...]:
    labels = ["full", "reuse"]
    for s in strategies:
        labels += [label for _, label in strategy_labels(s, ratios) if label not in labels]
    return tuple(labels)


def run_name(n_docs: int, layout: str) -> str:
    """``docs-N`` (question after the documents, as before layouts existed) or ``docs-N-before``."""
    return f"docs-{n_docs}" if layout == "after" else f"docs-{n_docs}-{layout}"


def ttft_rounds(loaded, dataset: str, labels: list[str], n_docs: int, doc_tokens: int, repeats: int,
                layout: str = "after") -> dict[str, float]:
    """TTFT over full prefill's, as the median of per-round ratios: ``n_docs`` cached
    documents of ``doc_tokens`` ids (consecutive MuSiQue passages cut to length), every
    method once per round, alternately, after a warm-up round."""
    engine = Engine(loaded)
    ex = load_musique(dataset, n_docs=10, limit=3)
    stream = [t for e in ex for d in e.documents for t in engine.tokenizer(d, add_special_tokens=False)["input_ids"]]
    docs = [tuple(stream[i * doc_tokens : (i + 1) * doc_tokens]) for i in range(n_docs)]
    specs = {label: parse_method(label) for label in ["full", *labels]}
    system, query = musique_prompt(ex[0].question, layout)

    def request(label: str) -> Request:
        return Request(documents=docs, question=query, system=system, method=specs[label].method,
                       blend=specs[label].blend)

    times: dict[str, list[float]] = {label: [] for label in specs}
    for _ in range(repeats + 1):
        for label in specs:
            t = time.perf_counter()
            engine.prepare(request(label))
            times[label].append(time.perf_counter() - t)
        engine.flush()
    engine.close()
    return {label: statistics.median(a / f for a, f in zip(v[1:], times["full"][1:])) for label, v in times.items()}


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
    ap.add_argument("--layout", default="after", help="comma-separated question placements: after, before")
    ap.add_argument("--ttft-only", action="store_true", help="only the paired TTFT/full rounds")
    ap.add_argument("--ttft-docs", type=int, default=6)
    ap.add_argument("--ttft-doc-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = methods_for(args.strategies.split(","), ratios) + tuple(m for m in args.extra.split(";") if m)
    layouts = [check_layout(x.strip()) for x in args.layout.split(",")]
    loaded = load_model(args.model)
    out = Path(args.out)
    if args.ttft_only:
        out.mkdir(parents=True, exist_ok=True)
        for layout in layouts:
            ratios = ttft_rounds(loaded, args.dataset, [m for m in methods if m != "full"], args.ttft_docs,
                                 args.ttft_doc_tokens, args.repeats, layout)
            name = "ttft.json" if layout == "after" else f"ttft-{layout}.json"
            (out / name).write_text(json.dumps(ratios, indent=2) + "\n", encoding="utf-8")
            print(json.dumps({"layout": layout, **{k: round(v, 4) for k, v in ratios.items()}}))
        return
    lines = [f"# Selection strategies ({loaded.name})", "",
             f"- dataset: {args.dataset}, first {args.limit} questions; machine: {machine_info()}", ""]
    dump = {}
    for n_docs, layout in ((int(d), x) for d in args.docs.split(",") for x in layouts):
        run = RunSpec(run_name(n_docs, layout), args.dataset, methods, n_docs=n_docs, limit=args.limit)
        config = EvalConfig(methods, args.max_tokens, layout=layout)
        result = run_spec(loaded, run, out / "runs" / run.name, config)
        rows = pareto(result.summary)
        dump[run.name] = rows
        for r in rows:
            r["series"] = r["method"].split(":")[0] + (":" + r["method"].split(":", 2)[2]
                                                       if r["method"].count(":") > 1 else "")
            r["x"] = r["ttft_over_full"]
        suffix = "" if layout == "after" else f"_{layout}"
        png = plot_lines(rows, "TTFT / full prefill", ("kl", "agree_f1"), out / f"pareto_docs{n_docs}{suffix}.png",
                         f"{loaded.name}, {n_docs} passages, question {layout}, "
                         f"{result.summary['full']['n']} questions")
        lines += [f"## {n_docs} passages, question {layout} them ({result.summary['full']['n']} questions)", "",
                  markdown_table(rows, PARETO_COLUMNS, Column("method", "method", "{}")), "", f"![]({png.name})", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    print(json.dumps({n: [{k: r[k] for k in ("method", "ttft_over_full", "kl", "agree_f1", "first_token_agree",
                                              "frontier")} for r in rows] for n, rows in dump.items()}))


if __name__ == "__main__":
    main()
