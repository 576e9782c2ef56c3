"""Per-question KL of blend methods against full prefill, as ratios to plain reuse's: the tail.

    PYTHONPATH=src .venv/bin/python benchmarks/tail.py --out runs/tail/smol --start 0 --limit 40 \
        [--methods "reuse,blend:0.15:q+budget+sinks4+shift,..."] [--model qwen2.5-coder-0.5b] [--threads 1]
        [--only "0.5"]  # only the questions whose default ratio (an earlier run in --out) is >= 0.5
    PYTHONPATH=src .venv/bin/python benchmarks/tail.py --out runs/tail/smol --report [--start S --limit N]

KL is `kvblend eval`'s (`eval.runner`): full prefill's greedy answer, stopped at a newline,
is teacher-forced for its first ``--kl-tokens`` tokens through each method's prepared
prompt, and KL(full || method) averaged over those positions; only the KL is computed
(no 32-token answer, no gold NLL), so a method costs its prepare and 8 forced tokens.
Full prefill's reference (answer ids and logits) is kept under ``OUT/refs`` and reused by
later runs. Each (question, method) is one JSON line in ``OUT/records.jsonl`` (a rerun
skips those done), with the request's blend risk (`RequestStats.risk`) when it has one.

``--report`` prints, per method, the per-question ratio KL / reuse's KL (mean of the KL
over questions divided by reuse's mean, median / p90 / max of per-question ratios, the
number of questions worse than reuse), and the risk signal's AUC at separating questions
whose ratio is above 0.5 (`--risk-method`, default the engine's default blend).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvblend.engine import Engine
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import (
    Reference, decode_answer, example_request, parse_method, teacher_force, warm_documents,
)
from kvblend.metrics import kl_divergence
from kvblend.models import DEFAULT_MODEL, load_model

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
DEFAULT = "blend:0.15:q+budget+sinks4+shift"


def load_ref(engine: Engine, ex, refs: Path, kl_tokens: int) -> Reference:
    """Full prefill's answer ids and logits along them, from ``refs`` or computed and kept there."""
    path = refs / f"{ex.id}.pt"
    if path.exists():
        d = torch.load(path)
        return Reference("", d["ids"], d["logits"])
    prepared = engine.prepare(example_request(ex, parse_method("full")), kl_tokens)
    _, ids = decode_answer(engine, prepared, kl_tokens)
    logits = teacher_force(engine, prepared, ids) if ids else prepared.logits[None]
    refs.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "logits": logits.clone()}, path)
    return Reference("", ids, logits)


def score(engine: Engine, ex, method: str, ref: Reference) -> dict:
    spec = parse_method(method)
    prepared = engine.prepare(example_request(ex, spec), len(ref.answer_ids) + 1)
    forced = teacher_force(engine, prepared, ref.answer_ids) if ref.answer_ids else prepared.logits[None]
    s = prepared.stats
    return {"id": ex.id, "method": method, "kl": kl_divergence(ref.logits, forced),
            "risk": getattr(s, "risk", None), "recompute_frac": s.recompute_frac}


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability that a random positive outscores a random negative (ties count half)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def report(records: list[dict], ids: set[str] | None, risk_method: str) -> None:
    by = {}
    for r in records:
        if ids is None or r["id"] in ids:
            by.setdefault(r["method"], {})[r["id"]] = r
    reuse = by.get("reuse", {})
    for method, rows in by.items():
        common = [i for i in rows if i in reuse]
        if not common or method == "reuse":
            continue
        ratios = sorted(rows[i]["kl"] / max(reuse[i]["kl"], 1e-12) for i in common)
        mean_ratio = statistics.mean(rows[i]["kl"] for i in common) / statistics.mean(reuse[i]["kl"] for i in common)
        p90 = ratios[min(len(ratios) - 1, int(round(0.9 * (len(ratios) - 1))))]
        line = {"method": method, "n": len(common), "kl": round(statistics.mean(rows[i]["kl"] for i in common), 4),
                "mean_ratio": round(mean_ratio, 3), "median_ratio": round(statistics.median(ratios), 3),
                "p90_ratio": round(p90, 3), "max_ratio": round(ratios[-1], 3),
                "worse_than_reuse": sum(x > 1 for x in ratios), "above_0_5": sum(x > 0.5 for x in ratios)}
        if method == risk_method and all(rows[i].get("risk") is not None for i in common):
            bad = [rows[i]["kl"] / max(reuse[i]["kl"], 1e-12) > 0.5 for i in common]
            line["risk_auc_ratio_above_0_5"] = auc([rows[i]["risk"] for i in common], bad)
        print(json.dumps(line))


def per_question(records: list[dict], ids: set[str] | None, methods: list[str]) -> None:
    by = {}
    for r in records:
        if ids is None or r["id"] in ids:
            by.setdefault(r["id"], {})[r["method"]] = r
    print("| question | reuse KL | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for qid, rows in sorted(by.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[-1])):
        if "reuse" not in rows:
            continue
        base = max(rows["reuse"]["kl"], 1e-12)
        cells = [f"{rows[m]['kl'] / base:.2f}" if m in rows else "" for m in methods]
        print(f"| {qid} | {rows['reuse']['kl']:.4f} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--out", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--methods", default=f"reuse,{DEFAULT}")
    ap.add_argument("--kl-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", type=float, default=None,
                    help="only questions whose default blend's ratio to reuse (earlier records) is >= this")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--table", default=None, help="with --report: methods (comma-separated) for a per-question table")
    ap.add_argument("--risk-method", default=DEFAULT)
    args = ap.parse_args()
    out = Path(args.out)
    records_path = out / "records.jsonl"
    examples = load_musique(args.dataset, n_docs=6, limit=args.start + args.limit)[args.start :]
    ids = {ex.id for ex in examples}
    if args.report:
        records = read(records_path)
        report(records, ids, args.risk_method)
        if args.table:
            per_question(records, ids, args.table.split(","))
        return
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    done = {(r["id"], r["method"]) for r in read(records_path)}
    if args.only is not None:
        earlier = {(r["id"], r["method"]): r["kl"] for r in read(records_path)}
        examples = [ex for ex in examples if (ex.id, "reuse") in earlier and (ex.id, DEFAULT) in earlier
                    and earlier[(ex.id, DEFAULT)] >= args.only * earlier[(ex.id, "reuse")]]
        print("questions:", [ex.id for ex in examples], flush=True)
    engine = Engine(load_model(args.model))
    out.mkdir(parents=True, exist_ok=True)
    try:
        for ex in examples:
            todo = [m for m in methods if (ex.id, m) not in done]
            if not todo:
                continue
            warm_documents(engine, ex, [parse_method(m) for m in todo])
            ref = load_ref(engine, ex, out / "refs", args.kl_tokens)
            for m in todo:
                row = score(engine, ex, m, ref)
                with records_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
