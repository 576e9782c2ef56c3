"""Layer-pipelined loading and the loading controller on SmolLM2, side by side in one run.

    .venv/bin/python benchmarks/pipeline.py [--rounds 3] [--threads 1] [--slow-mbps 50,10]

Six cached documents of 512 tokens (MuSiQue passages cut to length) and one question.
Every engine shares the model and has seen the system prompt (prefix cache) and the
documents (its store) before timing. Timed, alternately in each round so machine noise
hits all alike, medians reported:

* blend at the default ratio with the documents in memory, on disk (page cache) and on
  Redis (loopback), loaded layer by layer during fusion (pipelined) and whole before it
  (serial): ``disk_over_memory`` and ``redis_over_memory`` are pipelined / memory;
* reuse (ratio 0, where loading is most of the time): pipelined against serial;
* disks slowed to each of ``--slow-mbps`` MB/s: blend at the default ratio, and ``auto``
  (the controller picks the ratio to fill the wait with recompute); TTFT and next-token
  KL against full prefill (and serial loading at the first bandwidth).

``load_wait_s`` is the time the worker waited on loads (summed over layers) for pipelined
blend from disk; per-layer waits are printed. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blend import DEFAULT_DATA, fixed_length_docs  # noqa: E402

from kvblend.blend.config import BlendConfig  # noqa: E402
from kvblend.data import MUSIQUE_SAMPLE  # noqa: E402
from kvblend.engine import Engine, Request  # noqa: E402
from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, load_musique, musique_query  # noqa: E402
from kvblend.metrics import kl_divergence  # noqa: E402
from kvblend.models import DEFAULT_MODEL, load_model  # noqa: E402
from kvblend.pipeline.profile import Profile, measure_layer, measure_tier  # noqa: E402
from kvblend.store import StoreConfig, build_store  # noqa: E402
from kvblend.store.localredis import LocalRedis  # noqa: E402
from kvblend.store.throttle import ThrottledDisk  # noqa: E402
from kvblend.store.tiered import TieredStore  # noqa: E402

GiB = 1024**3


def documents(engine: Engine) -> tuple[list[tuple[int, ...]], str]:
    path = DEFAULT_DATA if DEFAULT_DATA.exists() else MUSIQUE_SAMPLE
    examples = load_musique(path, limit=20)
    docs = fixed_length_docs(engine, examples, 6, 512)
    if any(len(d) < 512 for d in docs):
        raise SystemExit(f"{path} has fewer than 6 x 512 tokens of passages")
    return docs, musique_query(examples[0].question)


def request(docs, question: str, method: str, ratio: float | str = 0.15) -> Request:
    return Request(documents=docs, question=question, system=MUSIQUE_INSTRUCTION, method=method,
                   blend=BlendConfig(ratio=ratio))


def engines(loaded, tmp: Path, redis_url: str, slow_mbps: list[float]) -> dict[str, Engine]:
    disk = lambda name: build_store(StoreConfig(tiers=("disk",), disk_dir=str(tmp / name), disk_fsync=False))  # noqa: E731
    redis = build_store(StoreConfig(tiers=("redis",), redis_url=redis_url, redis_timeout_s=30.0))
    disk_store = disk("disk")
    slow = {f"slow{m:g}": Engine(loaded, TieredStore([ThrottledDisk(tmp / f"slow{m:g}", 4 * GiB, bytes_per_s=m * 1e6,
                                                                    fsync=False)])) for m in slow_mbps}
    return slow | {
        "memory": Engine(loaded, build_store(StoreConfig(tiers=("memory",), memory_bytes=4 * GiB))),
        "disk": Engine(loaded, disk_store),
        "disk_serial": Engine(loaded, disk_store, pipeline=False),
        "redis": Engine(loaded, redis),
        "redis_serial": Engine(loaded, redis, pipeline=False),
    }


def quick_profile(engine: Engine, measure: bool = True) -> Profile:
    """The controller's inputs measured here (the layer fit unless not ``measure``, the
    engine's tiers); the prefill fit is not used by the controller and is left out to keep
    the run short on a busy machine."""
    model = engine.model
    tiers = {t.name: measure_tier(t, model.cfg, repeats=1) for t in engine.store.tiers}
    layer = measure_layer(model, actives=(64, 512, 1536), contexts=(3200,)) if measure else (0.0, 0.0, 0.0)
    return Profile(engine.loaded.fingerprint, str(model.device), "float32", (0.0, 0.0, 0.0), layer, tiers)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    parser.add_argument("--slow-mbps", default="50,10", help="comma-separated bandwidths of slowed disks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.slow = [float(x) for x in args.slow_mbps.split(",")]
    loaded = load_model(DEFAULT_MODEL)
    with tempfile.TemporaryDirectory(prefix="kvblend-pipe-") as tmp, LocalRedis() as server:
        engs = engines(loaded, Path(tmp), server.url, args.slow)
        docs, question = documents(engs["memory"])
        first = request(docs, question, "blend")
        for eng in engs.values():
            eng.warm(list(docs), eng.chunk_prefix(first, eng.layout(first)))
            eng.prepare(request(docs[::-1], musique_query("warm-up"), "blend"))  # the prefix cache
            eng.flush()
        layer_fit = quick_profile(engs["memory"]).layer
        for m in args.slow:
            eng = engs[f"slow{m:g}"]
            eng._profile = replace(quick_profile(eng, measure=False), layer=layer_fit)
        run_rounds(engs, docs, question, args)


def run_rounds(engs: dict[str, Engine], docs, question: str, args: argparse.Namespace) -> None:
    cases = {f"blend_{n}": (n, "blend", 0.15) for n in ("memory", "disk", "disk_serial", "redis", "redis_serial")}
    cases |= {f"reuse_{n}": (n, "reuse", 0.15) for n in ("memory", "disk", "disk_serial", "redis", "redis_serial")}
    for m in args.slow:
        cases |= {f"slow{m:g}_fixed": (f"slow{m:g}", "blend", 0.15), f"slow{m:g}_auto": (f"slow{m:g}", "blend", "auto")}
    cases[f"slow{args.slow[0]:g}_serial"] = (f"slow{args.slow[0]:g}", "blend", 0.15)
    times = {c: [] for c in cases}
    waits = {c: [] for c in cases}
    logits, stats = {}, {}
    for _ in range(args.rounds):
        for case, (name, method, ratio) in cases.items():
            eng = engs[name]
            eng.pipeline = not case.endswith("_serial")
            seconds, prepared = timed(lambda: eng.prepare(request(docs, question, method, ratio)))
            times[case].append(seconds)
            waits[case].append(prepared.stats.loading.wait_s if prepared.stats.loading else ())
            logits[case], stats[case] = prepared.logits, prepared.stats
    full = engs["memory"].prepare(request(docs, question, "full")).logits
    report(times, waits, logits, stats, full, args)


def med(xs) -> float:
    return statistics.median(xs)


def report(times, waits, logits, stats, full, args) -> None:
    t = {c: med(v) for c, v in times.items()}
    print(f"TTFT medians over {args.rounds} rounds (s), {args.threads} torch thread(s):")
    for c, v in t.items():
        wait = [sum(w) for w in waits[c] if w]
        extra = f"   worker waited on loads {med(wait):.3f} s" if wait else ""
        print(f"  {c:18s} {v:7.3f}{extra}")
    per_layer = [med(col) for col in zip(*[w for w in waits["blend_disk"] if w])]
    print("blend from disk, worker wait per layer (ms):", " ".join(f"{x * 1e3:.1f}" for x in per_layer))
    kl = {c: kl_divergence(full, logits[c]) for c in logits}
    slow = {}
    for m in args.slow:
        f, a = f"slow{m:g}_fixed", f"slow{m:g}_auto"
        auto = stats[a].controller
        print(f"slow tier {m:g} MB/s: fixed 0.15 TTFT {t[f]:.3f} s KL {kl[f]:.4f}; auto r={auto.ratio:.3f} "
              f"(load/layer {auto.load_layer_s * 1e3:.1f} ms, recompute/layer at r_min "
              f"{auto.recompute_floor_s * 1e3:.1f} ms) TTFT {t[a]:.3f} s KL {kl[a]:.4f}")
        slow |= {f"slow{m:g}_fixed_s": round(t[f], 3), f"slow{m:g}_auto_s": round(t[a], 3),
                 f"slow{m:g}_fixed_kl": round(kl[f], 5), f"slow{m:g}_auto_kl": round(kl[a], 5),
                 f"slow{m:g}_auto_ratio": round(auto.ratio, 3)}
    first = f"slow{args.slow[0]:g}"
    slow[f"{first}_serial_s"] = round(t[f"{first}_serial"], 3)
    summary = {
        "rounds": args.rounds, "threads": args.threads,
        "disk_over_memory": round(t["blend_disk"] / t["blend_memory"], 3),
        "redis_over_memory": round(t["blend_redis"] / t["blend_memory"], 3),
        "disk_serial_over_memory": round(t["blend_disk_serial"] / t["blend_memory"], 3),
        "redis_serial_over_memory": round(t["blend_redis_serial"] / t["blend_memory"], 3),
        "reuse_pipelined_over_serial": round(t["reuse_disk"] / t["reuse_disk_serial"], 3),
        "reuse_redis_pipelined_over_serial": round(t["reuse_redis"] / t["reuse_redis_serial"], 3),
        "reuse_disk_over_memory": round(t["reuse_disk"] / t["reuse_memory"], 3),
        "load_wait_s": round(med([sum(w) for w in waits["blend_disk"]]), 4),
        "load_wait_redis_s": round(med([sum(w) for w in waits["blend_redis"]]), 4),
        "load_wait_reuse_s": round(med([sum(w) for w in waits["reuse_disk"]]), 4),
        "blend_memory_s": round(t["blend_memory"], 3), "blend_memory_kl": round(kl["blend_memory"], 5),
        **slow,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
