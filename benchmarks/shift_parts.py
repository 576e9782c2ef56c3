"""The default blend with its shift on V only or on K only: which half of the shift moves an
answer (KL to full prefill, as `benchmarks/tail.py` computes it, into the same records).

    PYTHONPATH=src .venv/bin/python benchmarks/shift_parts.py --model qwen2.5-coder-0.5b \
        --out runs/tail/qwen --ids 62,60

Zeroes one of the two means the (tested) shift moves tokens by (``ShiftCorrection._test``'s
result) for the run; the methods are recorded as ``…+shift[v only]`` / ``…+shift[k only]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import kvblend.blend.strategies as strategies
from kvblend.engine import Engine
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import parse_method, warm_documents
from kvblend.models import DEFAULT_MODEL, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tail  # noqa: E402 - the sibling benchmark's reference and scoring

METHOD = "blend:0.15:q+budget+sinks4+shift"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dataset", default=str(tail.DEFAULT_DATA))
    ap.add_argument("--out", required=True)
    ap.add_argument("--ids", required=True, help="question indices, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep = {"which": None}
    real = strategies.ShiftCorrection._test

    def one_half(self, r, dk, mean_k, dv, mean_v):
        mk, mv = real(self, r, dk, mean_k, dv, mean_v)
        return (mk * 0, mv) if keep["which"] == "v" else (mk, mv * 0)

    strategies.ShiftCorrection._test = one_half
    out, ids = Path(args.out), [int(x) for x in args.ids.split(",")]
    engine = Engine(load_model(args.model))
    examples = load_musique(args.dataset, n_docs=6, limit=max(ids) + 1)
    for i in ids:
        ex = examples[i]
        warm_documents(engine, ex, [parse_method(METHOD)])
        ref = tail.load_ref(engine, ex, out / "refs", 8)
        for which in ("v", "k"):
            keep["which"] = which
            row = {**tail.score(engine, ex, METHOD, ref), "method": f"{METHOD}[{which} only]"}
            print(json.dumps(row), flush=True)
            with (out / "records.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
    engine.close()


if __name__ == "__main__":
    main()
