"""Open-loop load test of `kvblend serve` on loopback: each method's goodput at one shared SLO.

    .venv/bin/python benchmarks/serve.py [--quick] [--model smollm2-135m] [--budget-min 10]
        [--slo-ttft-s S] [--slo-itl-s 1.0] [--methods full,blend]

Starts the real server (`python -m kvblend serve`, memory tier, max_running 8, a small
queue so that overload answers 429) and drives it with httpx over SSE. Phases:

1. A pool of MuSiQue passages (~600 tokens each), stored once through
   `POST /v1/documents`; each request takes ``--docs-per-request`` distinct passages
   drawn by Zipf popularity (rank^-s: a few documents are hot, as in RAG traffic) and
   one of the questions; answers are 32 tokens (`ignore_eos`), greedy.
2. Per method, its unloaded figures: the median TTFT and the median inter-token latency
   (ITL) of sequential requests (after a warm-up; the same requests for every method).
   TTFT and ITL are measured by the client: request sent -> first token, and the gaps
   between consecutive tokens of one stream (``continuous_usage_stats``: each token is a
   chunk with the running usage, so a token without text is timed too).
3. Overload: a burst of 2 x (max_running + max_queued) short requests at once; each must
   end as ok or 429, none lost. Decode throughput: 8 concurrent streams vs 1.
4. Per method, its goodput: the highest Poisson arrival rate (requests/s) at which the
   step's p95 TTFT <= ``--slo-ttft-s`` and p95 ITL <= ``--slo-itl-s``, with no 429,
   error or lost request. Goodput here is that highest offered rate meeting the SLO (as
   DistServe's and vLLM's goodput comparisons read it), not a count of good requests.

One SLO for every method. The SLO is absolute (seconds), the same for every method, so
a method that answers faster may load the server more before its p95 leaves it; the old
criterion (p95 <= 2x the method's *own* unloaded TTFT) punished the faster method. The
TTFT SLO is by default 2x the slowest method's (full prefill's) unloaded TTFT in this run
(as the session-6 default of 4 s was 2x full's 1.99 s then; a fixed 4 s left full no goodput
once its TTFT was 3 s); ITL 1 s = 10x the decode step of 8 concurrent streams (8 / 81
tok/s, session 6). Pass ``--slo-ttft-s`` to compare two server versions at one fixed SLO;
the JSON line records the SLO beside each method's unloaded TTFT and ITL.

How a step works. One arrival pattern is drawn once per run: the cumulative times
U_1 < U_2 < ... of a unit-rate Poisson process, and one sequence of requests (Zipf
documents and questions). A step at rate r sends request k at ``U_k / r``, whatever the
method. The first ``warmup`` arrivals fill the pipeline and are not in the percentiles;
the next ``arrivals`` (default 20, so that the nearest-rank p95 is the 19th of 20, not
the maximum) are measured; at high rates more arrivals are added so that the step spans
at least ``min_step_s``. p95 ITL pools the gaps of every measured request. Every request
sent is waited for, so the last arrivals' TTFTs carry the backlog the step built. A step
stops sending early once it cannot pass any more (a 429, error or lost request; more late
first tokens among the measured arrivals than p95 allows, counting requests still waiting
longer than the SLO; or more gaps over the ITL SLO than p95 allows of every gap the
measured requests will have); the requests it sent that have no token yet are then
abandoned (the client closes them, the server drops them), the others drain. A step that
stopped early fails.

How the search goes. Each method starts at ``f_start`` / its unloaded TTFT (req/s); up by
``factor`` while steps pass, down while they fail, until a pass and a fail above it
bracket the goodput; then bisection (geometric mean) until the bracket is within
``resolution`` (or ``max_steps``, or the method's share of the budget). Methods run
cheapest first; each gets a share of the time left in proportion to its unloaded TTFT (its
steps are that much longer), and what one leaves passes on.
``bracket_rate_req_s`` gives each method's highest pass and lowest fail above it, and
``ratio_bounds`` what the brackets allow for each ratio.

Bounded duration. A step's length is planned before it starts (its last arrival, plus a
drain of the TTFT SLO and one answer's decode); a step runs only if it ends within its
method's share of ``--budget-min`` (default 10 minutes in all, setup included). A passing
step lasts ~(warmup + arrivals) / rate: with 2 passages per request (full's unloaded TTFT
~3 s on a quiet 2-core host), full's first step at 0.35 / 3 = 0.12 req/s takes ~190 s,
blend's a fraction of that; failing steps stop early. The first rate is below half the
method's unloaded capacity because a step that fails costs a slower step below it, which a
10-minute budget has little room for (at 0.5 x, full's first step failed and the next did
not fit: no goodput at all).

Every request ends as ok, rejected (429), error (a clean error: an OpenAI-shaped error
body, or an in-stream error then [DONE]), abandoned (closed by the client after its step
stopped early) or lost (a broken or unfinished stream, a non-JSON error, or no end within
``--request-timeout`` s: hung). Timings on a shared host drift: read the ratios, which are
measured in one run (``host_steal_share``: the hypervisor's share of the CPU meanwhile).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, load_musique, musique_query
from kvblend.models.registry import DEFAULT_MODEL

METHODS = ("full", "prefix", "blend")
DEFAULT_METHODS = ("full", "blend")
SHARED_DATA = Path("/work/shared/data/musique_dev.json")
SAMPLE_DATA = Path(__file__).resolve().parents[1] / "src" / "kvblend" / "data" / "musique_sample.json"
QUANTILE = 95.0
# every token its own chunk with the running usage (vLLM's continuous_usage_stats): gaps
# and TTFT are per token, whether or not the token has text
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True)
class Slo:
    """The service level every method is held to: p95 TTFT and p95 inter-token latency (s).
    ``ttft_s`` None: set per run to SLO_TTFT_OVER_SLOWEST x the slowest method's unloaded
    TTFT (``for_run``)."""

    ttft_s: float | None = None
    itl_s: float = 1.0

    def __post_init__(self) -> None:
        if (self.ttft_s is not None and not self.ttft_s > 0) or not self.itl_s > 0:
            raise ValueError(f"SLO seconds must be > 0: {self}")

    def for_run(self, unloaded_ttft_s: list[float]) -> Slo:
        """This SLO with its TTFT fixed: as given, or from this run's unloaded TTFTs."""
        if self.ttft_s is not None:
            return self
        return Slo(round(SLO_TTFT_OVER_SLOWEST * max(unloaded_ttft_s), 3), self.itl_s)


# The default TTFT SLO: twice the slowest method's unloaded TTFT (full prefill's), measured in
# the same run. One SLO for every method still; derived per run so that full prefill has a
# goodput to divide by on whatever host (a fixed 4 s, twice its TTFT in session 6, left it
# none once its TTFT was 3 s: every step failed at any rate the budget could try).
SLO_TTFT_OVER_SLOWEST = 2.0


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them); see the module docstring."""

    pool: int = 24
    docs_per_request: int = 2
    unloaded: int = 5  # sequential requests per method (after one warm-up)
    warmup: int = 2  # arrivals per step before the measured ones
    arrivals: int = 20  # measured arrivals per step
    min_step_s: float = 15.0  # the arrivals span at least this long ...
    max_arrivals: int = 60  # ... up to this many in all
    f_start: float = 0.35  # each method's first rate, in units of 1 / its unloaded TTFT
    factor: float = 2.0
    resolution: float = 1.2  # bisect until the bracket's hi / lo is at most this
    f_min: float = 0.05  # the search's floor, in the same units as f_start
    max_steps: int = 6  # steps per method
    budget_s: float = 600.0
    decode_rounds: int = 3
    decode_tokens: int = 64

    def __post_init__(self) -> None:
        if min(self.pool, self.docs_per_request, self.unloaded, self.arrivals, self.max_steps, self.decode_rounds,
               self.decode_tokens) < 1 or self.warmup < 0:
            raise ValueError(f"plan sizes must be >= 1 (warmup >= 0): {self}")
        if self.max_arrivals < self.warmup + self.arrivals:
            raise ValueError(f"max_arrivals {self.max_arrivals} < warmup + arrivals {self.warmup + self.arrivals}")
        if self.factor <= 1 or self.resolution <= 1 or not 0 < self.f_min <= self.f_start or self.min_step_s < 0 \
                or self.budget_s <= 0:
            raise ValueError(f"need factor > 1, resolution > 1, 0 < f_min <= f_start, min_step_s >= 0, "
                             f"budget_s > 0: {self}")

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: 4 passages, 1 per request, 6 measured arrivals, no bisection, 5 minutes."""
        return cls(pool=4, docs_per_request=1, unloaded=2, warmup=1, arrivals=6, min_step_s=5.0, max_arrivals=20,
                   f_start=0.5, factor=2.0, resolution=2.0, f_min=0.1, max_steps=3, budget_s=300.0,
                   decode_rounds=1, decode_tokens=32)


@dataclass
class Sample:
    """How one request ended. ``status``: "ok", "rejected" (429), "error" (a clean error),
    "abandoned" (closed by the client), "closed" (an ok stream the client ended early), "lost"."""

    status: str
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    server_ttft_s: float = math.nan
    detail: str = ""
    gaps: list[float] = field(default_factory=list)  # s between consecutive token chunks (client side)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    kvblend: dict = field(default_factory=dict)  # the usage chunk's kvblend block


@dataclass
class Flight:
    """One request as it goes: sent at ``sent`` (perf_counter), each token chunk's arrival
    in ``times``, its ``sample`` once it ended."""

    sent: float
    times: list[float] = field(default_factory=list)
    sample: Sample | None = None

    @property
    def first(self) -> float | None:
        return self.times[0] if self.times else None

    def late(self, now: float, limit_s: float) -> bool:
        """Its TTFT is (or will certainly be) over ``limit_s``, or it ended without an answer."""
        if self.sample is not None and self.sample.status != "ok":
            return True
        end = self.first if self.first is not None else now
        return end - self.sent > limit_s

    def late_gaps(self, limit_s: float) -> int:
        return sum(g > limit_s for g in token_gaps(self.times))


@dataclass
class Step:
    """One load step of one method: ``planned`` arrivals at ``rate`` requests/s."""

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

    def p95_ttft(self) -> float:
        return pct([s.ttft_s for s in self.measured() if s.status == "ok"], QUANTILE)

    def p95_itl(self) -> float:
        return pct([g for s in self.measured() if s.status == "ok" for g in s.gaps], QUANTILE)

    def summary(self) -> dict:
        ok = [s for s in self.measured() if s.status == "ok"]
        ttft, e2e, gaps = [s.ttft_s for s in ok], [s.e2e_s for s in ok], [g for s in ok for g in s.gaps]
        return {"rate": round(self.rate, 6), "planned": self.planned, "sent": len(self.samples),
                "measured_ok": len(ok), "rejected": self.count("rejected"), "errors": self.count("error"),
                "lost": self.count("lost"), "abandoned": self.count("abandoned"), "stopped_early": self.stopped_early,
                "backlog_at_last_arrival": self.backlog, "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
                "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(gaps, 50), "itl_p95_s": pct(gaps, 95),
                "itl_max_s": pct(gaps, 100), "e2e_p50_s": pct(e2e, 50), "e2e_p95_s": pct(e2e, 95),
                "wall_s": round(self.wall_s, 2),
                "output_tok_s": round(sum(s.tokens for s in self.samples if s.status == "ok") / self.wall_s, 3)
                if self.wall_s else 0.0}


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no data)."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))], 4)


def token_gaps(times: list[float]) -> list[float]:
    """Gaps between consecutive arrival times (the first token's wait is TTFT, not a gap)."""
    return [b - a for a, b in zip(times, times[1:])]


def allowed_late(n: int) -> int:
    """How many of ``n`` values may exceed the limit with the nearest-rank p95 still within it."""
    return n - max(1, math.ceil(QUANTILE / 100 * n))


def passes(step: Step, slo: Slo) -> bool:
    """Within the SLO: every arrival sent and ended ok, p95 TTFT and p95 ITL within it."""
    return (not step.stopped_early and len(step.samples) == step.planned
            and all(s.status == "ok" for s in step.samples)
            and step.p95_ttft() <= slo.ttft_s and not step.p95_itl() > slo.itl_s)


# ----- the arrival pattern and the search (pure) -----------------------------------------------
def unit_arrivals(n: int, seed: int) -> list[float]:
    """Cumulative arrival times of a unit-rate Poisson process (n of them)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(t)
    return out


def step_times(pattern: list[float], rate: float, plan: Plan) -> list[float]:
    """Send times (s from the step's start) at ``rate`` requests/s: ``warmup + arrivals``
    of the pattern, more while they span under ``min_step_s``, at most ``max_arrivals``."""
    n = plan.warmup + plan.arrivals
    while n < min(plan.max_arrivals, len(pattern)) and pattern[n - 1] / rate < plan.min_step_s:
        n += 1
    return [u / rate for u in pattern[:n]]


def bracket(history: list[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """The highest passing rate and the lowest failing rate above it (None where there is none)."""
    lo = max((r for r, ok in history if ok), default=None)
    hi = min((r for r, ok in history if not ok and (lo is None or r > lo)), default=None)
    return lo, hi


def next_rate(history: list[tuple[float, bool]], plan: Plan, start: float, floor: float) -> tuple[float | None, str]:
    """The next rate after ``history`` ((rate, passed) in the order run), or None and why
    the search ended: "bracketed" (within ``resolution``), "max_steps", or "floor" (every
    rate down to ``floor`` failed). Up by ``factor`` while every step passed, down while
    every step failed, then bisection."""
    if not history:
        return start, ""
    lo, hi = bracket(history)
    if lo is not None and hi is not None and hi / lo <= plan.resolution * 1.001:
        return None, "bracketed"
    if len(history) >= plan.max_steps:
        return None, "max_steps"
    if lo is not None and hi is not None:
        return math.sqrt(lo * hi), ""
    if lo is not None:
        return lo * plan.factor, ""
    down = min(r for r, _ in history) / plan.factor
    return (down, "") if down >= floor * 0.999 else (None, "floor")


def goodput(history: list[tuple[float, bool]]) -> float:
    """The highest rate that passed (0 if none)."""
    return max((r for r, ok in history if ok), default=0.0)


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


# ----- the host ------------------------------------------------------------------------------
class HostSteal:
    """The share of this machine's CPU time its hypervisor gave to other guests (``steal`` in
    ``/proc/stat``) from construction to ``share()``. Timing runs on a shared 2-core host
    move with it: a largest gap or a TTFT ratio from a run with a high share is the
    host's as much as the server's. None where there is no such counter (not Linux)."""

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self.stat = stat
        self._start = self._read()

    def _read(self) -> tuple[int, int] | None:
        try:
            fields = self.stat.read_text().split("\n", 1)[0].split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu" or not all(x.isdigit() for x in fields[1:9]):
            return None
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        return ticks[7], sum(ticks)

    def share(self) -> float | None:
        end = self._read()
        if self._start is None or end is None or end[1] <= self._start[1]:
            return None
        return round((end[0] - self._start[0]) / (end[1] - self._start[1]), 4)


# ----- the server ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(max_running: int, max_queued: int) -> dict:
    """The settings this benchmark serves with: memory tier, a small queue, quiet logs."""
    return {"scheduler": {"max_running": max_running, "max_queued": max_queued, "request_deadline_s": 600},
            "store": {"tiers": ["memory"]}, "log_level": "warning", "drain_timeout_s": 5}


class ServerStartError(SystemExit):
    """The server exited (``exited``), or did not answer ``/health`` before its start
    timeout; the message says which, with the end of its log. A SystemExit, so a script
    that does not catch it ends with that message."""

    def __init__(self, message: str, exited: bool) -> None:
        super().__init__(message)
        self.exited = exited


@contextmanager
def running_server(model: str, config: dict, timeout_s: float, threads: int | None = None,
                   env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
                   stop_timeout_s: float = 30.0) -> Iterator[str]:
    """Start `kvblend serve` with ``config`` (settings as YAML) on a free loopback port;
    yield its base URL; stop it (SIGTERM, then SIGKILL after ``stop_timeout_s``), also on an
    exception or Ctrl-C. ``threads``: the server's torch threads (OMP_NUM_THREADS; default:
    torch's choice); ``env``: more environment variables; ``extra_args``: more `serve` flags
    (``--replicas 2``). The server runs in its own process group: whatever of that group is
    still running once the server exited (a Ray instance it started) is killed, and said."""
    with tempfile.TemporaryDirectory(prefix="kvblend-serve-bench-") as tmp:
        cfg = Path(tmp) / "serve.yaml"
        cfg.write_text(json.dumps({"state_dir": str(Path(tmp) / "state"), **config}))  # JSON is YAML
        port = free_port()
        cmd = [sys.executable, "-m", "kvblend", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
               "--config", str(cfg), *extra_args]
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}), **(env or {})}
        with open(Path(tmp) / "server.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, timeout_s, Path(tmp) / "server.log")
            yield url
        finally:
            stop_server(proc, stop_timeout_s)


def stop_server(proc: subprocess.Popen, timeout_s: float, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc`` (a session leader), SIGKILL it after ``timeout_s``, then SIGKILL
    what is left of its process group ``grace_s`` after it exited."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        print(f"the server did not stop within {timeout_s:.0f} s of SIGTERM: killed", file=sys.stderr, flush=True)
        proc.kill()
        proc.wait()
    end = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(proc.pid, signal.SIGKILL if time.monotonic() >= end else 0)
        except (ProcessLookupError, PermissionError):
            return  # the group is empty: nothing was left behind
        if time.monotonic() >= end:
            break
        time.sleep(0.2)
    print(f"processes the server started were still running {grace_s:.0f} s after it exited: killed",
          file=sys.stderr, flush=True)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited ({proc.returncode}):\n{log.read_text()[-2000:]}", exited=True)
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"the server was not healthy within {timeout_s:.0f} s; the end of its log:\n"
                           f"{log.read_text()[-2000:]}", exited=False)


# ----- one request -----------------------------------------------------------------------------
async def stream_request(client: httpx.AsyncClient, body: dict, timeout_s: float, flight: Flight | None = None,
                         headers: dict[str, str] | None = None, stop: asyncio.Event | None = None) -> Sample:
    """One streamed chat completion; never raises (but can be cancelled). TTFT and e2e
    count from ``flight.sent`` (now if no flight is given); ``flight`` gets each token
    chunk's arrival as it comes and the sample at the end. Once ``stop`` is set the client
    ends the stream at its next chunk (status "closed")."""
    flight = flight or Flight(time.perf_counter())
    try:
        sample = await asyncio.wait_for(_stream(client, body, flight, headers, stop), timeout_s)
    except TimeoutError:
        sample = Sample("lost", detail=f"hung: no end within {timeout_s} s")
    except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        sample = Sample("lost", detail=f"{type(exc).__name__}: {exc}")
    sample.gaps = token_gaps(flight.times)
    flight.sample = sample
    return sample


async def _stream(client: httpx.AsyncClient, body: dict, flight: Flight, headers: dict[str, str] | None,
                  stop: asyncio.Event | None) -> Sample:
    done, usage, block, server_ttft, error, seen = False, None, None, math.nan, None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return _http_error(r.status_code, await r.aread(), r.headers.get("retry-after", ""))
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"].get("message")
                continue
            tokens = _tokens_in(chunk, seen)
            if tokens:
                seen += tokens
                flight.times.append(time.perf_counter())
            if chunk.get("usage"):
                usage, block = chunk["usage"], chunk.get("kvblend")
                server_ttft = (block or {}).get("ttft_s", math.nan)
            if stop is not None and stop.is_set() and flight.first is not None:
                return _sample("closed", flight, len(flight.times))
    if error is not None:
        return Sample("error" if done else "lost", detail=f"in-stream error: {error}")
    if not done or usage is None or flight.first is None:
        return Sample("lost", detail="the stream ended without a token, usage or [DONE]")
    sample = _sample("ok", flight, usage["completion_tokens"])
    sample.server_ttft_s, sample.prompt_tokens = server_ttft, usage["prompt_tokens"]
    sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    sample.kvblend = block or {}
    return sample


def _tokens_in(chunk: dict, seen: int) -> int:
    """How many tokens a chunk brings. With ``continuous_usage_stats`` (every body here asks
    for it) each token is a chunk carrying the running count, text or not: a run of tokens
    without text (an ignored EOS, a held-back stop string) is timed token by token instead of
    as one long gap. Otherwise: 1 for a chunk with text or the finish_reason (not the opening
    role chunk, nor the usage chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    if chunk.get("usage"):
        return max(0, chunk["usage"]["completion_tokens"] - seen)
    return int(bool(choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason")))


def _sample(status: str, flight: Flight, tokens: int) -> Sample:
    end = time.perf_counter()
    return Sample(status, flight.first - flight.sent, end - flight.sent, tokens)


def _http_error(status: int, raw: bytes, retry_after: str) -> Sample:
    """429 is "rejected"; another status with an OpenAI-shaped error body a clean "error"; else "lost"."""
    if status == 429:
        return Sample("rejected", detail=retry_after)
    try:
        clean = isinstance(json.loads(raw).get("error"), dict)
    except (ValueError, AttributeError):
        clean = False
    return Sample("error" if clean else "lost", detail=f"HTTP {status}: {raw[:200]!r}")


async def chat(client: httpx.AsyncClient, model: str, method: str, docs: list[str], question: str,
               max_tokens: int, timeout_s: float, flight: Flight | None = None) -> Sample:
    """One request of this benchmark: the MuSiQue prompt over ``docs``, ``max_tokens`` greedy tokens."""
    body = {"model": model, "messages": [{"role": "system", "content": MUSIQUE_INSTRUCTION},
                                         {"role": "user", "content": question}],
            "documents": docs, "kvblend": {"method": method}, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": STREAM_OPTIONS}
    return await stream_request(client, body, timeout_s, flight)


# ----- phases ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unloaded:
    """A method's unloaded figures: median TTFT, median ITL, median decode time after the first token."""

    ttft_s: float
    itl_s: float
    decode_s: float
    failed: int


class Bench:
    def __init__(self, url: str, model: str, args: argparse.Namespace, plan: Plan, slo: Slo,
                 workload: Workload) -> None:
        self.url, self.model, self.args, self.plan, self.slo, self.workload = url, model, args, plan, slo, workload
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout), limits=limits)
        self.requests = [workload.draw() for _ in range(plan.max_arrivals)]  # every step sends these, in order
        self.unloaded_requests = [workload.draw() for _ in range(plan.unloaded + 1)]  # every method's from these
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
        return Unloaded(statistics.median(s.ttft_s for s in ok), statistics.median(g for s in ok for g in s.gaps),
                        statistics.median(s.e2e_s - s.ttft_s for s in ok), sum(s.status == "lost" for s in samples))

    async def at_rate(self, method: str, rate: float) -> Step:
        """One step: the shared requests at the shared pattern's times for ``rate``; stops
        sending once the step cannot pass (then abandons what has no token yet); waits for
        every request sent."""
        times = step_times(self.pattern, rate, self.plan)
        step = Step(rate, self.plan.warmup, len(times))
        flights: list[Flight] = []
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        for k, at in enumerate(times):
            if not await self._wait_until(t0 + at, flights, len(times) - self.plan.warmup):
                step.stopped_early = True
                break
            flights.append(Flight(time.perf_counter()))
            docs, question = self.requests[k]
            tasks.append(asyncio.create_task(self.request(method, docs=docs, question=question, flight=flights[-1])))
        step.backlog = sum(not t.done() for t in tasks)
        if step.stopped_early:
            for f, t in zip(flights, tasks):
                if f.first is None:
                    t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        step.samples = [s if isinstance(s, Sample) else Sample("abandoned") for s in done]
        step.wall_s = time.perf_counter() - t0
        return step

    async def _wait_until(self, when: float, flights: list[Flight], measured_n: int) -> bool:
        """Sleep until ``when``; False as soon as the step (``measured_n`` measured
        arrivals) cannot pass any more."""
        gaps_allowed = allowed_late(measured_n * max(1, self.args.max_tokens - 1))
        while True:
            now = time.perf_counter()
            measured = flights[self.plan.warmup:]
            if any(f.sample is not None and f.sample.status != "ok" for f in flights) \
                    or sum(f.late(now, self.slo.ttft_s) for f in measured) > allowed_late(measured_n) \
                    or sum(f.late_gaps(self.slo.itl_s) for f in measured) > gaps_allowed:
                return False
            if now >= when:
                return True
            await asyncio.sleep(min(0.1, when - now))

    def step_cost(self, rate: float, base: Unloaded) -> float:
        """The planned length of a step: its last arrival, a drain of the TTFT SLO and one answer's decode."""
        return step_times(self.pattern, rate, self.plan)[-1] + self.slo.ttft_s + base.decode_s

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
    """One method's search: its steps and (rate, passed) history, and why it ended."""

    steps: list[Step] = field(default_factory=list)
    history: list[tuple[float, bool]] = field(default_factory=list)
    end: str = ""


async def climb(bench: Bench, method: str, base: Unloaded, until: float) -> Ladder:
    """Search ``method``'s goodput from ``f_start`` / its unloaded TTFT; a step runs only
    if it ends by ``until`` (perf_counter)."""
    ladder, plan = Ladder(), bench.plan
    while True:
        rate, ladder.end = next_rate(ladder.history, plan, plan.f_start / base.ttft_s, plan.f_min / base.ttft_s)
        if rate is None:
            return ladder
        cost = bench.step_cost(rate, base)
        if time.perf_counter() + cost > until:
            print(f"  {method:6s} {rate:.3f} req/s: a step of ~{cost:.0f} s does not fit the budget", flush=True)
            ladder.end = "budget"
            return ladder
        step = await bench.at_rate(method, rate)
        ladder.steps.append(step)
        ladder.history.append((rate, passes(step, bench.slo)))
        _print_step(method, step, ladder.history[-1][1])


def _print_step(method: str, step: Step, ok: bool) -> None:
    s = step.summary()
    print(f"  {method:6s} {step.rate:6.3f} req/s  sent {s['sent']:2d}/{s['planned']:2d} 429={s['rejected']} "
          f"err={s['errors']} lost={s['lost']} abandoned={s['abandoned']} backlog={s['backlog_at_last_arrival']}  "
          f"TTFT p50/p95 {s['ttft_p50_s']:.3f}/{s['ttft_p95_s']:.3f} s  ITL p50/p95/max {s['itl_p50_s']:.3f}/"
          f"{s['itl_p95_s']:.3f}/{s['itl_max_s']:.3f} s  {s['output_tok_s']:.1f} tok/s  {step.wall_s:.0f} s  "
          f"{'PASS' if ok else 'fail'}", flush=True)
    for smp in step.samples:
        if smp.status in ("lost", "error"):
            print(f"    {smp.status}: {smp.detail}", flush=True)


async def run(url: str, model: str, args: argparse.Namespace, plan: Plan, slo: Slo, workload: Workload,
              t_start: float) -> dict:
    """Every phase; ``t_start``: when the run began (perf_counter), for the budget."""
    bench, t = Bench(url, model, args, plan, slo, workload), time.perf_counter()
    await bench.store_pool()
    print(f"stored {len(workload.docs)} documents in {time.perf_counter() - t:.1f} s", flush=True)
    base = {m: await bench.unloaded(m) for m in args.methods}
    slo = bench.slo = slo.for_run([b.ttft_s for b in base.values()])
    lost = sum(b.failed for b in base.values())
    print("unloaded (median): " + ", ".join(f"{m} TTFT {b.ttft_s:.3f} s ITL {b.itl_s:.3f} s" for m, b in base.items())
          + f"; SLO: p95 TTFT <= {slo.ttft_s} s, p95 ITL <= {slo.itl_s} s", flush=True)
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
    ladders = await _ladders(bench, base, t_start + plan.budget_s)
    await bench.client.aclose()
    lost += sum(st.count("lost") for lad in ladders.values() for st in lad.steps)
    return _result(base, ladders, slo, burst, one, eight, lost)


def ladder_share(time_left_s: float, ttfts: list[float]) -> float:
    """The seconds the first of ``ttfts`` (unloaded TTFTs of the methods still to search,
    it first) gets of ``time_left_s``: in proportion to its TTFT."""
    return time_left_s * ttfts[0] / sum(ttfts)


async def _ladders(bench: Bench, base: dict[str, Unloaded], deadline: float) -> dict[str, Ladder]:
    """Every method's search, cheapest unloaded TTFT first, each within a share of the time
    left before ``deadline`` (perf_counter) in proportion to its unloaded TTFT: a step lasts
    about (warmup + arrivals) / rate and the rates scale as 1 / TTFT, so a slow method's
    steps are as many times longer (with equal shares full prefill had room for one step)."""
    order = sorted(base, key=lambda m: base[m].ttft_s)
    print(f"ladders: {deadline - time.perf_counter():.0f} s of the budget left", flush=True)
    ladders = {}
    for i, m in enumerate(order):
        share = ladder_share(deadline - time.perf_counter(), [base[o].ttft_s for o in order[i:]])
        ladders[m] = await climb(bench, m, base[m], time.perf_counter() + share)
        print(f"  {m}: goodput {goodput(ladders[m].history):.3f} req/s ({ladders[m].end})", flush=True)
    return {m: ladders[m] for m in base}


def _result(base: dict[str, Unloaded], ladders: dict[str, Ladder], slo: Slo, burst: list[Sample],
            one: list[float], eight: list[float], lost: int) -> dict:
    rate = {m: goodput(lad.history) for m, lad in ladders.items()}
    others = [m for m in ladders if m != "full"]
    steps = [st for lad in ladders.values() for st in lad.steps]
    out = {
        "blend_over_full_rate": _ratio(rate.get("blend"), rate.get("full")),
        **{f"{m}_over_full_rate": _ratio(rate[m], rate.get("full")) for m in others if m != "blend"},
        "ratio_bounds": {f"{m}_over_full": _ratio_bounds(ladders[m], ladders["full"]) for m in others
                         if "full" in ladders},
        "decode_batch8_over_1": round(statistics.median(eight) / statistics.median(one), 3),
        "lost_requests": lost,
        "rejected_requests": sum(st.count("rejected") for st in steps),
        "error_requests": sum(st.count("error") for st in steps),
        "abandoned_requests": sum(st.count("abandoned") for st in steps),
        "overload_burst": {"requests": len(burst), "rejected": sum(s.status == "rejected" for s in burst)},
        "slo": {"p95_ttft_s": slo.ttft_s, "p95_itl_s": slo.itl_s},
        "goodput_req_s": {m: round(v, 6) for m, v in rate.items()},
        "p95_at_goodput": {m: _p95_at_goodput(lad) for m, lad in ladders.items()},
        "unloaded_ttft_s": {m: round(b.ttft_s, 6) for m, b in base.items()},
        "unloaded_itl_s": {m: round(b.itl_s, 6) for m, b in base.items()},
        "search_end": {m: lad.end for m, lad in ladders.items()},
        "bracket_rate_req_s": {m: [None if r is None else round(r, 6) for r in bracket(lad.history)]
                               for m, lad in ladders.items()},
        "decode_tok_s": {"1": round(statistics.median(one), 2), "8": round(statistics.median(eight), 2)},
        "ladder": {m: [st.summary() for st in lad.steps] for m, lad in ladders.items()},
    }
    return nan_to_none(out)


def _p95_at_goodput(ladder: Ladder) -> dict | None:
    """p95 TTFT and ITL at the highest passing step, else at the lowest rate tried (None: no step ran)."""
    passing = [st for st, (_, ok) in zip(ladder.steps, ladder.history) if ok]
    pick = max(passing, key=lambda st: st.rate) if passing else min(ladder.steps, key=lambda st: st.rate, default=None)
    return None if pick is None else {"rate": round(pick.rate, 6), "ttft_s": pick.p95_ttft(), "itl_s": pick.p95_itl()}


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None unless both methods met the SLO at some rate (see ``search_end`` for why not)."""
    return round(a / b, 3) if a and b else None


def _ratio_bounds(num: Ladder, den: Ladder) -> list[float | None]:
    """The range the two brackets allow for num's goodput over den's: [lo/hi, hi/lo]
    (None where a bracket has no pass or no fail above it)."""
    (a_lo, a_hi), (b_lo, b_hi) = bracket(num.history), bracket(den.history)
    low = round(a_lo / b_hi, 3) if a_lo and b_hi else None
    high = round(a_hi / b_lo, 3) if a_hi and b_lo else None
    return [low, high]


def nan_to_none(x: object) -> object:
    """NaN (no data) as JSON null, recursively."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [nan_to_none(v) for v in x]
    return x


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Plan, Slo]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny pool, short steps, coarse ladder")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--docs-per-request", type=int, default=None, help="default 2 (--quick: 1)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--slo-ttft-s", type=float, default=None,
                   help="p95 TTFT every method must meet (s; default: 2x the slowest method's unloaded TTFT)")
    p.add_argument("--slo-itl-s", type=float, default=Slo.itl_s, help="p95 inter-token latency every method must meet")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival pattern and the request sequence")
    p.add_argument("--budget-min", type=float, default=None, help="whole-run budget (default 10; --quick: 5)")
    p.add_argument("--arrivals", type=int, default=None, help="measured arrivals per step (default 20; --quick: 6)")
    p.add_argument("--min-step-s", type=float, default=None, help="shortest span of a step's arrivals")
    p.add_argument("--max-steps", type=int, default=None, help="steps per method")
    p.add_argument("--resolution", type=float, default=None, help="bisect until hi / lo <= this (default 1.2)")
    p.add_argument("--decode-rounds", type=int, default=None)
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(DEFAULT_METHODS),
                   help="comma-separated subset of full,prefix,blend (default full,blend; ratios need full)")
    p.add_argument("--threads", type=int, default=None,
                   help="the server's torch threads (on an oversubscribed host 1 avoids stalls at every parallel op)")
    args = p.parse_args(argv)
    if not args.methods or set(args.methods) - set(METHODS):
        p.error(f"--methods takes a comma-separated subset of {','.join(METHODS)}")
    plan = Plan.quick() if args.quick else Plan()
    overrides = {"docs_per_request": args.docs_per_request, "arrivals": args.arrivals, "min_step_s": args.min_step_s,
                 "max_steps": args.max_steps, "decode_rounds": args.decode_rounds, "resolution": args.resolution,
                 "budget_s": args.budget_min * 60 if args.budget_min is not None else None}
    try:
        plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
        slo = Slo(args.slo_ttft_s, args.slo_itl_s)
    except ValueError as exc:
        p.error(str(exc))
    return args, plan, slo


def main(argv: list[str] | None = None) -> int:
    args, plan, slo = parse_args(argv)
    docs, questions = load_pool(plan.pool)
    workload = Workload(docs, questions, plan.docs_per_request, args.zipf, args.seed)
    print(f"model {args.model}; pool {len(docs)} documents; {workload.k} per request (Zipf s={args.zipf}); "
          f"answers {args.max_tokens} tokens; {os.cpu_count()} CPUs; budget {plan.budget_s / 60:.0f} min", flush=True)
    t, steal = time.perf_counter(), HostSteal()
    config = server_config(args.max_running, args.max_queued)
    with running_server(args.model, config, timeout_s=600, threads=args.threads) as url:
        out = asyncio.run(run(url, args.model, args, plan, slo, workload, t))
    out.update(model=args.model, quick=args.quick, server_threads=args.threads, plan=dataclasses.asdict(plan),
               wall_s=round(time.perf_counter() - t, 1), host_steal_share=steal.share())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
