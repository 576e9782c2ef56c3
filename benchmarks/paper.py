"""CacheBlend (EuroSys '25) on a CPU: the headline quality-vs-TTFT comparison and the
sensitivity sweeps, written to a report (RUN_DIR/report.md, which docs/results.md quotes) with its plots in docs/results/.

    .venv/bin/python benchmarks/paper.py [--quick] [--qwen] [--gemma] [--dataset PATH] [--work DIR]

Runs (each resumable in WORK/<run>/, so an interrupted run continues where it stopped):
  main               MuSiQue: full, prefix, reuse, blend:0.15, mapreduce, maprerank
  sensitivity        MuSiQue: recompute ratio, check layers / schedule, deviation signal
  docs-N, length-T   TTFT against the number of documents (MuSiQue) and their length (synthetic)
                     (the default-store run stands in for docs-6)
  store-TIER-DTYPE   chunk KV in memory / on disk / in Redis, stored as fp32/fp16/bf16/int8
  qwen, gemma        the other packaged models (--qwen, --gemma): full, reuse, blend:0.15, and
                     a per-model table of those three methods next to the default model's
The default plan is sized for about 22 minutes on 2 quiet cores (extrapolated from --quick:
main ~7.5, sensitivity ~4, stores ~5, documents ~3.5, length ~2.5); --quick (under 3 minutes)
only proves the pipeline end to end. Ends with one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvblend.eval.harness import EvalConfig, EvalResult
from kvblend.eval.report import (
    COLUMNS, Column, Summary, machine_info, markdown_table, plot_quality_vs_ttft, speedups, summary_table,
)
from kvblend.eval.sweeps import (
    RunSpec, StoreSpec, Sweep, SweepResult, distinct_runs, docs_runs, length_runs, method_sweep, ratio_points, run_spec,
    run_sweeps, setting_sweep, store_run, sweep_table,
)
from kvblend.models import DEFAULT_MODEL, load_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"
MAIN_METHODS = ("full", "prefix", "reuse", "blend:0.15", "mapreduce", "maprerank")
SWEEP_METHODS = ("full", "reuse", "blend:0.15")
QWEN_MODEL = "qwen2.5-coder-0.5b"
GEMMA_MODEL = "gemma3-270m"


@dataclass(frozen=True)
class Plan:
    """How much of everything to run."""

    main_examples: int
    main_docs: int
    sweep_examples: int
    sweep_docs: int
    ratios: tuple[float, ...]
    schedules: tuple[tuple[str, str], ...]  # (x label, method)
    signals: tuple[str, ...]
    doc_counts: tuple[int, ...]
    lengths: tuple[int, ...]
    length_docs: int
    setting_examples: int
    tiers: tuple[str, ...]
    dtypes: tuple[str, ...]
    qwen_examples: int = 4


DEFAULT = Plan(
    main_examples=8, main_docs=6, sweep_examples=3, sweep_docs=6,
    ratios=(0.0, 0.05, 0.15, 0.3, 0.5, 1.0),
    schedules=(("L1", "blend:0.15"), ("L2", "blend:0.15@2"), ("L1,2 flat", "blend:0.15@1,2"),
               ("L1,2 30→15%", "blend:0.3,0.15@1,2"), ("L1,2,3 50→30→15%", "blend:0.5,0.3,0.15@1,2,3")),
    signals=("v", "k", "kv"), doc_counts=(2, 4, 6, 8, 10), lengths=(128, 256, 512, 1024), length_docs=4,
    setting_examples=2, tiers=("memory", "disk", "redis"), dtypes=("fp32", "fp16", "bf16", "int8"),
)
QUICK = Plan(
    main_examples=2, main_docs=3, sweep_examples=1, sweep_docs=3, ratios=(0.15, 0.5),
    schedules=(("L1", "blend:0.15"), ("L1,2 30→15%", "blend:0.3,0.15@1,2")), signals=("v", "k"),
    doc_counts=(2, 4), lengths=(128, 256), length_docs=3, setting_examples=1, tiers=("memory", "disk", "redis"),
    dtypes=("fp32", "int8"), qwen_examples=1,
)


# ----- what to run ------------------------------------------------------------------
def sensitivity_run(plan: Plan, data: str) -> RunSpec:
    labels = [m for _, m in ratio_points(plan.ratios)] + [m for _, m in plan.schedules]
    labels += [_signal_label(s) for s in plan.signals]
    return RunSpec("sensitivity", data, ("full", "reuse", *dict.fromkeys(labels)), plan.sweep_docs, plan.sweep_examples)


def _signal_label(signal: str) -> str:
    return "blend:0.15" if signal == "v" else f"blend:0.15:{signal}"


def tiers_available(tiers: tuple[str, ...]) -> tuple[str, ...]:
    """The tiers that can run here (Redis needs a redis-server binary)."""
    return tuple(t for t in tiers if t != "redis" or shutil.which("redis-server"))


def store_runs(plan: Plan, data: str) -> dict[tuple[str, str], RunSpec]:
    """(tier, dtype) -> run: each tier with fp32 KV, and the memory tier with each dtype."""
    specs = [StoreSpec(t) for t in tiers_available(plan.tiers)] + [StoreSpec("memory", d) for d in plan.dtypes]
    return {(s.tier, s.kv_dtype): store_run(data, s, SWEEP_METHODS, plan.setting_examples, plan.sweep_docs)
            for s in specs}


def doc_runs(plan: Plan, data: str, stores: dict[tuple[str, str], RunSpec]) -> list[tuple[int, RunSpec]]:
    """One run per document count; the store sweep's default run stands in when it is the same."""
    runs = docs_runs(data, plan.doc_counts, SWEEP_METHODS, plan.setting_examples)
    same = stores.get(("memory", "fp32"))
    return [(n, same if same and (run.n_docs, run.limit) == (same.n_docs, same.limit) else run) for n, run in runs]


def build_sweeps(plan: Plan, data: str) -> list[Sweep]:
    sens, stores = sensitivity_run(plan, data), store_runs(plan, data)
    return [
        method_sweep("ratio", "Quality vs recompute ratio (blend)", "recompute ratio", sens,
                     ratio_points(plan.ratios), ("agree_f1", "kl", "ttft_s")),
        method_sweep("schedule", "Check layers and progressive schedule", "check layers", sens, plan.schedules,
                     ("agree_f1", "kl", "recompute_frac")),
        method_sweep("signal", "Deviation signal", "signal", sens,
                     [(s, _signal_label(s)) for s in plan.signals], ("agree_f1", "kl")),
        setting_sweep("docs", "TTFT vs number of documents (MuSiQue)", "documents", doc_runs(plan, data, stores),
                      ("ttft_s", "agree_f1")),
        setting_sweep("length", f"TTFT vs document length (synthetic, {plan.length_docs} docs)", "tokens per document",
                      length_runs(plan.lengths, plan.length_docs, plan.setting_examples, SWEEP_METHODS),
                      ("ttft_s", "agree_f1")),
        setting_sweep("tier", "Storage tier (fp32 KV)", "tier",
                      [(t, r) for (t, d), r in stores.items() if d == "fp32"], ("ttft_s", "lookup_s")),
        setting_sweep("dtype", "KV storage dtype (memory tier)", "KV dtype",
                      [(d, r) for (t, d), r in stores.items() if t == "memory"], ("agree_f1", "kl", "ttft_s")),
    ]


# ----- the report -------------------------------------------------------------------
def headline(summary: Summary) -> dict[str, float | None]:
    """blend:0.15 against full and reuse: quality loss, gap closed, TTFT ratios."""
    full, reuse, blend = (summary.get(m, {}) for m in ("full", "reuse", "blend:0.15"))
    speed = speedups(summary)

    def closed(key: str, best: float) -> float | None:
        gap = abs(best - reuse.get(key, best))
        return 1 - abs(best - blend[key]) / gap if gap > 0 and blend.get(key) is not None else None

    return {"agree_f1_loss": 1 - blend["agree_f1"], "gold_f1_loss": full["gold_f1"] - blend["gold_f1"],
            "rouge_l_loss": full["rouge_l"] - blend["rouge_l"], "kl_blend": blend["kl"], "kl_reuse": reuse["kl"],
            "gap_closed_agree_f1": closed("agree_f1", 1.0), "gap_closed_kl": closed("kl", 0.0),
            "speedup_blend": speed.get("blend:0.15"), "speedup_reuse": speed.get("reuse"),
            "blend_over_reuse_ttft": blend["ttft_s"] / reuse["ttft_s"]}


def _fmt(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def claims_table(h: dict[str, float | None]) -> str:
    rows = [
        ("quality loss of blend:0.15 vs full (gold F1 / ROUGE-L)", "≤ 0.02",
         f"{_fmt(h['gold_f1_loss'])} / {_fmt(h['rouge_l_loss'])}"),
        ("agreement with full prefill's answer (1 − agree F1)", "–", _fmt(h["agree_f1_loss"])),
        ("share of reuse's quality gap closed: agree F1 / KL", "most",
         f"{_fmt(h['gap_closed_agree_f1'], '{:.0%}')} / {_fmt(h['gap_closed_kl'], '{:.0%}')}"),
        ("TTFT speedup of blend:0.15 over full prefill", "2.2–3.3×", _fmt(h["speedup_blend"], "{:.2f}×")),
        ("TTFT of blend:0.15 relative to reuse", "close to 1", _fmt(h["blend_over_reuse_ttft"], "{:.2f}×")),
    ]
    lines = ["| claim | paper | here |", "|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


def compute_minutes(run_dirs: list[Path]) -> float:
    """Compute time summed over the runs' run.json (resumed invocations included)."""
    return sum(json.loads((d / "run.json").read_text()).get("compute_s", 0.0) for d in run_dirs) / 60


def header(args: argparse.Namespace, plan: Plan, elapsed: float, model: str, run_dirs: list[Path]) -> list[str]:
    m = machine_info()
    command = ".venv/bin/python benchmarks/paper.py" + (" --quick" if args.quick else "") + (
        " --qwen" if args.qwen else "") + (" --gemma" if args.gemma else "")
    return [
        "# Results: CacheBlend on CPU", "",
        f"Regenerate with `{command}` (resumable: intermediate runs in `{args.work}/`).", "",
        f"- machine: {m['nproc']} CPUs, {m['cpu']}; torch {m['torch']} ({m['torch_threads']} threads), "
        f"Python {m['python']}, {m['os']}",
        f"- model: {model} (fp32, CPU); greedy decoding, answers ≤ {args.max_tokens} tokens, stop at newline",
        f"- dataset: MuSiQue dev (`{Path(args.dataset).name}`, CacheBlend's retrieval-chunked form): first "
        f"{plan.main_examples} questions × {plan.main_docs} passages for the main table, first {plan.sweep_examples} "
        f"for the ratio / schedule / signal sweeps and {plan.setting_examples} for the document-count and store "
        f"sweeps; the length sweep uses the synthetic two-hop generator (`kvblend.eval.synthetic`: "
        f"{plan.setting_examples} × {plan.length_docs} documents)",
        f"- plan: {'quick (pipeline check only)' if args.quick else 'default'}; evaluation compute "
        f"{compute_minutes(run_dirs):.1f} min summed over runs, this invocation {elapsed / 60:.1f} min; "
        f"generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "",
    ]


NOTES = """## How to read this

- **full**: full prefill (the reference); **prefix**: exact prefix reuse (only the system
  prompt is shared across questions, as in vLLM/SGLang); **reuse**: every passage's cached KV
  re-rotated to its position, no recompute (PromptCache); **blend:R**: CacheBlend,
  recomputing the fraction R of passage tokens whose KV deviates most (check layer 1,
  value deviation unless stated; `@L1,L2` and `R1,R2` give check layers and a progressive
  schedule, `:k`/`:kv` the deviation signal).
- **mapreduce**: each passage alone writes a one-sentence note on the question; a second
  call answers from the notes. **maprerank**: each passage alone answers; the answer with
  the highest confidence wins, where confidence is the mean token log-probability of that
  answer under the model. Both use full prefill (no KV reuse); their TTFT runs until the
  first token of the final answer, all map calls (prefill and decode) included.
- **TTFT**: wall time to prepare the prompt's KV cache and the first token's logits (chunk
  KV is stored beforehand, as in serving with a warm cache). It breaks down into `lookup`
  (finding and reading the passages' chunk KV from the store, so the storage tier shows
  here), `load` (copying the prefix cache's KV) and `prefill` (full prefill, or fusion with
  selective recompute); `× full` is full's TTFT over the method's.
- **agree F1** / **1st token**: token F1 / first-token agreement with full prefill's
  answer; **KL(full‖m)**: mean KL divergence from full prefill's next-token distribution
  along full's first 8 answer tokens (teacher-forced); **gold NLL**, **gold F1**, **ROUGE-L**:
  against the gold answer. SmolLM2-135M rarely finds MuSiQue's multi-hop answers, so gold
  F1 is near zero for every method; fidelity to full prefill is the informative measure.
- **recompute**: share of token-layer work done, over the context not served by the prefix cache.
"""


def sweep_section(result: SweepResult, images: Path) -> list[str]:
    name = f"sweep_{result.sweep.name}.png"
    shutil.copy(result.plot, images / name)
    return [f"### {result.sweep.title}", "", sweep_table(result), "", f"![{result.sweep.title}](results/{name})", ""]


def run_dirs(work: Path, main: EvalResult, sweeps: list[SweepResult], extra: dict[str, EvalResult]) -> list[Path]:
    dirs = [main.out_dir] + [work / "runs" / r.name for r in distinct_runs([x.sweep for x in sweeps])]
    return dirs + [r.out_dir for r in extra.values()]


def per_model_table(summaries: dict[str, Summary], methods: tuple[str, ...] = SWEEP_METHODS) -> str:
    """One row per model × method (the default config's full, reuse and blend), each
    model's TTFT speedup taken against its own full prefill."""
    rows = []
    for model, summary in summaries.items():
        speed = speedups(summary)
        rows += [{"row": f"{model} · {m}", **summary[m], "speedup": speed[m]} for m in methods if m in summary]
    return markdown_table(rows, COLUMNS, Column("row", "model · method", "{}"))


def extra_sections(plan: Plan, model: str, main: EvalResult, extra: dict[str, EvalResult]) -> list[str]:
    """Each other packaged model's table, then the per-model table."""
    lines = []
    for name, result in extra.items():
        lines += [f"## {name}, first {plan.qwen_examples} questions", "", summary_table(result.summary), ""]
    if extra:
        summaries = {model: main.summary, **{name: r.summary for name, r in extra.items()}}
        lines += ["## Per model: full, reuse and blend at the default config", "",
                  f"{model}: the main table's {plan.main_examples} questions; the others: their first "
                  f"{plan.qwen_examples}. Same passages and prompt format for every model.", "",
                  per_model_table(summaries), ""]
    return lines


def write_results(args: argparse.Namespace, plan: Plan, main: EvalResult, sweeps: list[SweepResult],
                  extra: dict[str, EvalResult], elapsed: float, model: str) -> dict[str, float | None]:
    """docs/results.md and docs/results/*.png; returns the headline figures."""
    images = Path(args.report).parent / "results"
    images.mkdir(parents=True, exist_ok=True)
    plot_quality_vs_ttft(main.summary, images / "quality_vs_ttft.png",
                         f"Quality vs TTFT: {model}, MuSiQue, {plan.main_docs} passages, {plan.main_examples} questions")
    h = headline(main.summary)
    lines = header(args, plan, elapsed, model, run_dirs(Path(args.work), main, sweeps, extra))
    lines += ["## Headline", "", claims_table(h), "", summary_table(main.summary), "",
              "![quality vs TTFT](results/quality_vs_ttft.png)", "", "## Sensitivity", ""]
    for result in sweeps:
        lines += sweep_section(result, images)
    lines += extra_sections(plan, model, main, extra)
    Path(args.report).write_text("\n".join(lines + [NOTES]), encoding="utf-8")
    return h


# ----- main -------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="CacheBlend on CPU: headline comparison and sensitivity sweeps, "
                                             "written to a report that docs/results.md quotes")
    ap.add_argument("--quick", action="store_true", help="a few minutes: proves the pipeline, not the claims")
    ap.add_argument("--qwen", action="store_true", help=f"add a {QWEN_MODEL} table (about 3x slower)")
    ap.add_argument("--gemma", action="store_true", help=f"add a {GEMMA_MODEL} table (`make gemma`)")
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--work", default=None, help="run directory (default: runs/paper or runs/paper-quick)")
    ap.add_argument("--report", default=None,
                    help="the report's path (default: RUN_DIR/report.md; docs/results.md quotes from it, by topic)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    args.work = args.work or str(Path("runs") / ("paper-quick" if args.quick else "paper"))
    args.report = args.report or str(Path(args.work) / "report.md")
    return args


def main() -> None:
    args = parse_args()
    plan = QUICK if args.quick else DEFAULT
    torch.set_num_threads(os.cpu_count() or 1)
    start, work = time.perf_counter(), Path(args.work)
    config = EvalConfig(max_tokens=args.max_tokens)
    loaded = load_model(DEFAULT_MODEL)
    main_run = RunSpec("main", args.dataset, MAIN_METHODS, plan.main_docs, plan.main_examples)
    main_result = run_spec(loaded, main_run, work / "main", config)
    sweeps = run_sweeps(loaded, build_sweeps(plan, args.dataset), work, config)
    extra = {}
    for flag, name, run in ((args.qwen, QWEN_MODEL, "qwen"), (args.gemma, GEMMA_MODEL, "gemma")):
        if flag:
            spec = RunSpec(run, args.dataset, SWEEP_METHODS, plan.main_docs, plan.qwen_examples)
            extra[name] = run_spec(load_model(name), spec, work / run, config)
    h = write_results(args, plan, main_result, sweeps, extra, time.perf_counter() - start, loaded.name)
    print(f"wrote {args.report} in {(time.perf_counter() - start) / 60:.1f} min", file=sys.stderr)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in h.items()}))


if __name__ == "__main__":
    main()
