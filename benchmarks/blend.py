"""CacheBlend on SmolLM2 and MuSiQue: quality against full prefill, and TTFT side by side.

    .venv/bin/python benchmarks/blend.py [--dataset ../shared/data/musique_dev.json]
        [--limit 10] [--ratios 0.05,0.15,0.3,0.5] [--repeats 5] [--skip-quality]
        [--blend-method blend:0.15:q+shift] [--also blend:0.3] [--model smollm2-135m] [--threads 1]

TTFT part (``blend`` = the engine's default strategy at ``--ratio``, or the method spec
``--blend-method`` names; ``cacheblend`` = the paper's selection at ``--ratio``):
6 documents of 512 tokens (MuSiQue passages cut to length), all cached; the
prefix cache has seen them in another order, so `prefix` reuses the system prompt only.
Methods are timed alternately so machine noise hits all alike; ratios are given of the
medians, as the median of per-round ratios, and best against best. ``--also`` times one more
method spec beside them (e.g. the default blend at another ratio). ``escalated`` is
``blend`` for a tenant whose recent risks all lie below its own, so that it escalates
(``engine.escalation``): without the shift (a model whose shift test failed) it recomputes
again at twice its ratio, with it the whole blend runs again at twice its ratio; what the
requests that escalate pay. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.engine.escalation import WINDOW
from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, load_musique, musique_query
from kvblend.eval.runner import MethodSpec, parse_method, run_example
from kvblend.models import DEFAULT_MODEL, load_model

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def fixed_length_docs(engine: Engine, examples, n_docs: int, tokens: int) -> list[tuple[int, ...]]:
    """``n_docs`` documents of exactly ``tokens`` ids, cut from consecutive passages."""
    stream: list[int] = []
    for ex in examples:
        for doc in ex.documents:
            stream += engine.tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(stream) >= n_docs * tokens:
            break
    return [tuple(stream[i * tokens : (i + 1) * tokens]) for i in range(n_docs)]


def blend_specs(ratio: float, blend_method: str | None, also: str | None = None) -> dict[str, MethodSpec]:
    """What ``blend`` and ``cacheblend`` time: ``blend_method`` (a method spec of blend, e.g.
    ``blend:0.15:q+shift``) or the engine's default blend at ``ratio``; the paper's selection
    at ``ratio``. ValueError for a spec that is not a blend."""
    blend = parse_method(blend_method) if blend_method else MethodSpec(f"blend:{ratio}", "blend",
                                                                        BlendConfig(ratio=ratio))
    if blend.method != "blend":
        raise ValueError(f"--blend-method must be a blend method (blend:..., cacheblend:...), got {blend_method!r}")
    specs = {"blend": blend, "cacheblend": parse_method(f"cacheblend:{ratio}")}
    if also:
        specs["also"] = parse_method(also)
    return specs


# ``prefix`` runs under a tenant of its own: its prompt enters that tenant's prefix cache
# whole, and under the shared one it would serve the next method's request as an exact
# prefix hit (every method but ``full`` reads the prefix cache)
TENANTS = {"escalated": "escalated", "prefix": "prefix"}


def ttft_section(engine: Engine, examples, ratio: float, repeats: int, blend_method: str | None = None,
                 also: str | None = None
                 ) -> tuple[dict[str, float], dict[str, list[float]], dict[str, float], dict[str, bool]]:
    """Median TTFT and every round's per method, the share of the prompt each recomputed
    as it ran (a model whose shift test fails runs a blend asking for the shift at twice its
    ratio, so the spec's ratio is not always what ran), and whether it escalated."""
    docs = fixed_length_docs(engine, examples, 6, 512)
    question = musique_query(examples[0].question)
    specs = blend_specs(ratio, blend_method, also)

    def request(method: str, order=None, q: str = question, tenant: str | None = None) -> Request:
        """``blend``: the chosen blend method; ``cacheblend``: the paper's selection;
        ``escalated``: ``blend`` for the tenant whose every blend escalates."""
        ds = [docs[i] for i in (order or range(len(docs)))]
        spec = specs.get("blend" if method == "escalated" else method)
        return Request(documents=ds, question=q, system=MUSIQUE_INSTRUCTION,
                       method=spec.method if spec else method, blend=spec.blend if spec else BlendConfig(ratio=ratio),
                       tenant=tenant or TENANTS.get(method, "default"))

    def warm_prefixes() -> None:  # each tenant's prefix cache holds the system prompt, from another order
        for tenant in ("default", *TENANTS.values()):
            engine.prepare(request("prefix", order=[5, 4, 3, 2, 1, 0], q=musique_query("warm-up"), tenant=tenant))

    for m in ("blend", "escalated"):  # each tenant's store
        engine.prepare(request(m, order=[5, 4, 3, 2, 1, 0], q=musique_query("warm-up")))
    warm_prefixes()
    engine.flush()
    for _ in range(WINDOW):  # a tenant whose recent risks lie below any blend's, for more rounds than are timed
        for kind in ("moved", "shift"):
            engine.escalation.add("escalated", 0.0, kind)
    times: dict[str, list[float]] = {m: [] for m in ("full", "prefix", "reuse", "blend", "escalated", "cacheblend",
                                                     *specs)}
    recomputed: dict[str, float] = {}
    escalated: dict[str, bool] = {}
    for _ in range(repeats + 1):
        for m in times:
            t = time.perf_counter()
            stats = engine.prepare(request(m)).stats
            times[m].append(time.perf_counter() - t)
            recomputed[m], escalated[m] = stats.recompute_frac, stats.escalated
        engine.prefix_cache.clear()  # `prefix` must not reuse its own last run ...
        warm_prefixes()  # ... only other orders
    times = {m: v[1:] for m, v in times.items()}  # the first round is a warm-up
    med = {m: statistics.median(v) for m, v in times.items()}
    tokens = engine.prepare(request("full")).stats.prompt_tokens
    print(f"\nTTFT, 6 cached docs x 512 tokens ({tokens}-token prompt), median of {repeats}; "
          f"blend = {specs['blend'].label}, cacheblend = {specs['cacheblend'].label}:")
    print("  method   median s   best s   x full (medians)   x full (paired)   x full (best)   recomputed")
    for m, v in times.items():
        print(f"  {m:10s} {med[m]:8.3f} {min(v):8.3f}   {med[m] / med['full']:16.3f}   "
              f"{paired_ratio(v, times['full']):15.3f}   {min(v) / min(times['full']):13.3f}   {recomputed[m]:10.3f}")
    return med, times, recomputed, escalated


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b within one round: the shared host's speed drifts by tens of
    percent over minutes, and the methods of one round run seconds apart."""
    return statistics.median(x / y for x, y in zip(a, b))


def quality_section(engine: Engine, examples, ratios: list[float]) -> dict[str, dict[str, float]]:
    specs = [parse_method(m) for m in ["prefix", "reuse"] + [f"blend:{r}" for r in ratios]]
    specs = [replace(s, blend=replace(s.blend, escalate=None)) for s in specs]  # each ratio as named, every time
    rows: dict[str, list[dict]] = {}
    for i, ex in enumerate(examples):
        scores = run_example(engine, ex, specs)
        for label, s in scores.items():
            rows.setdefault(label, []).append(s)
        print(f"  example {i + 1}/{len(examples)} done", file=sys.stderr, flush=True)
    keys = ("agree_f1", "first_token_agree", "kl", "gold_nll", "gold_f1", "ttft_s", "recompute_frac")
    summary = {label: {k: statistics.fmean(float(r[k]) for r in rs if not math.isnan(float(r[k]))) for k in keys}
               for label, rs in rows.items()}
    print(f"\nQuality vs full prefill, MuSiQue first {len(examples)} examples, 6 passages:")
    print("  method        agree_f1  first_tok  KL(full||m)  gold_nll  gold_f1  ttft_s  recompute")
    for label, s in summary.items():
        print(f"  {label:12s}  {s['agree_f1']:8.3f}  {s['first_token_agree']:9.2f}  {s['kl']:11.4f}  "
              f"{s['gold_nll']:8.3f}  {s['gold_f1']:7.3f}  {s['ttft_s']:6.2f}  {s['recompute_frac']:9.3f}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--ratios", default="0.05,0.15,0.3,0.5")
    ap.add_argument("--ratio", type=float, default=BlendConfig.ratio, help="blend ratio for the TTFT part (default: the default blend's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--blend-method", default=None,
                    help="method spec timed as blend (default: the engine's default blend at --ratio), "
                         "e.g. blend:0.15:q+shift; cacheblend is always the paper's at --ratio")
    ap.add_argument("--also", default=None, help="one more method spec timed beside them, e.g. blend:0.3")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    specs = blend_specs(args.ratio, args.blend_method, args.also)  # a bad spec fails before any model work
    engine = Engine(load_model(args.model))
    examples = load_musique(args.dataset, n_docs=6, limit=max(args.limit, 3))
    med, times, recomputed, escalated = ttft_section(engine, examples, args.ratio, args.repeats, args.blend_method, args.also)
    result = {"ttft_full_s": med["full"], "ttft_prefix_s": med["prefix"], "ttft_reuse_s": med["reuse"],
              "ttft_blend_s": med["blend"],
              "ttft_cacheblend_s": med["cacheblend"],
              "blend_over_full": med["blend"] / med["full"], "blend_over_prefix": med["blend"] / med["prefix"],
              "cacheblend_over_full": med["cacheblend"] / med["full"],
              "cacheblend_over_full_paired": paired_ratio(times["cacheblend"], times["full"]),
              "blend_over_full_paired": paired_ratio(times["blend"], times["full"]),
              "blend_over_prefix_paired": paired_ratio(times["blend"], times["prefix"]),
              "blend_over_full_best": min(times["blend"]) / min(times["full"]),
              "blend_over_prefix_best": min(times["blend"]) / min(times["prefix"]), "blend_ratio": args.ratio,
              "blend_method": specs["blend"].label, "cacheblend_method": specs["cacheblend"].label,
              "threads": args.threads, "model": args.model,
              "recompute_frac": {m: round(v, 4) for m, v in recomputed.items()}}
    up = BlendConfig().escalate  # the share of moved-risk blends that escalate: about 1 - this
    result.update({"escalated_over_full": med["escalated"] / med["full"],
                   "escalated_over_full_paired": paired_ratio(times["escalated"], times["full"]),
                   "escalated_over_blend_paired": paired_ratio(times["escalated"], times["blend"]),
                   "escalates": escalated["escalated"],
                   "served_over_full": (up * med["blend"] + (1 - up) * med["escalated"]) / med["full"]})
    if args.also:
        result.update({"also_method": specs["also"].label, "also_over_full": med["also"] / med["full"],
                       "also_over_full_paired": paired_ratio(times["also"], times["full"]),
                       "also_over_blend_paired": paired_ratio(times["also"], times["blend"])})
    if not args.skip_quality:
        engine.prefix_cache.clear()
        summary = quality_section(engine, examples[: args.limit], [float(r) for r in args.ratios.split(",")])
        result["quality"] = {k: {m: round(v, 4) for m, v in s.items()} for k, s in summary.items()}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
