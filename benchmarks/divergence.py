"""Where a blend's greedy answer leaves full prefill's, and how close full prefill's own choice
was there: the top-1 minus top-2 log-probability ("margin", nats) of full prefill at the
first answer token where the two differ.

    .venv/bin/python benchmarks/divergence.py [--method blend:0.15:q+budget+sinks4+shift]
        [--limit 40] [--only-from runs/smol/runs/docs-6/examples.jsonl] [--threads 1]

Agree-F1 counts an answer that leaves full prefill's at one token as a different answer.
When full prefill's margin there is a small fraction of a nat, any perturbation of the
prompt's KV (a blend at any ratio short of 1) can flip that token: the disagreement says
more about the model's near-ties than about the blend. ``--only-from`` (an eval run's
examples.jsonl) limits the run to the questions whose answers disagreed there (agree-F1
< 1 for ``--method``), which saves the full prefills of the others. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvblend.engine import Engine
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import decode_answer, example_request, parse_method, teacher_force, warm_documents
from kvblend.models import DEFAULT_MODEL, load_model

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def disagreeing(path: str, method: str) -> set[str]:
    """Example ids whose ``method`` answer disagreed with full prefill's in an eval run."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {r["example_id"] for r in rows if r["method"] == method and r["agree_f1"] < 1}


def first_divergence(engine: Engine, ex, spec, max_tokens: int = 32) -> dict | None:
    """The first answer token where ``spec``'s greedy answer differs from full prefill's, with
    both methods' log-probabilities there; None when the answers are the same tokens."""
    full = engine.prepare(example_request(ex, parse_method("full")), max_tokens)
    _, ref = decode_answer(engine, full, max_tokens)
    blend = engine.prepare(example_request(ex, spec), max_tokens)
    _, got = decode_answer(engine, blend, max_tokens)
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        return None  # one answer may be a prefix of the other (a stop); no token differs
    lf = torch.log_softmax(teacher_force(engine, full, ref[: i + 1])[i].double(), -1)
    lb = torch.log_softmax(teacher_force(engine, blend, ref[: i + 1])[i].double(), -1)
    top = lf.topk(2).values
    return {"id": ex.id, "token": i, "full_margin": float(top[0] - top[1]),
            "blend_margin": float(lb[got[i]] - lb[ref[i]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--method", default="blend:0.15:q+budget+sinks4+shift")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--only-from", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = parse_method(args.method)
    only = disagreeing(args.only_from, spec.label) if args.only_from else None
    engine = Engine(load_model(DEFAULT_MODEL))
    found = []
    for ex in load_musique(args.dataset, n_docs=6, limit=args.limit):
        if only is not None and ex.id not in only:
            continue
        warm_documents(engine, ex, [spec])
        row = first_divergence(engine, ex, spec)
        if row is not None:
            found.append(row)
            print(f"  {row['id']}: token {row['token']}, full margin {row['full_margin']:.3f} nats, "
                  f"blend prefers its token by {row['blend_margin']:.3f}", flush=True)
    margins = sorted(r["full_margin"] for r in found)
    summary = {"method": spec.label, "divergent": len(found),
               "median_full_margin": statistics.median(margins) if margins else None,
               "below_0_5": sum(m < 0.5 for m in margins), "below_1": sum(m < 1.0 for m in margins)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
