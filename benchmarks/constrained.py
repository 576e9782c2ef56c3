"""Decode speed with and without a JSON-schema constraint (issue 43), on one stream and on 8.

    .venv/bin/python benchmarks/constrained.py [--model smollm2-135m] [--tokens 48] [--rounds 3]

Each case submits ``streams`` requests (method ``full``, one prompt) to a ``Scheduler``
and times each answer's tokens after its first (decode only: the prefill and the first
draw are left out). The cases (``cases``): ``plain`` greedy answers (the baseline),
``json_schema`` greedy answers that follow ``SCHEMA`` (an object with a list of strings,
long enough to reach ``--tokens``), and ``sampled`` answers (temperature 1, top-p 0.95).
Each stream count runs the cases ``--rounds`` times in turn; ``overhead_per_token`` and
``sampled_overhead_per_token`` are the ratios of their medians to plain's. Also reported:
the grammar compile time of the schemas in tests/server/test_structured_outputs.py and
json_object on the model's tokenizer (cold: the tokenizer's info, then each schema;
cached: a second ask), and the mask's own cost per token (fill + unpack + accept, without
the model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

from kvblend.engine import Engine, Request
from kvblend.engine.scheduler import Scheduler
from kvblend.generation import SamplingParams
from kvblend.generation.grammar import Grammars, ResponseFormat
from kvblend.models.loader import load_model
from kvblend.models.registry import DEFAULT_MODEL

SCHEMA = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}, "minItems": 30}},
          "required": ["names"], "additionalProperties": False}
TEST_SCHEMAS = {  # as in tests/server/test_structured_outputs.py
    "answer (enum, boolean, integer range)": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "sure": {"type": "boolean"},
                                         "floor": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "sure", "floor"], "additionalProperties": False},
    "one boolean": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]},
}
PROMPT = [{"role": "user", "content": "List the names of thirty famous scientists as JSON."}]


def cases(tokens: int) -> dict[str, SamplingParams]:
    """Greedy (the baseline), greedy under ``SCHEMA``, and sampled as OpenAI's defaults
    sample (temperature 1) with a common nucleus."""
    return {"plain": SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            "json_schema": SamplingParams(max_tokens=tokens, temperature=0.0,
                                          response_format=ResponseFormat.json_schema(SCHEMA, True)),
            "sampled": SamplingParams(max_tokens=tokens, temperature=1.0, top_p=0.95, seed=0, ignore_eos=True)}


def decode_rate(scheduler: Scheduler, streams: int, params: SamplingParams) -> dict:
    """Tokens per second per stream (decode only) and in all, over ``streams`` requests."""
    handles = [scheduler.submit(Request(messages=PROMPT, method="full"), params) for _ in range(streams)]
    times: list[list[float]] = [[] for _ in handles]

    def read(i: int) -> None:
        for item in handles[i].events():
            if hasattr(item, "token_id"):
                times[i].append(time.perf_counter())

    threads = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    per_stream = [(len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1]
    first, last = max(t[0] for t in times), min(t[-1] for t in times)  # the span where every stream decoded
    counted = sum(sum(1 for x in t if first < x <= last) for t in times)
    return {"streams": streams, "tokens": [len(t) for t in times], "per_stream_tok_s": round(statistics.mean(per_stream), 2),
            "all_tok_s": round(counted / (last - first), 2) if last > first else None}


def compile_times(engine: Engine) -> dict:
    t = time.perf_counter()
    grammars = Grammars(engine.tokenizer, engine.loaded.config.vocab_size, engine.loaded.eos_token_ids)
    out = {"tokenizer_info_s": round(time.perf_counter() - t, 4)}
    formats = {"json_object": ResponseFormat("json_object"),
               **{name: ResponseFormat.json_schema(s, True) for name, s in TEST_SCHEMAS.items()},
               "benchmark (array of 30+ strings)": ResponseFormat.json_schema(SCHEMA, True)}
    for name, fmt in formats.items():
        t = time.perf_counter()
        grammars.compiled(fmt)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        grammars.compiled(fmt)
        out[name] = {"compile_s": round(cold, 4), "cached_s": round(time.perf_counter() - t, 6)}
    return out


def mask_cost(engine: Engine, steps: int = 200) -> float:
    """Seconds per token of the mask alone: fill + unpack + accept, along a greedy-free
    walk (the first allowed token each step), without the model."""
    grammars = Grammars(engine.tokenizer, engine.loaded.config.vocab_size, engine.loaded.eos_token_ids)
    c = grammars.constraint(ResponseFormat.json_schema(SCHEMA, True))
    t, done = time.perf_counter(), 0
    for _ in range(steps):
        allowed = c.allowed()
        c.accept(int(np.flatnonzero(allowed.numpy())[-1]))  # the last allowed id: a long token, not the stop
        done += 1
        if c.terminated:
            break
    return (time.perf_counter() - t) / done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every case taken in turn, per stream count")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 2:
        ap.error("need --rounds >= 1 and --tokens >= 2 (a rate needs two tokens after the first)")
    torch.set_num_threads(2)
    engine = Engine(load_model(args.model))
    report: dict = {"model": args.model, "threads": torch.get_num_threads(), "compile": compile_times(engine),
                    "mask_only_s_per_token": round(mask_cost(engine), 6), "decode": []}
    scheduler = Scheduler(engine, max_running=8, max_queued=16)
    scheduler.start()
    params = cases(args.tokens)
    try:
        decode_rate(scheduler, 1, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for streams in (1, 8):
            runs: dict[str, list[float]] = {name: [] for name in params}
            for _ in range(args.rounds):  # in turn, so that the host's drift falls on every case alike
                for name, p in params.items():
                    runs[name].append(decode_rate(scheduler, streams, p)["per_stream_tok_s"])
            rates = {name: statistics.median(r) for name, r in runs.items()}
            report["decode"].append({"streams": streams, "per_stream_tok_s": rates, "rounds": runs,
                                     "overhead_per_token": round(rates["plain"] / rates["json_schema"] - 1, 4),
                                     "sampled_overhead_per_token": round(rates["plain"] / rates["sampled"] - 1, 4)})
    finally:
        scheduler.drain(30)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
