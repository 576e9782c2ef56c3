"""Where the paper's deviation selection puts its picks, against question attention's.

    PYTHONPATH=src .venv/bin/python benchmarks/selection_probe.py [--model qwen2.5-coder-0.5b] [--limit 4]

For each MuSiQue question (6 passages, cached first): the share of the picks that fall on
each passage's first 4 tokens, how concentrated the deviation is (share of its mass in the
top 15 % of tokens), and how many of question attention's picks it shares, for CacheBlend at
check layer 1 (``cacheblend:0.15``), deviation at check layer 4, and question selection
(``blend:0.15:q``). Reads the kept positions through ``selection_stats`` (wrapped here).
Ends with one JSON line of the means.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import kvblend.blend.fusion as fusion
import kvblend.blend.strategies as strategies
from kvblend.blend.config import PLAIN_STRATEGY, BlendConfig
from kvblend.engine import Engine, Request
from kvblend.eval.datasets import load_musique, musique_prompt
from kvblend.models import load_model

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
CONFIGS = {"cacheblend@1": BlendConfig.cacheblend(0.15),
           "deviation@4": BlendConfig(ratio=0.15, check_layers=(4,), **PLAIN_STRATEGY),
           "q": BlendConfig(ratio=0.15, **{**PLAIN_STRATEGY, "selection": "question"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model))
    seen: list[tuple[torch.Tensor, torch.Tensor, list]] = []
    real = fusion.selection_stats

    def spy(layer, dev, kept, spans):
        seen.append((dev.clone(), kept.clone(), list(spans)))
        return real(layer, dev, kept, spans)

    fusion.selection_stats = strategies.selection_stats = spy
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for ex in load_musique(args.dataset, n_docs=6, limit=args.limit):
        system, query = musique_prompt(ex.question, "after")
        engine.prepare(Request(documents=ex.documents, question=query, system=system, method="reuse"))
        engine.flush()  # every passage cached: each selection sees the same candidates
        kept_sets = {}
        for name, cfg in CONFIGS.items():
            seen.clear()
            engine.prepare(Request(documents=ex.documents, question=query, system=system, method="blend", blend=cfg))
            dev, kept, spans = seen[-1]
            offsets = torch.cat([kept[(kept >= a) & (kept < b)] - a for a, b in spans])
            row = {"first4": float((offsets < 4).float().mean())}
            if name != "q":  # question selection's probe scores only its own picks
                d = dev.float().sort(descending=True).values
                row["top15_mass"] = float(d[: max(1, int(0.15 * d.numel()))].sum() / d.sum())
            kept_sets[name] = set(kept.tolist())
            rows[name].append(row)
        for name in ("cacheblend@1", "deviation@4"):
            rows[name][-1]["overlap_q"] = len(kept_sets[name] & kept_sets["q"]) / len(kept_sets["q"])
        print(ex.id, json.dumps({k: v[-1] for k, v in rows.items()}), flush=True)
    means = {name: {k: round(statistics.mean(r[k] for r in rs), 3) for k in rs[0]} for name, rs in rows.items()}
    print(json.dumps({"model": args.model, "questions": args.limit, **means}))


if __name__ == "__main__":
    main()
