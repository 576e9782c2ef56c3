"""How much a shadow check in the model worker's low-priority lane stalls a running stream.

    .venv/bin/python benchmarks/shadow_lane.py [--model smollm2-135m] [--doc-tokens 1536]
        [--chunks 64,256,100000] [--repeats 3] [--threads 1]

A stream (short prompt, 48 tokens) decodes on the scheduler; right after its first token
the shadow check of an already served blended request over ``--doc-tokens`` tokens of
documents is queued in the lane. Per ``--chunks`` value (tokens per prefill step; a huge
value means the full prefill runs as one step) the stream's largest and median gap
between tokens is measured, beside a run with no shadow check, alternating the variants
per round so machine noise hits all alike. Ratios are of medians over rounds. Ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import Scheduler
from kvblend.generation import SamplingParams
from kvblend.guard.quality import GuardConfig, QualityGuard, ShadowRunner
from kvblend.models import DEFAULT_MODEL, load_model

STREAM = SamplingParams(max_tokens=48, ignore_eos=True)
WORDS = "the river runs north past the old mill where the doctor once lived and the company built a bridge . "


def documents(engine: Engine, tokens: int, n: int = 4) -> list[tuple[int, ...]]:
    ids = engine.tokenizer(WORDS * (tokens // 8), add_special_tokens=False)["input_ids"]
    per = tokens // n
    return [tuple(ids[i * per:(i + 1) * per]) for i in range(n)]


def gaps(sched: Scheduler, runner: ShadowRunner | None, served) -> list[float]:
    """The stream's gaps between tokens (s), with the shadow check queued after its first."""
    handle = sched.submit(Request(question="tell me a story .", method="full"), STREAM)
    times, job = [], None
    for item in handle.events():
        if hasattr(item, "token_id"):
            times.append(time.perf_counter())
            if runner is not None and job is None:
                job = runner.submit(served[0], served[1], None)
    if job is not None:
        job.result(600)
    return [b - a for a, b in zip(times, times[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--chunks", default="64,256,100000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model))
    request = Request(documents=documents(engine, args.doc_tokens), question="where does the river run ?",
                      method="blend")
    engine.generate(request, SamplingParams(max_tokens=4))  # store the chunks
    engine.flush()
    served = (request, engine.generate(request, SamplingParams(max_tokens=16, ignore_eos=True)))
    sched = Scheduler(engine)
    sched.start()
    guard = QualityGuard(GuardConfig())
    variants = {"none": None, **{f"chunk{c}": ShadowRunner(guard, sched, chunk_tokens=int(c))
                                 for c in args.chunks.split(",")}}
    gaps(sched, None, served)  # warm-up
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, runner in variants.items():
            g = gaps(sched, runner, served)
            rows[name].append((max(g), statistics.median(g)))
    sched.drain(5)
    out = {"prompt_tokens": len(engine.layout(request)), "threads": args.threads}
    base_max = statistics.median(r[0] for r in rows["none"])
    for name, r in rows.items():
        mx, med = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
        out[f"{name}_max_gap_s"], out[f"{name}_median_gap_s"] = round(mx, 4), round(med, 4)
        out[f"{name}_max_gap_over_none"] = round(mx / base_max, 2)
        print(f"{name:>12}: largest gap {mx * 1e3:8.1f} ms, median gap {med * 1e3:6.1f} ms, "
              f"largest / no-shadow {mx / base_max:5.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
