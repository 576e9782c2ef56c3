"""What the first request over documents no tier holds costs, by how a miss is handled.

A cold store: every document of the request is a miss. Two ways to serve it:

* ``in-prompt`` (``blend.recompute_misses: true``): the missed documents are computed
  exactly inside the prompt (the answer is a full prefill's), and their position-independent
  chunk KV is computed a second time in the background for later requests;
* ``alone`` (``recompute_misses: false``): each missed document is computed alone first,
  stored at once, and blended: one computation, and the next request finds it at any load.

Per question, side by side in one run: full prefill's TTFT, each mode's first-request
TTFT (the background write-back of ``in-prompt`` is timed apart: it is work the server
still owes), and each answer's KL to full prefill over full prefill's first
``--answer-tokens`` greedy tokens (teacher-forced), beside plain reuse's KL (the
KL ratio that `benchmarks/tail.py` reports). Prints one line per question and one JSON line.

    PYTHONPATH=src .venv/bin/python benchmarks/first_request.py --limit 10 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, PrefixCache, Request
from kvblend.engine.calibration import decode_answer, teacher_force
from kvblend.eval.datasets import load_musique
from kvblend.metrics import kl_divergence
from kvblend.models import DEFAULT_MODEL, load_model
from kvblend.store.config import StoreConfig, build_store

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"
SYSTEM = "Answer the question from the passages. Give only the answer, in a few words."


def fresh_engine(loaded, base: Engine) -> Engine:
    """An engine over the same model with an empty memory store and no prefix cache (every
    document a miss; nothing carried over), sharing the tests already run by ``base``."""
    eng = Engine(loaded, store=build_store(StoreConfig(tiers=("memory",))), prefix_cache=PrefixCache(0),
                 self_check=False, calibrate=False)
    eng.self_check, eng.shift_verdict = base.self_check, base.shift_verdict
    return eng


def kl_along(engine: Engine, request: Request, answer: list[int], reference: torch.Tensor) -> tuple[float, float]:
    """(TTFT, mean KL to ``reference`` along ``answer``) of one prepare."""
    t = time.perf_counter()
    prepared = engine.prepare(request, len(answer))
    ttft = time.perf_counter() - t
    rows = teacher_force(engine, prepared, answer)
    return ttft, float(kl_divergence(reference, rows))


def one(loaded, base: Engine, question: str, docs: tuple[str, ...], answer_tokens: int) -> dict:
    req = Request(documents=docs, question=f"Question: {question}\nAnswer:", system=SYSTEM, method="full")
    eng = fresh_engine(loaded, base)
    t = time.perf_counter()
    full = eng.prepare(req, answer_tokens)
    full_s = time.perf_counter() - t
    _, answer = decode_answer(eng, full, answer_tokens)
    answer = answer or [int(full.logits.argmax())]
    reference = teacher_force(eng, full, answer)
    row = {"tokens": len(full.layout), "full_s": full_s}
    for name, misses in (("in_prompt", True), ("alone", False)):
        eng = fresh_engine(loaded, base)
        cfg = BlendConfig(recompute_misses=misses)
        row[f"{name}_s"], row[f"{name}_kl"] = kl_along(eng, replace(req, method="blend", blend=cfg), answer, reference)
        t = time.perf_counter()
        eng.flush()  # in-prompt: the chunk KV still owed; alone: already stored
        row[f"{name}_owed_s"] = time.perf_counter() - t
    eng = fresh_engine(loaded, base)
    eng.warm(list(docs), eng.sink_prefix)
    _, row["reuse_kl"] = kl_along(eng, replace(req, method="reuse"), answer, reference)
    _, row["warm_blend_kl"] = kl_along(eng, replace(req, method="blend"), answer, reference)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    base = Engine(loaded)  # self-check and shift test, once
    examples = load_musique(args.data, n_docs=args.docs)[args.start : args.start + args.limit]
    rows = []
    for ex in examples:
        row = one(loaded, base, ex.question, tuple(ex.documents), args.answer_tokens)
        rows.append(row)
        print(f"{ex.id}: {row['tokens']} tokens  full {row['full_s']:.2f}s  "
              f"in-prompt {row['in_prompt_s']:.2f}s (+{row['in_prompt_owed_s']:.2f}s owed) KL/reuse "
              f"{row['in_prompt_kl'] / row['reuse_kl']:.3f}  alone {row['alone_s']:.2f}s KL/reuse "
              f"{row['alone_kl'] / row['reuse_kl']:.3f}  warm blend KL/reuse {row['warm_blend_kl'] / row['reuse_kl']:.3f}",
              flush=True)
    med = lambda key: statistics.median(r[key] / r["full_s"] for r in rows)  # noqa: E731
    ratio = lambda key: statistics.fmean(r[key] / r["reuse_kl"] for r in rows)  # noqa: E731
    print(json.dumps({
        "model": args.model, "questions": len(rows), "docs": args.docs,
        "in_prompt_ttft_over_full": round(med("in_prompt_s"), 3),
        "in_prompt_with_owed_over_full": round(statistics.median(
            (r["in_prompt_s"] + r["in_prompt_owed_s"]) / r["full_s"] for r in rows), 3),
        "alone_ttft_over_full": round(med("alone_s"), 3),
        "in_prompt_kl_over_reuse": round(ratio("in_prompt_kl"), 4),
        "alone_kl_over_reuse": round(ratio("alone_kl"), 4),
        "warm_blend_kl_over_reuse": round(ratio("warm_blend_kl"), 4),
    }))


if __name__ == "__main__":
    main()
