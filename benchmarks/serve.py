"""Open-loop load test of `kvblend serve` on loopback: full vs prefix vs blend.

    .venv/bin/python benchmarks/serve.py [--quick] [--model smollm2-135m] [--budget-min 20]

Starts the real server (`python -m kvblend serve`, memory tier, max_running 8, a small
queue so that overload answers 429) and drives it with httpx over SSE. Phases:

1. A pool of MuSiQue passages (~600 tokens each), stored once through
   `POST /v1/documents`; each request takes ``--docs-per-request`` distinct passages
   drawn by Zipf popularity (rank^-s: a few documents are hot, as in RAG traffic) and
   one of the questions; answers are 32 tokens (`ignore_eos`), greedy.
2. Per method, its unloaded service time S: the median TTFT of sequential requests
   (after a warm-up; the same requests for every method). TTFT is measured by the
   client: request sent -> first text chunk.
3. Overload: a burst of 2 x (max_running + max_queued) short requests at once; each must
   end as ok or 429, none lost. Decode throughput: 8 concurrent streams vs 1.
4. Per method, a ladder of load steps to the highest Poisson arrival rate it sustains:
   p95 TTFT <= 2 S over the step's measured arrivals, and no 429 or lost request.

How a step works. One arrival pattern is drawn once per run: the cumulative times
U_1 < U_2 < ... of a unit-rate Poisson process, and one sequence of requests (Zipf
documents and questions). A step of method m at load f sends request k at
``S_m * U_k / f``: the rate is f / S_m requests/s (f is the offered load in units of the
method's own service time). The first ``warmup`` arrivals fill the pipeline and are not
in the percentiles; the next ``arrivals`` (default 20, so that the nearest-rank p95 is
the 19th of 20, not the maximum) are measured; at high rates more arrivals are added so
that the step spans at least ``min_step_s``. Every request sent is waited for (the queue
drains before the next step), so the last arrivals' TTFTs carry the backlog the step
built: a rate the server cannot keep up with shows in p95. A step stops sending early
once it cannot pass any more (a 429 or lost request, or more late first tokens among the
measured arrivals than p95 allows, counting requests still waiting longer than 2 S);
what it already sent still drains and is accounted for. A step that stopped early fails.

How the ladder searches. Sustained-ness is (up to noise) a threshold in f (the same pattern,
compressed). The first method (the cheapest, by S) starts at ``f_start``; a passing
step is followed by one ``factor`` higher, a failing one by one ``factor`` lower, until
the outcome flips (or ``max_steps``, or f < ``f_min``). Later methods start one factor
above the load the previous method sustained (the knee of one pattern is close for all
methods), so that a search usually costs one cheap failing step (it stops early) and one
passing step. When every method is bracketed within one factor, each gets one bisection
step at the geometric mean of its highest pass and lowest fail above it (``refine``,
cheapest method first, while the budget lasts). A method's sustained rate is its
highest passing f / S_m in requests/s; ``bracket_rate_req_s`` gives it with the lowest
failing rate above it, so the resolution of every ratio is on record.

Why this measures capacity fairly: every method gets the same pool, the same request
sequence (same documents, questions and 32-token answers), the same arrival pattern
in units of its own service time, the same number of measured arrivals, the same
criterion (p95 TTFT <= 2 x its own unloaded TTFT, no 429, nothing lost) and the same
search grid (factor, then one bisection). Only the time unit differs, so a method's
sustained load f reflects how its serving overheads (decode steps interleaved with
prefills, HTTP, lookups) grow under load, and the ratios (blend_over_full_rate,
prefix_over_full_rate) compare absolute rates in requests/s.

Bounded duration. A step's length is planned before it starts (its last arrival at
``S U_n / f``, plus a drain of 2 S and one answer's decode). With ``--budget-min`` (20):
a search step runs only if it ends within the budget with one step's time kept for
each method still to search (else that search ends with ``search_end`` "budget"), and
a bisection step only if it ends within the budget. The cost of a step is ~(warmup +
arrivals) S / f: with 2 passages of ~600 tokens per request (full's TTFT ~4 s on a
quiet 2-core host) and the knee near f = 0.3-0.6, a passing step of full takes 2-5
minutes, of blend under one; ``--docs-per-request 4`` doubles full's cost.

Every request ends as ok, rejected (429) or lost (an error, a broken or unfinished
stream, or no end within ``--request-timeout`` s: hung). Timings on a shared host drift:
read the ratios, which are measured in one run. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
TTFT_LIMIT = 2.0  # a step passes with p95 TTFT <= TTFT_LIMIT x the method's unloaded TTFT
QUANTILE = 95.0


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them); see the module docstring."""

    pool: int = 24
    docs_per_request: int = 2
    unloaded: int = 5  # sequential requests per method for S (after one warm-up)
    warmup: int = 2  # arrivals per step before the measured ones
    arrivals: int = 20  # measured arrivals per step
    min_step_s: float = 30.0  # the arrivals span at least this long ...
    max_arrivals: int = 80  # ... up to this many in all
    f_start: float = 0.6  # the first method's first load (rate x S)
    factor: float = math.sqrt(2)
    f_min: float = 0.1
    max_steps: int = 5  # search steps per method, the bisection step not counted
    refine: bool = True
    budget_s: float = 1200.0
    decode_rounds: int = 3
    decode_tokens: int = 64

    def __post_init__(self) -> None:
        if min(self.pool, self.docs_per_request, self.unloaded, self.arrivals, self.max_steps, self.decode_rounds,
               self.decode_tokens) < 1 or self.warmup < 0:
            raise ValueError(f"plan sizes must be >= 1 (warmup >= 0): {self}")
        if self.max_arrivals < self.warmup + self.arrivals:
            raise ValueError(f"max_arrivals {self.max_arrivals} < warmup + arrivals {self.warmup + self.arrivals}")
        if self.factor <= 1 or not 0 < self.f_min <= self.f_start or self.min_step_s < 0 or self.budget_s <= 0:
            raise ValueError(f"need factor > 1, 0 < f_min <= f_start, min_step_s >= 0, budget_s > 0: {self}")

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: 4 passages, 1 per request, 6 measured arrivals, factor 2, no bisection."""
        return cls(pool=4, docs_per_request=1, unloaded=2, warmup=1, arrivals=6, min_step_s=5.0, max_arrivals=20,
                   f_start=0.5, factor=2.0, f_min=0.1, max_steps=3, refine=False, budget_s=600.0, decode_rounds=1,
                   decode_tokens=32)


@dataclass
class Sample:
    status: str  # "ok", "rejected" (429), "lost"
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    server_ttft_s: float = math.nan
    detail: str = ""


@dataclass
class Flight:
    """One request of a step as it goes: sent at ``sent`` (perf_counter), first text
    chunk at ``first``, its ``sample`` once it ended."""

    sent: float
    first: float | None = None
    sample: Sample | None = None

    def late(self, now: float, limit_s: float) -> bool:
        """Its TTFT is (or will certainly be) over ``limit_s``."""
        if self.sample is not None and self.sample.status != "ok":
            return True
        end = self.first if self.first is not None else now
        return end - self.sent > limit_s


@dataclass
class Step:
    """One load step of one method: ``planned`` arrivals at load ``load`` (rate = load / S)."""

    load: float
    rate: float
    warmup: int
    planned: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    backlog: int = 0  # requests still without an end when the last one was sent
    stopped_early: bool = False

    def measured(self) -> list[Sample]:
        return self.samples[self.warmup:]

    def count(self, status: str) -> int:
        return sum(s.status == status for s in self.samples)

    def p95(self) -> float:
        return pct([s.ttft_s for s in self.measured() if s.status == "ok"], QUANTILE)

    def summary(self) -> dict:
        ok = [s for s in self.measured() if s.status == "ok"]
        ttft, e2e = [s.ttft_s for s in ok], [s.e2e_s for s in ok]
        return {"load": round(self.load, 4), "rate": round(self.rate, 6), "planned": self.planned,
                "sent": len(self.samples), "measured_ok": len(ok), "rejected": self.count("rejected"),
                "lost": self.count("lost"), "stopped_early": self.stopped_early, "backlog_at_last_arrival": self.backlog,
                "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
                "e2e_p50_s": pct(e2e, 50), "e2e_p95_s": pct(e2e, 95), "wall_s": round(self.wall_s, 2),
                "output_tok_s": round(sum(s.tokens for s in self.samples if s.status == "ok") / self.wall_s, 3)
                if self.wall_s else 0.0}


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no data)."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))], 4)


def allowed_late(n: int) -> int:
    """How many of ``n`` measured TTFTs may exceed the limit with the nearest-rank p95 still within it."""
    return n - max(1, math.ceil(QUANTILE / 100 * n))


def passes(step: Step, service_s: float) -> bool:
    """Sustained: every arrival sent and ended ok (none rejected or lost), p95 TTFT <= 2 S."""
    return (not step.stopped_early and len(step.samples) == step.planned
            and all(s.status == "ok" for s in step.samples) and step.p95() <= TTFT_LIMIT * service_s)


# ----- the arrival pattern and the search (pure) -----------------------------------------------
def unit_arrivals(n: int, seed: int) -> list[float]:
    """Cumulative arrival times of a unit-rate Poisson process (n of them)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(t)
    return out


def step_times(pattern: list[float], load: float, service_s: float, plan: Plan) -> list[float]:
    """Send times (s from the step's start) at rate load / service_s: ``warmup + arrivals``
    of the pattern, more while they span under ``min_step_s``, at most ``max_arrivals``."""
    scale = service_s / load
    n = plan.warmup + plan.arrivals
    while n < min(plan.max_arrivals, len(pattern)) and pattern[n - 1] * scale < plan.min_step_s:
        n += 1
    return [u * scale for u in pattern[:n]]


def bracket(history: list[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """The highest passing load and the lowest failing load above it (None where there is none)."""
    lo = max((f for f, ok in history if ok), default=None)
    hi = min((f for f, ok in history if not ok and (lo is None or f > lo)), default=None)
    return lo, hi


def next_load(history: list[tuple[float, bool]], plan: Plan, start: float) -> tuple[float | None, str]:
    """The next search load after ``history`` ((load, passed) in the order run), or None
    and why the search ended: "bracketed" (a pass and a fail above it), "max_steps", or
    "floor" (every load down to ``f_min`` failed). Up by ``factor`` while every step
    passed, down while every step failed."""
    if not history:
        return start, ""
    lo, hi = bracket(history)
    if lo is not None and hi is not None:
        return None, "bracketed"
    if len(history) >= plan.max_steps:
        return None, "max_steps"
    if lo is not None:
        return lo * plan.factor, ""
    down = history[-1][0] / plan.factor
    return (down, "") if down >= plan.f_min * 0.999 else (None, "floor")


def refine_load(history: list[tuple[float, bool]], plan: Plan) -> float | None:
    """The bisection load (geometric mean of the bracket), once per bracket of one
    ``factor`` (None without ``plan.refine``, a bracket, or once refined)."""
    lo, hi = bracket(history)
    if not plan.refine or lo is None or hi is None or hi / lo <= math.sqrt(plan.factor) * 1.001:
        return None
    return math.sqrt(lo * hi)


def sustained_load(history: list[tuple[float, bool]]) -> float:
    """The highest load that passed (0 if none)."""
    return max((f for f, ok in history if ok), default=0.0)


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
               max_tokens: int, timeout_s: float, flight: Flight | None = None) -> Sample:
    """One streamed chat completion; never raises. TTFT and e2e count from ``flight.sent``
    (a step's arrival instant; now if no flight is given); ``flight`` gets the first
    chunk's time as it comes and the sample at the end."""
    body = {"model": model, "messages": [{"role": "system", "content": MUSIQUE_INSTRUCTION},
                                         {"role": "user", "content": question}],
            "documents": docs, "kvblend": {"method": method}, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    flight = flight or Flight(time.perf_counter())
    try:
        sample = await asyncio.wait_for(_stream(client, body, flight), timeout_s)
    except TimeoutError:
        sample = Sample("lost", detail=f"hung: no end within {timeout_s} s")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        sample = Sample("lost", detail=f"{type(exc).__name__}: {exc}")
    flight.sample = sample
    return sample


async def _stream(client: httpx.AsyncClient, body: dict, flight: Flight) -> Sample:
    done, usage, server_ttft = False, None, math.nan
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
            if flight.first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                flight.first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
                server_ttft = chunk.get("kvblend", {}).get("ttft_s", math.nan)
    end = time.perf_counter()
    if not done or usage is None or flight.first is None:
        return Sample("lost", detail="the stream ended without a token, usage or [DONE]")
    return Sample("ok", flight.first - flight.sent, end - flight.sent, usage["completion_tokens"], server_ttft)


# ----- phases ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unloaded:
    """A method's unloaded figures: S (median TTFT) and the median decode time after it."""

    ttft_s: float
    decode_s: float
    failed: int


class Bench:
    def __init__(self, url: str, model: str, args: argparse.Namespace, plan: Plan, workload: Workload) -> None:
        self.url, self.model, self.args, self.plan, self.workload = url, model, args, plan, workload
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout), limits=limits)
        self.requests = [workload.draw() for _ in range(plan.max_arrivals)]  # every step sends these, in order
        self.unloaded_requests = [workload.draw() for _ in range(plan.unloaded + 1)]  # every method's S from these
        self.pattern = unit_arrivals(plan.max_arrivals, args.seed)

    async def request(self, method: str, max_tokens: int | None = None, docs: list[str] | None = None,
                      question: str | None = None, flight: Flight | None = None) -> Sample:
        d, q = self.workload.draw() if docs is None else (docs, question or "Question: ?")
        return await chat(self.client, self.model, method, d, q, max_tokens or self.args.max_tokens,
                          self.args.request_timeout, flight)

    async def store_pool(self) -> None:
        for doc in self.workload.docs:
            r = await self.client.post("/v1/documents", json={"text": doc}, timeout=300)
            r.raise_for_status()

    async def unloaded(self, method: str) -> Unloaded:
        """The first request warms up (and fills the prefix cache with the system prompt)."""
        samples = [await self.request(method, docs=d, question=q) for d, q in self.unloaded_requests][1:]
        ok = [s for s in samples if s.status == "ok"]
        if not ok:
            raise SystemExit(f"{method}: no unloaded request succeeded: {[s.detail for s in samples]}")
        return Unloaded(statistics.median(s.ttft_s for s in ok), statistics.median(s.e2e_s - s.ttft_s for s in ok),
                        len(samples) - len(ok))

    async def at_load(self, method: str, load: float, base: Unloaded) -> Step:
        """One step: the shared requests at the shared pattern's times for ``load``; stops
        sending once the step cannot pass; waits for every request sent."""
        times = step_times(self.pattern, load, base.ttft_s, self.plan)
        step = Step(load, load / base.ttft_s, self.plan.warmup, len(times))
        limit, flights, tasks = TTFT_LIMIT * base.ttft_s, [], []
        t0 = time.perf_counter()
        for k, at in enumerate(times):
            if not await self._wait_until(t0 + at, flights, limit, len(times) - self.plan.warmup):
                step.stopped_early = True
                break
            flights.append(Flight(time.perf_counter()))
            docs, question = self.requests[k]
            tasks.append(asyncio.create_task(self.request(method, docs=docs, question=question, flight=flights[-1])))
        step.backlog = sum(not t.done() for t in tasks)
        step.samples = list(await asyncio.gather(*tasks))
        step.wall_s = time.perf_counter() - t0
        return step

    async def _wait_until(self, when: float, flights: list[Flight], limit_s: float, measured_n: int) -> bool:
        """Sleep until ``when``; False as soon as the step (``measured_n`` measured
        arrivals) cannot pass any more."""
        while True:
            now = time.perf_counter()
            measured = flights[self.plan.warmup:]
            if any(f.sample is not None and f.sample.status != "ok" for f in flights) or \
                    sum(f.late(now, limit_s) for f in measured) > allowed_late(measured_n):
                return False
            if now >= when:
                return True
            await asyncio.sleep(min(0.1, when - now))

    def step_cost(self, load: float, base: Unloaded) -> float:
        """The planned length of a step: its last arrival, a drain of 2 S and one answer's decode."""
        times = step_times(self.pattern, load, base.ttft_s, self.plan)
        return times[-1] + TTFT_LIMIT * base.ttft_s + base.decode_s

    async def overload_burst(self, n: int) -> list[Sample]:
        """``n`` short requests at once (no documents, 4 tokens)."""
        return list(await asyncio.gather(*(self.request("blend", max_tokens=4, docs=[]) for _ in range(n))))

    async def decode_throughput(self, streams: int) -> float:
        """Output tokens/s after each stream's first token, ``streams`` at once (no documents:
        prefills are short, so the streams are admitted within a few steps of each other)."""

        async def one() -> tuple[Sample, float]:
            s = await self.request("blend", max_tokens=self.plan.decode_tokens, docs=[])
            return s, time.perf_counter()

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one() for _ in range(streams)))
        if any(s.status != "ok" for s, _ in out):
            raise SystemExit(f"decode phase: a stream failed: {[s.detail for s, _ in out]}")
        first = min(t0 + s.ttft_s for s, _ in out)
        last = max(end for _, end in out)
        return sum(s.tokens - 1 for s, _ in out) / (last - first)


@dataclass
class Ladder:
    """One method's search: its steps and (load, passed) history, and why it ended."""

    steps: list[Step] = field(default_factory=list)
    history: list[tuple[float, bool]] = field(default_factory=list)
    end: str = ""
    refined: bool = False  # the bisection step ran


async def climb(bench: Bench, method: str, base: Unloaded, start: float, deadline: float,
                reserve_s: float) -> Ladder:
    """Search ``method``'s sustained load from ``start``; a step runs only if it ends
    ``reserve_s`` before ``deadline`` (perf_counter)."""
    ladder = Ladder()
    while True:
        load, ladder.end = next_load(ladder.history, bench.plan, start)
        if load is None or not await _maybe_step(bench, method, base, load, deadline - reserve_s, ladder):
            ladder.end = ladder.end or "budget"
            return ladder


async def _maybe_step(bench: Bench, method: str, base: Unloaded, load: float, until: float, ladder: Ladder) -> bool:
    """Run one step at ``load`` if its planned length ends by ``until``; False if not."""
    cost = bench.step_cost(load, base)
    if time.perf_counter() + cost > until:
        print(f"  {method:6s} load {load:.3f}: a step of ~{cost:.0f} s does not fit the budget", flush=True)
        return False
    step = await bench.at_load(method, load, base)
    ladder.steps.append(step)
    ladder.history.append((load, passes(step, base.ttft_s)))
    _print_step(method, step, ladder.history[-1][1])
    return True


def _print_step(method: str, step: Step, ok: bool) -> None:
    s = step.summary()
    print(f"  {method:6s} load {step.load:.3f} = {step.rate:6.3f} req/s  sent {s['sent']:2d}/{s['planned']:2d} "
          f"429={s['rejected']} lost={s['lost']} backlog={s['backlog_at_last_arrival']}  TTFT p50/p95/p99 "
          f"{s['ttft_p50_s']:.3f}/{s['ttft_p95_s']:.3f}/{s['ttft_p99_s']:.3f} s  e2e p50 {s['e2e_p50_s']:.3f} s  "
          f"{s['output_tok_s']:.1f} tok/s  {step.wall_s:.0f} s  {'PASS' if ok else 'fail'}", flush=True)
    for smp in step.samples:
        if smp.status == "lost":
            print(f"    lost: {smp.detail}", flush=True)


async def run(url: str, model: str, args: argparse.Namespace, plan: Plan, workload: Workload,
              t_start: float) -> dict:
    """Every phase; ``t_start``: when the run began (perf_counter), for the budget."""
    bench, t = Bench(url, model, args, plan, workload), time.perf_counter()
    await bench.store_pool()
    print(f"stored {len(workload.docs)} documents in {time.perf_counter() - t:.1f} s", flush=True)
    base = {m: await bench.unloaded(m) for m in args.methods}
    lost = sum(b.failed for b in base.values())
    print("unloaded TTFT S (median): " + ", ".join(f"{m} {b.ttft_s:.3f} s" for m, b in base.items()), flush=True)
    burst = await bench.overload_burst(2 * (args.max_running + args.max_queued))
    lost += sum(s.status == "lost" for s in burst)
    print(f"overload burst of {len(burst)}: ok {sum(s.status == 'ok' for s in burst)}, "
          f"429 {sum(s.status == 'rejected' for s in burst)}, lost {sum(s.status == 'lost' for s in burst)}", flush=True)
    one, eight = [], []
    for _ in range(plan.decode_rounds):
        one.append(await bench.decode_throughput(1))
        eight.append(await bench.decode_throughput(8))
    print(f"decode tokens/s: 1 stream {statistics.median(one):.1f}, 8 streams {statistics.median(eight):.1f}",
          flush=True)
    ladders = await _ladders(bench, base, plan.budget_s - (time.perf_counter() - t_start))
    await bench.client.aclose()
    lost += sum(st.count("lost") for lad in ladders.values() for st in lad.steps)
    return _result(base, ladders, burst, one, eight, lost)


async def _ladders(bench: Bench, base: dict[str, Unloaded], left_s: float) -> dict[str, Ladder]:
    """Every method's search, cheapest S first, each starting one factor above the load
    the previous one sustained; a search step keeps one step's time (at that start) for
    each method still to come. Then the bisection steps, cheapest first, while the budget lasts."""
    order = sorted(base, key=lambda m: base[m].ttft_s)
    ladders, start, deadline = {}, bench.plan.f_start, time.perf_counter() + left_s
    print(f"ladders: {left_s:.0f} s of the budget left", flush=True)
    for i, m in enumerate(order):
        reserve = sum(bench.step_cost(start, base[k]) for k in order[i + 1:])
        ladders[m] = await climb(bench, m, base[m], start, deadline, reserve)
        found = sustained_load(ladders[m].history)
        print(f"  {m}: sustained load {found:.3f} = {found / base[m].ttft_s:.3f} req/s ({ladders[m].end})", flush=True)
        start = found * bench.plan.factor if found else bench.plan.f_start
    for m in order:
        load = refine_load(ladders[m].history, bench.plan)
        if load is not None:
            ladders[m].refined = await _maybe_step(bench, m, base[m], load, deadline, ladders[m])
    return {m: ladders[m] for m in base}


def _result(base: dict[str, Unloaded], ladders: dict[str, Ladder], burst: list[Sample], one: list[float],
            eight: list[float], lost: int) -> dict:
    rate = {m: sustained_load(lad.history) / base[m].ttft_s for m, lad in ladders.items()}
    p95 = {m: _sustained_p95(lad) for m, lad in ladders.items()}
    return {
        "blend_over_full_rate": _ratio(rate.get("blend"), rate.get("full")),
        "prefix_over_full_rate": _ratio(rate.get("prefix"), rate.get("full")),
        "ratio_bounds": {f"{m}_over_full": _ratio_bounds(ladders[m], ladders["full"], base[m].ttft_s, base["full"].ttft_s)
                         for m in ("blend", "prefix") if m in ladders and "full" in ladders},
        "decode_batch8_over_1": round(statistics.median(eight) / statistics.median(one), 3),
        "lost_requests": lost,
        "rejected_requests": sum(st.count("rejected") for lad in ladders.values() for st in lad.steps),
        "overload_burst": {"requests": len(burst), "rejected": sum(s.status == "rejected" for s in burst)},
        "p95_ttft_s": p95, "unloaded_ttft_s": {m: round(b.ttft_s, 6) for m, b in base.items()},
        "sustained_rate_req_s": {m: round(v, 6) for m, v in rate.items()},
        "sustained_load": {m: round(sustained_load(lad.history), 4) for m, lad in ladders.items()},
        "search_end": {m: lad.end for m, lad in ladders.items()},
        "refined": {m: lad.refined for m, lad in ladders.items()},
        "bracket_rate_req_s": {m: [None if f is None else round(f / base[m].ttft_s, 6) for f in bracket(lad.history)]
                               for m, lad in ladders.items()},
        "decode_tok_s": {"1": round(statistics.median(one), 2), "8": round(statistics.median(eight), 2)},
        "ladder": {m: [st.summary() for st in lad.steps] for m, lad in ladders.items()},
    }


def _sustained_p95(ladder: Ladder) -> float | None:
    """p95 TTFT at the highest passing step, else at the lowest load tried (None: no step ran)."""
    passing = [st for st, (_, ok) in zip(ladder.steps, ladder.history) if ok]
    if passing:
        return max(passing, key=lambda st: st.load).p95()
    return min(ladder.steps, key=lambda st: st.load).p95() if ladder.steps else None


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None unless both methods sustained some rate (see ``search_end`` for why not)."""
    return round(a / b, 3) if a and b else None


def _ratio_bounds(num: Ladder, den: Ladder, num_s: float, den_s: float) -> list[float | None]:
    """The range the two brackets allow for num's rate over den's: [lo/hi, hi/lo]
    (None where a bracket has no pass or no fail above it)."""
    (a_lo, a_hi), (b_lo, b_hi) = bracket(num.history), bracket(den.history)
    low = round((a_lo / num_s) / (b_hi / den_s), 3) if a_lo and b_hi else None
    high = round((a_hi / num_s) / (b_lo / den_s), 3) if a_hi and b_lo else None
    return [low, high]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny pool, short steps, coarse ladder")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--docs-per-request", type=int, default=None, help="default 2 (--quick: 1)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival pattern and the request sequence")
    p.add_argument("--budget-min", type=float, default=None, help="whole-run budget (default 20; --quick: 10)")
    p.add_argument("--arrivals", type=int, default=None, help="measured arrivals per step (default 20; --quick: 6)")
    p.add_argument("--min-step-s", type=float, default=None, help="shortest span of a step's arrivals")
    p.add_argument("--max-steps", type=int, default=None, help="search steps per method (bisection not counted)")
    p.add_argument("--decode-rounds", type=int, default=None)
    p.add_argument("--no-refine", action="store_true", help="skip the bisection step")
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                   help="comma-separated subset of full,prefix,blend (ratios need full)")
    p.add_argument("--threads", type=int, default=None,
                   help="the server's torch threads (on an oversubscribed host 1 avoids stalls at every parallel op)")
    args = p.parse_args(argv)
    if not args.methods or set(args.methods) - set(METHODS):
        p.error(f"--methods takes a comma-separated subset of {','.join(METHODS)}")
    plan = Plan.quick() if args.quick else Plan()
    overrides = {"docs_per_request": args.docs_per_request, "arrivals": args.arrivals, "min_step_s": args.min_step_s,
                 "max_steps": args.max_steps, "decode_rounds": args.decode_rounds,
                 "budget_s": args.budget_min * 60 if args.budget_min is not None else None,
                 "refine": False if args.no_refine else None}
    try:
        plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        p.error(str(exc))
    return args, plan


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    docs, questions = load_pool(plan.pool)
    workload = Workload(docs, questions, plan.docs_per_request, args.zipf, args.seed)
    print(f"model {args.model}; pool {len(docs)} documents; {workload.k} per request (Zipf s={args.zipf}); "
          f"answers {args.max_tokens} tokens; {os.cpu_count()} CPUs; budget {plan.budget_s / 60:.0f} min", flush=True)
    t = time.perf_counter()
    with running_server(args.model, args.max_running, args.max_queued, timeout_s=600, threads=args.threads) as url:
        out = asyncio.run(run(url, args.model, args, plan, workload, t))
    out.update(model=args.model, quick=args.quick, server_threads=args.threads, plan=dataclasses.asdict(plan),
               wall_s=round(time.perf_counter() - t, 1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
