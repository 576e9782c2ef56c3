"""Where the default blend's TTFT goes, beside a full prefill: the question pass, the
second pass's attention, and the rest (projections, MLP, re-rotation, selection, shift).

    .venv/bin/python benchmarks/blend_breakdown.py [--repeats 5] [--threads 1]
        [--blend-method blend:0.15:q+budget+sinks4+shift]

Same prompt as ``benchmarks/blend.py``'s TTFT part (6 cached MuSiQue passages x 512
tokens). Times come from wrapping the engine's own functions (``question_scores``, the
fusion's attention calls) with ``perf_counter``; attention work is counted in
query-key pairs from the attention plans. Methods alternate per round; medians of each
part over rounds. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import kvblend.blend.fusion as fusion
import kvblend.blend.strategies as strategies
import kvblend.models.transformer as transformer
from blend import DEFAULT_DATA, fixed_length_docs
from kvblend.engine import Engine, Request
from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, load_musique, musique_query
from kvblend.eval.runner import parse_method
from kvblend.models import DEFAULT_MODEL, load_model
from kvblend.models.attention import AttentionPlan


class Meter:
    """Seconds and query-key pairs per part of the current request, from wrapped functions.
    Attention inside the question pass counts as the question pass's (its scorer attends)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = defaultdict(float)
        self.pairs = 0
        self.in_question = False

    def reset(self) -> None:
        self.parts.clear()
        self.pairs = 0

    def question_pass(self, fn):
        """Wrap ``question_scores_steps`` (a step generator, run to its end by its caller)."""
        def run(*args, **kwargs):
            t, self.in_question = time.perf_counter(), True
            try:
                return (yield from fn(*args, **kwargs))
            finally:
                self.in_question = False
                self.parts["question_pass"] += time.perf_counter() - t
        return run

    def attention(self, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if not self.in_question:
                    self.parts["attention"] += time.perf_counter() - t
        return run

    def counted(self, fn):
        def plan(q_pos: torch.Tensor, n_keys: int, *args, **kwargs) -> AttentionPlan:
            if not self.in_question:
                self.pairs += int((q_pos + 1).sum())  # causal pairs actually needed
            return fn(q_pos, n_keys, *args, **kwargs)
        return plan


def install(meter: Meter) -> None:
    """Wrap what fusion and the model call (module attributes, so their calls go through them)."""
    strategies.question_scores_steps = meter.question_pass(strategies.question_scores_steps)
    for module in (fusion, transformer):
        module.attend_planned = meter.attention(module.attend_planned)
        module.attend = meter.attention(module.attend)
        module.plan_attention = meter.counted(module.plan_attention)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blend-method", default="blend:0.15:q+budget+sinks4+shift")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = parse_method(args.blend_method)
    engine = Engine(load_model(DEFAULT_MODEL))
    examples = load_musique(DEFAULT_DATA, n_docs=6, limit=10)
    docs = fixed_length_docs(engine, examples, 6, 512)

    def request(method: str, order=range(6), q: str = musique_query(examples[0].question)) -> Request:
        return Request(documents=[docs[i] for i in order], question=q, system=MUSIQUE_INSTRUCTION, method=method,
                       blend=spec.blend)

    engine.prepare(request("blend", order=[5, 4, 3, 2, 1, 0], q=musique_query("warm-up")))  # stores the chunks
    engine.flush()
    meter = Meter()
    install(meter)
    rounds: dict[str, list[dict[str, float]]] = {"full": [], "blend": []}
    for i in range(args.repeats + 1):
        for method in rounds:
            meter.reset()
            t = time.perf_counter()
            prepared = engine.prepare(request(method))
            row = {"total": time.perf_counter() - t, **meter.parts, "pairs": meter.pairs,
                   "tokens": sum(prepared.stats.recomputed_per_layer)}
            if i:  # the first round is a warm-up
                rounds[method].append(row)
    med = {m: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]} for m, rs in rounds.items()}
    full, blend = med["full"], med["blend"]
    q, second_attention = blend.get("question_pass", 0.0), blend["attention"]
    out = {
        "blend_method": spec.label,
        "full_s": full["total"], "blend_s": blend["total"],
        "blend_over_full": blend["total"] / full["total"],
        "question_pass_over_full": q / full["total"],
        "attention_over_full": second_attention / full["total"],
        "rest_over_full": (blend["total"] - q - second_attention) / full["total"],
        "pairs_over_full": blend["pairs"] / full["pairs"],
        "token_layers_over_full": blend["tokens"] / full["tokens"],
        "full_attention_share": full["attention"] / full["total"],
        "attention_s_per_mpair_full": full["attention"] / full["pairs"] * 1e6,
        "attention_s_per_mpair_blend": second_attention / max(blend["pairs"], 1) * 1e6,
    }
    print(f"{args.repeats} rounds, {args.threads} thread(s), medians; blend = {spec.label}")
    for k, v in out.items():
        print(f"  {k:30s} {v:.4f}" if isinstance(v, float) else f"  {k:30s} {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
