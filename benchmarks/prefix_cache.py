"""Prefix-cache lookup time at 10 and at 10 000 cached prompts, side by side.

Every prompt is a shared 64-token system prompt and its own 192-token tail (the KV is
tiny, one layer, one head: only the index is measured). Queries are a cached prompt plus
a new 16-token question (a hit on the whole prompt) or a new tail (a hit on the system
prompt only). For contrast the same queries run against a linear scan over the prompts,
the algorithm the radix tree replaced. Ends with one JSON line.

    .venv/bin/python benchmarks/prefix_cache.py [--small 10] [--large 10000] [--queries 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvblend.engine.prefix_cache import PrefixCache, PrefixScope
from kvblend.models.kv_cache import KVCache

SCOPE = PrefixScope("bench", "model", "torch.float32")
SYSTEM, TAIL, QUESTION = 64, 192, 16


def prompts(n: int, gen: torch.Generator) -> list[torch.Tensor]:
    system = torch.randint(0, 50_000, (SYSTEM,), generator=gen)
    return [torch.cat([system, torch.randint(0, 50_000, (TAIL,), generator=gen)]) for _ in range(n)]


def filled(ps: list[torch.Tensor]) -> PrefixCache:
    pc, cache = PrefixCache(max_bytes=1 << 34), KVCache(1, 1, 1, SYSTEM + TAIL, torch.float32, "cpu")
    for p in ps:
        pc.insert(SCOPE, p, cache, p.shape[0])
    return pc


def linear_lookup(ps: list[torch.Tensor], ids: torch.Tensor) -> int:
    """The replaced algorithm: the longest common prefix with every cached prompt."""
    best = 0
    for p in ps:
        m = min(p.shape[0], ids.shape[0])
        diff = (p[:m] != ids[:m]).nonzero()
        best = max(best, int(diff[0]) if diff.numel() else m)
    return best


def queries(ps: list[torch.Tensor], count: int, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for i in range(count):
        p = ps[int(torch.randint(0, len(ps), (1,), generator=gen))]
        tail = torch.randint(0, 50_000, (QUESTION if i % 2 == 0 else TAIL,), generator=gen)
        out.append(torch.cat([p if i % 2 == 0 else p[:SYSTEM], tail]))
    return out


def timed(fn, qs: list[torch.Tensor]) -> float:
    """Median seconds of ``fn(q)`` over the queries."""
    times = []
    for q in qs:
        t = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(fns: dict[str, object], qs: dict[str, list[torch.Tensor]], rounds: int) -> dict[str, float]:
    """Median over rounds of each function's median lookup, the functions alternating."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(timed(fn, qs[name]))
    return {name: statistics.median(v) for name, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=10)
    ap.add_argument("--large", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    small, large = prompts(args.small, gen), prompts(args.large, gen)
    t = time.perf_counter()
    trees = {"small": filled(small), "large": filled(large)}
    build_s = time.perf_counter() - t
    qs = {"small": queries(small, args.queries, gen), "large": queries(large, args.queries, gen)}
    for name, ps in (("small", small), ("large", large)):  # the tree agrees with the reference
        assert all(trees[name].lookup(SCOPE, q).length == linear_lookup(ps, q) for q in qs[name][:20])
    radix = interleaved({n: (lambda q, n=n: trees[n].lookup(SCOPE, q)) for n in trees}, qs, args.rounds)
    few = {n: q[: max(4, args.queries // 100)] for n, q in qs.items()}
    linear = interleaved({"small": lambda q: linear_lookup(small, q), "large": lambda q: linear_lookup(large, q)},
                         few, max(1, args.rounds // 2))
    ratio, linear_ratio = radix["large"] / radix["small"], linear["large"] / linear["small"]
    print(f"radix tree   {radix['small'] * 1e6:9.1f} us at {args.small} prompts, "
          f"{radix['large'] * 1e6:9.1f} us at {args.large}: ratio {ratio:.2f}")
    print(f"linear scan  {linear['small'] * 1e6:9.1f} us at {args.small} prompts, "
          f"{linear['large'] * 1e6:9.1f} us at {args.large}: ratio {linear_ratio:.1f}")
    print(f"(medians of per-query medians over {args.rounds} interleaved rounds; {SYSTEM}-token shared system "
          f"prompt + {TAIL}-token tails; building the large tree took {build_s:.2f} s)")
    print(json.dumps({"radix_small_us": round(radix["small"] * 1e6, 1),
                      "radix_large_us": round(radix["large"] * 1e6, 1), "radix_ratio": round(ratio, 2), "linear_small_us": round(linear["small"] * 1e6, 1),
                      "linear_large_us": round(linear["large"] * 1e6, 1), "linear_ratio": round(linear_ratio, 1),
                      "small": args.small, "large": args.large}))


if __name__ == "__main__":
    main()
