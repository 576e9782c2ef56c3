"""Is the choice of tokens what limits a blend at its ratio? Two probes through ``tail.py``.

    PYTHONPATH=src .venv/bin/python benchmarks/selection_bound.py --probe attention -- \
        --model qwen2.5-coder-0.5b --out runs/bound/attention --start 7 --limit 10 --threads 1 \
        --methods "reuse,blend:0.15:oracle+budget+sinks4"

(``+shift`` left out: on a model whose shift test fails, a blend naming it recomputes twice
its ratio, ``Engine.blend_config``; on one that keeps the shift, name it as the default does.)
Each probe swaps the score behind the eval-only ``oracle`` selection
(``strategies.oracle_scores``) and runs ``benchmarks/tail.py`` with the arguments after
``--``; a method ``blend:R:oracle+...`` then keeps R of the candidates by that score,
with the same budgets and sinks as the default:

- ``attention``: the question's attention over the documents in a *full prefill* (fresh
  K/V at every layer), summed as question selection sums it over reused K/V. No
  selection that ranks by what the question reads can pick better tokens at R, so if
  this is no better than the default, the choice is not what limits the blend.
- ``rescore``: two stages at a cost of 1.5 blends: the default blend at R / 2, then the
  question's attention in that blend's final pass (over a cache whose chosen tokens are
  fresh) ranks every candidate again for a blend at R.

Records land in ``OUT/records.jsonl`` like any ``tail.py`` run (``--report`` reads them).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from dataclasses import replace
from pathlib import Path

import torch

import kvblend.blend.strategies as strategies
from kvblend.blend.fusion import fuse

TAIL = Path(__file__).resolve().parent / "tail.py"


def _scorer(model, plan) -> strategies.QuestionScores:
    n = plan.ids.shape[0]
    first_row = max((b for _, b in strategies.document_spans(plan)), default=n)
    return strategies.QuestionScores(n, first_row, [layer.window for layer in model.layers], model.device)


def attention_in_full_prefill(model, plan) -> torch.Tensor:
    """(N,) the question rows' attention mass on each token, every token computed fresh."""
    scorer = _scorer(model, plan)
    every = torch.ones(plan.ids.shape[0], dtype=torch.bool, device=model.device)
    fuse(model, replace(strategies._base(plan), select_from_start=True, recompute=every, observe=scorer))
    return scorer.total


def rescored_after_half_blend(model, plan) -> torch.Tensor:
    """(N,) the question rows' attention mass in the final pass of the default blend at half the ratio."""
    scorer = _scorer(model, plan)
    plain = strategies.fuse_steps

    def observed(model_, plan_):  # the blend's second pass (it names the tokens to recompute)
        if plan_.recompute is not None:
            plan_ = replace(plan_, observe=scorer)
        return (yield from plain(model_, plan_))

    strategies.fuse_steps = observed
    try:
        half = replace(plan, strategy=replace(plan.strategy, selection="question"),
                       ratios=tuple(r / 2 for r in plan.ratios))
        strategies.run_strategy(model, half)
    finally:
        strategies.fuse_steps = plain
    return scorer.total


PROBES = {"attention": attention_in_full_prefill, "rescore": rescored_after_half_blend}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", choices=sorted(PROBES), required=True)
    ap.add_argument("tail_args", nargs=argparse.REMAINDER, help="after --: tail.py's arguments")
    args = ap.parse_args()
    strategies.oracle_scores = PROBES[args.probe]
    sys.argv = [str(TAIL), *[a for a in args.tail_args if a != "--"]]
    runpy.run_path(str(TAIL), run_name="__main__")


if __name__ == "__main__":
    main()
