"""Requests whose documents partly missed the store, under the default (question) selection:
quality against full prefill and TTFT, with the missed documents blended from the question
pass (now) beside computing them again in the second pass (before session 7).

    .venv/bin/python benchmarks/partial_miss.py [--limit 10] [--missing 2] [--threads 1]

``--missing`` names the passages (0-based, of 6) kept out of the store; every other
passage is stored first. Per question, in one run: ``full`` (the reference), ``twice``
(the old cost: the strategy is given no missed spans, so the second pass computes the
missed passages in full again; this holds for passages after the first stored one, so keep
passage 0 stored), ``held`` (the engine as it is) and ``all_hit`` (every
passage stored). Misses written back by a request are deleted before the next one.
KL along the reference's first 8 tokens, agree-F1 and first-token agreement as in
``kvblend eval``. Ends with one JSON line of means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvblend.blend.strategies as strategies
from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import MethodSpec, decode_answer, example_request, reference, score_prepared
from kvblend.models import DEFAULT_MODEL, load_model

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
KEYS = ("kl", "agree_f1", "first_token_agree", "ttft_s")


def forget_new(engine: Engine, known: set) -> None:
    """Delete what write-back stored since ``known`` (a miss must stay a miss)."""
    engine.flush()
    for key in set(engine.store.keys("default")) - known:
        engine.store.delete(key)


def one_question(engine: Engine, ex, missing: set[int]) -> dict[str, dict[str, float]]:
    req = example_request(ex, MethodSpec("blend", "blend", BlendConfig()))
    layout = engine.layout(req)
    prefix = engine.chunk_prefix(req, layout)
    engine.warm([d for i, d in enumerate(layout.docs) if i not in missing], prefix)
    known = set(engine.store.keys("default"))
    ref, full = reference(engine, ex, 32, 8)
    out, real = {"full": full}, strategies.missed_spans
    for name in ("twice", "held", "all_hit"):
        strategies.missed_spans = (lambda plan: []) if name == "twice" else real
        if name == "all_hit":
            engine.warm(list(layout.docs), prefix)
        try:
            t = time.perf_counter()
            prepared = engine.prepare(req, 32)
            ttft = time.perf_counter() - t
        finally:
            strategies.missed_spans = real
        assert sum(not d.hit for d in prepared.stats.docs) == (0 if name == "all_hit" else len(missing))
        text, ids = decode_answer(engine, prepared, 32)
        out[name] = score_prepared(engine, prepared, ex, ref, text, ids, ttft, 8)
        forget_new(engine, known)
    for key in engine.store.keys("default"):
        engine.store.delete(key)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--missing", default="2", help="comma-separated passage indices (0-5) not stored")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    missing = {int(x) for x in args.missing.split(",")}
    if not missing <= set(range(1, 6)):
        ap.error("--missing takes passages 1-5: passage 0 stays stored (see 'twice' above)")
    engine = Engine(load_model(DEFAULT_MODEL))
    rows: dict[str, list[dict]] = {}
    for ex in load_musique(args.dataset, n_docs=6, limit=args.limit):
        for name, scores in one_question(engine, ex, missing).items():
            rows.setdefault(name, []).append(scores)
    means = {name: {k: statistics.fmean(float(r[k]) for r in rs) for k in KEYS} for name, rs in rows.items()}
    print(f"{args.limit} questions, passages {sorted(missing)} of 6 missed, default blend:")
    for name, m in means.items():
        print(f"  {name:8s} KL {m['kl']:.4f}  agree-F1 {m['agree_f1']:.3f}  first {m['first_token_agree']:.2f}  "
              f"TTFT {m['ttft_s']:.2f} s")
    print(f"  TTFT held / twice {means['held']['ttft_s'] / means['twice']['ttft_s']:.3f}, "
          f"held / full {means['held']['ttft_s'] / means['full']['ttft_s']:.3f}")
    print(json.dumps({"missing": sorted(missing), "n": args.limit, **means}))


if __name__ == "__main__":
    main()
