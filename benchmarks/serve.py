"""Open-loop load test of `kvblend serve` on loopback: full vs prefix vs blend.

    .venv/bin/python benchmarks/serve.py [--quick] [--model smollm2-135m] [--docs-per-request 6]

Starts the real server (`python -m kvblend serve`, memory tier, max_running 8, a small
queue so that overload answers 429) and drives it with httpx over SSE:

* a pool of MuSiQue passages, stored once through `POST /v1/documents`; each request
  takes ``--docs-per-request`` distinct passages drawn by Zipf popularity (rank^-s, as
  in RAG traffic: a few documents are hot) and one of the questions; answers are 32
  tokens (`ignore_eos`), greedy;
* per method, the unloaded TTFT (median of sequential requests), then Poisson
  arrivals at a ladder of rates to the highest it sustains: p95 TTFT <= 2x the
  method's unloaded TTFT and no 429 / lost request. The rates are one grid for all
  methods (x sqrt 2 per step); each method starts at the grid rate just under half its
  own unloaded prefill rate (1 / (2 TTFT)) and climbs while sustained, or descends
  until sustained. TTFT is measured by the client: request
  sent -> first chunk carrying text;
* decode throughput: 8 concurrent streams vs 1 (64 tokens each, short cached prompt),
  output tokens/s after the first token, rounds interleaved;
* overload: a burst of 2 x (max_running + max_queued) short requests at once must end
  each as ok or 429, none lost.

Every request ends as ok, rejected (429) or lost (an error, a broken or unfinished
stream, or no end within ``--request-timeout`` s: hung). Timings on a shared host drift:
read the ratios, which are measured in one run. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, load_musique, musique_query
from kvblend.models.registry import DEFAULT_MODEL

METHODS = ("full", "prefix", "blend")
SHARED_DATA = Path("/work/shared/data/musique_dev.json")
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "src" / "kvblend" / "data" / "musique_sample.json"


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them)."""

    pool: int = 24
    docs_per_request: int = 4
    unloaded: int = 4
    window_s: float = 30.0  # arrivals per rate step span about this long ...
    min_requests: int = 8  # ... with at least this many requests
    max_requests: int = 40
    max_steps: int = 8  # rate steps per method
    decode_rounds: int = 3
    decode_tokens: int = 64

    @classmethod
    def quick(cls) -> Plan:
        return cls(pool=8, docs_per_request=2, unloaded=2, window_s=10.0, min_requests=5, max_requests=12,
                   max_steps=6, decode_rounds=1, decode_tokens=32)


@dataclass
class Sample:
    status: str  # "ok", "rejected" (429), "lost"
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    server_ttft_s: float = math.nan
    detail: str = ""


@dataclass
class Step:
    rate: float
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == "ok"]

    def count(self, status: str) -> int:
        return sum(s.status == status for s in self.samples)

    def summary(self) -> dict:
        ok = self.ok()
        ttft = [s.ttft_s for s in ok]
        e2e = [s.e2e_s for s in ok]
        return {"rate": round(self.rate, 4), "requests": len(self.samples), "ok": len(ok),
                "rejected": self.count("rejected"), "lost": self.count("lost"),
                "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
                "e2e_p50_s": pct(e2e, 50), "e2e_p95_s": pct(e2e, 95),
                "output_tok_s": round(sum(s.tokens for s in ok) / self.wall_s, 3) if self.wall_s else 0.0}


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no data)."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))], 4)


# ----- workload ----------------------------------------------------------------------------
def load_pool(size: int) -> tuple[list[str], list[str]]:
    """``size`` distinct passages (MuSiQue, 6 per example, in file order) and the questions."""
    path = SHARED_DATA if SHARED_DATA.exists() else SAMPLE_DATA
    examples = load_musique(path, n_docs=6)
    docs = list(dict.fromkeys(d for ex in examples for d in ex.documents))[:size]
    return docs, [ex.question for ex in examples]


class Workload:
    """Draws requests: Zipf-popular documents from the pool, a random question."""

    def __init__(self, docs: list[str], questions: list[str], per_request: int, zipf_s: float, seed: int) -> None:
        self.docs, self.questions, self.k = docs, questions, min(per_request, len(docs))
        self.weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(docs))]
        self.rng = random.Random(seed)

    def draw(self) -> tuple[list[str], str]:
        chosen: list[int] = []
        while len(chosen) < self.k:  # weighted sampling without replacement
            i = self.rng.choices(range(len(self.docs)), self.weights)[0]
            if i not in chosen:
                chosen.append(i)
        return [self.docs[i] for i in chosen], musique_query(self.rng.choice(self.questions))


# ----- the server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: str, max_running: int, max_queued: int, timeout_s: float, threads: int | None = None):
    """Start `kvblend serve` on a free loopback port; yield its base URL; stop it (SIGTERM).
    ``threads``: the server's torch threads (OMP_NUM_THREADS; default: torch's choice)."""
    with tempfile.TemporaryDirectory(prefix="kvblend-serve-bench-") as tmp:
        cfg = Path(tmp) / "serve.yaml"
        cfg.write_text(json.dumps({  # JSON is YAML
            "scheduler": {"max_running": max_running, "max_queued": max_queued, "request_deadline_s": 600},
            "store": {"tiers": ["memory"]}, "state_dir": str(Path(tmp) / "state"), "log_level": "warning",
            "drain_timeout_s": 5,
        }))
        port = free_port()
        cmd = [sys.executable, "-m", "kvblend", "serve", "--model", model, "--port", str(port), "--config", str(cfg)]
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "server.log", "w"), env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, timeout_s, Path(tmp) / "server.log")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {timeout_s} s")


# ----- one request -----------------------------------------------------------------------------
async def chat(client: httpx.AsyncClient, model: str, method: str, docs: list[str], question: str,
               max_tokens: int, timeout_s: float) -> Sample:
    """One streamed chat completion; never raises."""
    body = {"model": model, "messages": [{"role": "system", "content": MUSIQUE_INSTRUCTION},
                                         {"role": "user", "content": question}],
            "documents": docs, "kvblend": {"method": method}, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(_stream(client, body, t0), timeout_s)
    except TimeoutError:
        return Sample("lost", detail=f"hung: no end within {timeout_s} s")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        return Sample("lost", detail=f"{type(exc).__name__}: {exc}")


async def _stream(client: httpx.AsyncClient, body: dict, t0: float) -> Sample:
    first, done, usage, server_ttft = None, False, None, math.nan
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 429:
            await r.aread()
            return Sample("rejected", detail=r.headers.get("retry-after", ""))
        if r.status_code != 200:
            return Sample("lost", detail=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Sample("lost", detail=f"in-stream error: {chunk['error'].get('message')}")
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
                server_ttft = chunk.get("kvblend", {}).get("ttft_s", math.nan)
    end = time.perf_counter()
    if not done or usage is None or first is None:
        return Sample("lost", detail="the stream ended without a token, usage or [DONE]")
    return Sample("ok", first - t0, end - t0, usage["completion_tokens"], server_ttft)


# ----- phases ----------------------------------------------------------------------------------
class Bench:
    def __init__(self, url: str, model: str, args: argparse.Namespace, plan: Plan, workload: Workload) -> None:
        self.url, self.model, self.args, self.plan, self.workload = url, model, args, plan, workload
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout), limits=limits)

    async def request(self, method: str, max_tokens: int | None = None, docs: list[str] | None = None,
                      question: str | None = None) -> Sample:
        d, q = self.workload.draw()
        return await chat(self.client, self.model, method, docs if docs is not None else d, question or q,
                          max_tokens or self.args.max_tokens, self.args.request_timeout)

    async def store_pool(self) -> None:
        for doc in self.workload.docs:
            r = await self.client.post("/v1/documents", json={"text": doc}, timeout=300)
            r.raise_for_status()

    async def unloaded(self, method: str) -> list[Sample]:
        await self.request(method)  # warm-up (also fills the prefix cache with the system prompt)
        return [await self.request(method) for _ in range(self.plan.unloaded)]

    async def at_rate(self, method: str, rate: float, rng: random.Random) -> Step:
        n = int(min(self.plan.max_requests, max(self.plan.min_requests, round(rate * self.plan.window_s))))
        step, tasks, t0 = Step(rate), [], time.perf_counter()
        at = 0.0
        for _ in range(n):
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(self.request(method)))
        step.samples = list(await asyncio.gather(*tasks))
        step.wall_s = time.perf_counter() - t0
        return step

    async def overload_burst(self, n: int) -> list[Sample]:
        """``n`` short requests at once (no documents, 4 tokens)."""
        return list(await asyncio.gather(*(self.request("blend", max_tokens=4, docs=[], question="Question: ?")
                                           for _ in range(n))))

    async def decode_throughput(self, streams: int) -> float:
        """Output tokens/s after each stream's first token, ``streams`` at once (no documents:
        prefills are short, so the streams are admitted within a few steps of each other)."""

        async def one() -> tuple[Sample, float]:
            s = await self.request("blend", max_tokens=self.plan.decode_tokens, docs=[], question="Question: ?")
            return s, time.perf_counter()

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one() for _ in range(streams)))
        if any(s.status != "ok" for s, _ in out):
            raise SystemExit(f"decode phase: a stream failed: {[s.detail for s, _ in out]}")
        first = min(t0 + s.ttft_s for s, _ in out)
        last = max(end for _, end in out)
        return sum(s.tokens - 1 for s, _ in out) / (last - first)


def grid_index(rate: float) -> int:
    """Index of the largest rate of the grid sqrt(2)^i req/s that is <= ``rate``."""
    return math.floor(2 * math.log2(rate))


async def climb(bench: Bench, method: str, unloaded_ttft: float, rng: random.Random) -> list[Step]:
    """Rate steps from just under 1 / (2 x unloaded TTFT): up while sustained, or down
    until sustained when the first step is not; at most ``plan.max_steps``."""
    i, direction, steps = grid_index(0.5 / unloaded_ttft), 0, []
    while len(steps) < bench.plan.max_steps:
        step = await bench.at_rate(method, math.sqrt(2) ** i, rng)
        steps.append(step)
        _print_step(method, step)
        ok = sustained(step, unloaded_ttft)
        direction = direction or (1 if ok else -1)
        if ok != (direction == 1):  # the first failure going up, or the first success going down
            break
        i += direction
    return steps


def _print_step(method: str, step: Step) -> None:
    s = step.summary()
    print(f"  {method:6s} {step.rate:6.3f} req/s  n={s['requests']:3d} ok={s['ok']:3d} 429={s['rejected']:2d} "
          f"lost={s['lost']}  TTFT p50/p95/p99 {s['ttft_p50_s']:.3f}/{s['ttft_p95_s']:.3f}/{s['ttft_p99_s']:.3f} s  "
          f"e2e p50 {s['e2e_p50_s']:.3f} s  {s['output_tok_s']:.1f} tok/s", flush=True)
    for smp in step.samples:
        if smp.status == "lost":
            print(f"    lost: {smp.detail}", flush=True)


def sustained(step: Step, unloaded_ttft: float) -> bool:
    ok = step.ok()
    return bool(ok) and len(ok) == len(step.samples) and pct([s.ttft_s for s in ok], 95) <= 2 * unloaded_ttft


async def run(url: str, model: str, args: argparse.Namespace, plan: Plan, workload: Workload) -> dict:
    bench = Bench(url, model, args, plan, workload)
    t = time.perf_counter()
    await bench.store_pool()
    print(f"stored {len(workload.docs)} documents in {time.perf_counter() - t:.1f} s", flush=True)
    methods = args.methods
    base = {m: await bench.unloaded(m) for m in methods}
    unloaded = {m: statistics.median(s.ttft_s for s in v if s.status == "ok") for m, v in base.items()}
    lost = sum(s.status != "ok" for v in base.values() for s in v)
    print("unloaded TTFT (median): " + ", ".join(f"{m} {v:.3f} s" for m, v in unloaded.items()), flush=True)
    ladder = {m: await climb(bench, m, unloaded[m], random.Random(args.seed)) for m in methods}
    lost += sum(st.count("lost") for steps in ladder.values() for st in steps)
    rejected = sum(st.count("rejected") for steps in ladder.values() for st in steps)
    best = {m: max((st for st in steps if sustained(st, unloaded[m])), key=lambda st: st.rate, default=None)
            for m, steps in ladder.items()}
    rate = {m: (st.rate if st else 0.0) for m, st in best.items()}
    p95 = {m: (st.summary()["ttft_p95_s"] if st else ladder[m][0].summary()["ttft_p95_s"]) for m, st in best.items()}
    burst = await bench.overload_burst(2 * (args.max_running + args.max_queued))
    print(f"overload burst of {len(burst)}: ok {sum(s.status == 'ok' for s in burst)}, "
          f"429 {sum(s.status == 'rejected' for s in burst)}, lost {sum(s.status == 'lost' for s in burst)}", flush=True)
    lost += sum(s.status == "lost" for s in burst)
    one, eight = [], []
    for _ in range(plan.decode_rounds):
        one.append(await bench.decode_throughput(1))
        eight.append(await bench.decode_throughput(8))
    await bench.client.aclose()
    print(f"decode tokens/s: 1 stream {statistics.median(one):.1f}, 8 streams {statistics.median(eight):.1f}")
    return {
        "blend_over_full_rate": _ratio(rate.get("blend"), rate.get("full")),
        "prefix_over_full_rate": _ratio(rate.get("prefix"), rate.get("full")),
        "decode_batch8_over_1": round(statistics.median(eight) / statistics.median(one), 3),
        "lost_requests": lost, "rejected_requests": rejected,
        "overload_burst": {"requests": len(burst), "rejected": sum(s.status == "rejected" for s in burst)},
        "p95_ttft_s": p95, "unloaded_ttft_s": {m: round(v, 4) for m, v in unloaded.items()},
        "sustained_rate_req_s": {m: round(v, 4) for m, v in rate.items()},
        "decode_tok_s": {"1": round(statistics.median(one), 2), "8": round(statistics.median(eight), 2)},
        "ladder": {m: [st.summary() for st in steps] for m, steps in ladder.items()},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller pool, fewer and shorter steps")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--docs-per-request", type=int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds before a request counts as hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                   help="comma-separated subset of full,prefix,blend (ratios need full)")
    p.add_argument("--threads", type=int, default=None,
                   help="the server's torch threads (on an oversubscribed host 1 avoids stalls at every parallel op)")
    args = p.parse_args(argv)
    if not args.methods or set(args.methods) - set(METHODS):
        p.error(f"--methods takes a comma-separated subset of {','.join(METHODS)}")
    plan = Plan.quick() if args.quick else Plan()
    docs, questions = load_pool(plan.pool)
    workload = Workload(docs, questions, args.docs_per_request or plan.docs_per_request, args.zipf, args.seed)
    print(f"model {args.model}; pool {len(docs)} documents; {workload.k} per request (Zipf s={args.zipf}); "
          f"answers {args.max_tokens} tokens; {os.cpu_count()} CPUs", flush=True)
    t = time.perf_counter()
    with running_server(args.model, args.max_running, args.max_queued, timeout_s=600, threads=args.threads) as url:
        out = asyncio.run(run(url, args.model, args, plan, workload))
    out.update(model=args.model, quick=args.quick, server_threads=args.threads, wall_s=round(time.perf_counter() - t, 1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
