"""Interference between tenants on one `kvblend serve`: stalls, long prefills, fairness.

    .venv/bin/python benchmarks/interference.py [--quick] [--model smollm2-135m] [--threads N]
        [--stall-steps G] [--interleave auto|layers|slices] [--gap-only]

Starts the real server (`python -m kvblend serve` on 127.0.0.1, memory tier, API keys for
the tenants a, b, heavy, light and probe) and drives it with httpx over SSE; every phase
has a bounded number of requests and ends by itself. Prompts are random common words cut
to a token count with the model's tokenizer, each one distinct (a tag at its start), sent
with ``"kvblend": {"method": "full"}`` and ``ignore_eos``, greedy. Times are the client's:
TTFT is request sent -> first token, a gap is the time between two tokens (every token is
a chunk: ``continuous_usage_stats``, so tokens without text are timed too).

1. Long prefills against a running stream (issue #20 point 9). Each long prompt
   (``--long-tokens``, default ~3k and ~8k tokens, cut to the model's context) is first
   sent alone by tenant b: its unloaded TTFT (after one warm-up at the largest length,
   so that neither measurement pays the server's first touch of buffers that large).
   Then tenant a opens one stream (short prompt, up to ``stream_max_tokens`` tokens);
   after its first ``lead_tokens`` tokens, b sends the long prompts one after the other
   (each after the previous one ended); once the last has ended and a has received
   ``tail_tokens`` more tokens, the client closes a's stream. ``max_gap_over_median``
   is a's largest gap over its median *steady* gap: the gaps outside the window from
   the first long request sent to the last one ended, so that the median is the
   stream's own pace whatever the long prefills do to the gaps inside (goal <= 3).
   ``long_ttft_over_unloaded`` is the largest of the long requests' TTFT under that
   load over the same length's unloaded TTFT (goal <= 1.3). The two pull against each
   other on a device where a decode step is mostly a pass over the weights:
   ``--stall-steps G`` sets the server's ``scheduler.max_stall_steps`` (a turn carrying
   prefill work takes about G decode steps, so the gap ratio is about G and the TTFT ratio about
   1 + 1/(G - 1)); ``--interleave`` sets how the prefill keeps that pace (the
   server's ``scheduler.interleave``); ``--gap-only`` runs this phase alone, to trace
   that frontier.
2. Fairness. Light's unloaded TTFT: the median of sequential requests of
   ``fair_prompt_tokens`` tokens, ``fair_max_tokens`` answer tokens, alone. The server's
   sustainable rate: tenant probe keeps ``max_running`` requests of that shape in flight
   (closed loop) for ``capacity_requests`` requests: completed / wall time. Then, for one
   bounded period, tenant heavy sends Poisson arrivals at ``heavy_x`` (5) x that rate
   while tenant light sends evenly spaced ones at ``light_x`` (0.1) x it (so that its
   few requests are not bunched by chance); every request sent is waited for.
   ``light_p95_over_unloaded`` is light's nearest-rank p95 TTFT over its unloaded TTFT
   (goal <= 2), ``light_429`` how many of light's requests were refused (goal 0).

Every request ends as ok, rejected (429), error (a clean error: an OpenAI-shaped error
body, or an in-stream error then [DONE]), closed (the client ended a's stream) or lost
(a broken or unfinished stream, or no end within ``--request-timeout`` s);
``lost_requests`` counts the lost ones of every phase (goal 0). A default run takes ~10
minutes on a quiet 2-core host (three ~8k-token full prefills are most of phase 1).
Timings on a shared host drift; every ratio is measured in one run, and ``host_steal_share``
(the run's, and phase 1's under ``gap``) says how much of the CPU the hypervisor gave to
other guests meanwhile. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import STREAM_OPTIONS, Flight, HostSteal, Sample, nan_to_none, pct, running_server, stream_request, token_gaps  # noqa: E402

from kvblend.models.registry import DEFAULT_MODEL  # noqa: E402

TENANTS = ("a", "b", "heavy", "light", "probe")
KEYS = {tenant: f"bench-key-{tenant}" for tenant in TENANTS}
GOALS = {"max_gap_over_median": 3.0, "long_ttft_over_unloaded": 1.3, "light_p95_over_unloaded": 2.0,
         "light_429": 0, "lost_requests": 0}
WORDS = ("the river runs north past an old mill where a doctor once lived and the company built "
         "a bridge over water in spring while children played near green fields under bright "
         "clouds as farmers carried bread to market through narrow streets of stone houses").split()
TEMPLATE_MARGIN = 64  # tokens the chat template may add around a message


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them); see the module docstring."""

    long_tokens: tuple[int, ...] = (3000, 8000)
    long_max_tokens: int = 4
    lead_tokens: int = 48  # stream tokens before the first long request ...
    tail_tokens: int = 48  # ... and after the last one ended
    stream_max_tokens: int = 4096
    fair_prompt_tokens: int = 512
    fair_max_tokens: int = 16
    unloaded: int = 5  # light's sequential requests, after one warm-up
    capacity_requests: int = 24
    heavy_x: float = 5.0
    light_x: float = 0.1
    light_requests: int = 16  # the period lasts light_requests / light's rate, within:
    period_min_s: float = 30.0
    period_max_s: float = 200.0
    max_heavy: int = 800

    def __post_init__(self) -> None:
        if not self.long_tokens or min(self.long_tokens) < 1:
            raise ValueError(f"long_tokens must be one or more positive counts: {self.long_tokens}")
        if min(self.long_max_tokens, self.lead_tokens, self.tail_tokens, self.stream_max_tokens,
               self.fair_prompt_tokens, self.fair_max_tokens, self.unloaded, self.capacity_requests,
               self.light_requests, self.max_heavy) < 1:
            raise ValueError(f"plan sizes must be >= 1: {self}")
        if not 0 < self.light_x < self.heavy_x or not 0 < self.period_min_s <= self.period_max_s:
            raise ValueError(f"need 0 < light_x < heavy_x and 0 < period_min_s <= period_max_s: {self}")

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: ~0.4k and ~1.2k-token long prompts, short streams, a 10-30 s period."""
        return cls(long_tokens=(400, 1200), lead_tokens=16, tail_tokens=16, stream_max_tokens=1024,
                   fair_prompt_tokens=128, fair_max_tokens=8, unloaded=3, capacity_requests=8, light_requests=6,
                   period_min_s=10.0, period_max_s=30.0, max_heavy=200)


# ----- statistics (pure) -----------------------------------------------------------------------
def gap_figures(times: list[float], busy: tuple[float, float] | None) -> dict[str, float | int]:
    """A stream's gaps between token arrivals ``times``: the largest (and when it began,
    in s after the ``busy`` window opened), the median of the steady ones (those whose
    interval does not overlap the ``busy`` window), the median of all, and the largest
    over the steady median."""
    gaps = token_gaps(times)
    steady = [g for a, g in zip(times, gaps) if busy is None or a + g <= busy[0] or a >= busy[1]]
    max_gap = max(gaps, default=math.nan)
    median = statistics.median(steady) if steady else math.nan
    at = times[gaps.index(max_gap)] - busy[0] if gaps and busy else math.nan
    return {"max_gap_s": max_gap, "max_gap_start_s": at, "median_gap_s": median,
            "median_gap_all_s": statistics.median(gaps) if gaps else math.nan,
            "max_gap_over_median": max_gap / median if median > 0 else math.nan,
            "gaps": len(gaps), "steady_gaps": len(steady)}


def ttft_ratios(loaded: dict[int, Sample], unloaded: dict[int, Sample]) -> dict[int, float]:
    """Each long prompt's TTFT under load over its TTFT alone (NaN where either did not answer)."""
    return {n: loaded[n].ttft_s / unloaded[n].ttft_s
            if loaded[n].status == unloaded[n].status == "ok" else math.nan for n in loaded}


def worst(ratios: dict[Any, float]) -> float:
    """The largest ratio; NaN if any is NaN (a request without an answer fails the goal)."""
    values = list(ratios.values())
    return math.nan if not values or any(math.isnan(v) for v in values) else max(values)


def poisson_times(rate: float, duration_s: float, seed: int, limit: int) -> list[float]:
    """Arrival times of a Poisson process of ``rate``/s within ``duration_s``, at most ``limit``."""
    rng, t, out = random.Random(seed), 0.0, []
    while len(out) < limit:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        out.append(t)
    return out


def even_times(rate: float, duration_s: float) -> list[float]:
    """Evenly spaced arrivals at ``rate``/s within ``duration_s``, mid-interval; at least one."""
    n = max(1, math.floor(rate * duration_s))
    return [(i + 0.5) * duration_s / n for i in range(n)]


def period_s(plan: Plan, capacity: float) -> float:
    """How long heavy and light send: long enough for ``light_requests`` expected light
    arrivals, within bounds, and short enough for at most ``max_heavy`` expected heavy ones."""
    wanted = min(plan.period_max_s, max(plan.period_min_s, plan.light_requests / (plan.light_x * capacity)))
    return min(wanted, plan.max_heavy / (plan.heavy_x * capacity))


def tally(samples: list[Sample]) -> dict[str, float | int]:
    """Counts by status and TTFT percentiles of the ok ones."""
    ttft = [s.ttft_s for s in samples if s.status == "ok"]
    counts = {k: sum(s.status == k for s in samples) for k in ("ok", "rejected", "error", "lost")}
    return {"sent": len(samples), **counts, "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "ttft_max_s": pct(ttft, 100)}


def count(samples: list[Sample], status: str) -> int:
    return sum(s.status == status for s in samples)


# ----- prompts ---------------------------------------------------------------------------------
class Prompts:
    """Texts of about a given token count under the model's tokenizer: random common words
    (drawn once per count), each text behind its own tag so that no two share a prefix."""

    TAG_TOKENS = 8  # what "request N :" costs at most

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer, self.rng, self.serial, self.bases = tokenizer, random.Random(seed), 0, {}

    def tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self, n: int) -> str:
        self.serial += 1
        if n not in self.bases:
            self.bases[n] = self.words_within(max(1, n - self.TAG_TOKENS))
        return f"request {self.serial} : {self.bases[n]}"

    def words_within(self, n: int) -> str:
        """Random words, as many as stay within ``n`` tokens (bisection on the word count)."""
        words = [self.rng.choice(WORDS) for _ in range(2 * n)]
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.tokens(" ".join(words[:mid])) <= n else (lo, mid - 1)
        return " ".join(words[:lo])


def load_tokenizer(model: str) -> Any:
    """The served model's tokenizer, read from the same folder the server loads."""
    from kvblend.models.loader import load_tokenizer as from_folder
    from kvblend.models.registry import resolve_packaged

    path = Path(model)
    if path.suffix == ".gguf":
        from kvblend.models.gguf import convert_gguf

        return from_folder(convert_gguf(path))
    return from_folder(path if path.is_dir() else resolve_packaged(model))


# ----- the client ------------------------------------------------------------------------------
class Bench:
    def __init__(self, url: str, model_id: str, context: int, plan: Plan, prompts: Prompts,
                 timeout_s: float) -> None:
        self.model_id, self.context, self.plan = model_id, context, plan
        self.prompts, self.timeout_s = prompts, timeout_s
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits)

    def body(self, text: str, max_tokens: int) -> dict:
        return {"model": self.model_id, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "kvblend": {"method": "full"}, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": STREAM_OPTIONS}

    async def ask(self, tenant: str, text: str, max_tokens: int, flight: Flight | None = None,
                  stop: asyncio.Event | None = None) -> Sample:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        return await stream_request(self.client, self.body(text, max_tokens), self.timeout_s, flight, headers, stop)

    async def fair_request(self, tenant: str) -> Sample:
        return await self.ask(tenant, self.prompts.make(self.plan.fair_prompt_tokens), self.plan.fair_max_tokens)

    def long_sizes(self) -> list[int]:
        """The long prompts' token counts, each cut to fit the context with its answer and the template."""
        room = self.context - self.plan.long_max_tokens - TEMPLATE_MARGIN
        return list(dict.fromkeys(min(n, room) for n in self.plan.long_tokens))


async def wait_for(cond: Callable[[], bool], timeout_s: float) -> None:
    end = time.perf_counter() + timeout_s
    while not cond() and time.perf_counter() < end:
        await asyncio.sleep(0.02)


# ----- phase 1: long prefills against a stream --------------------------------------------------
@dataclass
class GapRun:
    warmup: Sample | None = None  # the largest long prompt once, so that no measured one pays first-touch costs
    unloaded: dict[int, Sample] = field(default_factory=dict)
    loaded: dict[int, Sample] = field(default_factory=dict)
    stream: Sample | None = None
    times: list[float] = field(default_factory=list)
    busy: tuple[float, float] | None = None
    outlived: bool = False  # the stream was still running when the last long request ended


async def gap_phase(bench: Bench) -> GapRun:
    plan, run, sizes = bench.plan, GapRun(), bench.long_sizes()
    run.warmup = await bench.ask("b", bench.prompts.make(max(sizes)), plan.long_max_tokens)
    print(f"  warm-up at {max(sizes)} tokens: {_line(run.warmup)}", flush=True)
    for n in sizes:
        run.unloaded[n] = await bench.ask("b", bench.prompts.make(n), plan.long_max_tokens)
        print(f"  long {n:5d} tokens alone: {_line(run.unloaded[n])}", flush=True)
    flight, stop = Flight(time.perf_counter()), asyncio.Event()
    stream_max = min(plan.stream_max_tokens, bench.context - TEMPLATE_MARGIN - 32)
    task = asyncio.create_task(bench.ask("a", bench.prompts.make(24), stream_max, flight, stop))
    await wait_for(lambda: len(flight.times) >= plan.lead_tokens or task.done(), bench.timeout_s)
    start = time.perf_counter()
    for n in sizes:
        run.loaded[n] = await bench.ask("b", bench.prompts.make(n), plan.long_max_tokens)
        print(f"  long {n:5d} tokens beside the stream: {_line(run.loaded[n])}", flush=True)
    run.busy, run.outlived = (start, time.perf_counter()), not task.done()
    seen = len(flight.times)
    await wait_for(lambda: len(flight.times) >= seen + plan.tail_tokens or task.done(), bench.timeout_s)
    stop.set()
    run.stream = await task
    run.times = list(flight.times)
    return run


def _line(s: Sample) -> str:
    if s.status != "ok":
        return f"{s.status} {s.detail}"
    return f"TTFT {s.ttft_s:.3f} s ({s.prompt_tokens} prompt tokens)"


# ----- phase 2: fairness ------------------------------------------------------------------------
@dataclass
class FairRun:
    unloaded: list[Sample] = field(default_factory=list)
    capacity: list[Sample] = field(default_factory=list)
    capacity_req_s: float = math.nan
    period_s: float = 0.0
    heavy: list[Sample] = field(default_factory=list)
    light: list[Sample] = field(default_factory=list)


async def fair_phase(bench: Bench, max_running: int, seed: int) -> FairRun:
    plan, run = bench.plan, FairRun()
    run.unloaded = [await bench.fair_request("light") for _ in range(plan.unloaded + 1)][1:]
    run.capacity, run.capacity_req_s = await capacity(bench, max_running)
    if not run.capacity_req_s > 0:
        print("  no request of the capacity phase answered: no flood", flush=True)
        return run
    run.period_s = period_s(plan, run.capacity_req_s)
    heavy = poisson_times(plan.heavy_x * run.capacity_req_s, run.period_s, seed, plan.max_heavy)
    light = even_times(plan.light_x * run.capacity_req_s, run.period_s)
    print(f"  sustainable {run.capacity_req_s:.3f} req/s; {run.period_s:.0f} s of heavy at "
          f"{plan.heavy_x * run.capacity_req_s:.2f} req/s ({len(heavy)}) and light at "
          f"{plan.light_x * run.capacity_req_s:.3f} req/s ({len(light)})", flush=True)
    t0 = time.perf_counter()
    run.heavy, run.light = await asyncio.gather(send_at(t0, heavy, lambda: bench.fair_request("heavy")),
                                                send_at(t0, light, lambda: bench.fair_request("light")))
    return run


async def capacity(bench: Bench, workers: int) -> tuple[list[Sample], float]:
    """``workers`` closed-loop clients of tenant probe until ``capacity_requests`` have been sent:
    the ok ones over the wall time."""
    left, samples = [bench.plan.capacity_requests], []

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            samples.append(await bench.fair_request("probe"))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return samples, count(samples, "ok") / (time.perf_counter() - t0)


async def send_at(t0: float, times: list[float], request: Callable[[], Awaitable[Sample]]) -> list[Sample]:
    """Start ``request()`` at each of ``times`` (s after ``t0``); wait for every one."""
    tasks = []
    for at in times:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(request()))
    return list(await asyncio.gather(*tasks))


# ----- the run ---------------------------------------------------------------------------------
async def run(url: str, plan: Plan, args: argparse.Namespace, prompts: Prompts) -> dict:
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
        model = (await c.get("/v1/models")).json()["data"][0]
    bench = Bench(url, model["id"], model["max_model_len"], plan, prompts, args.request_timeout)
    warm = await bench.fair_request("probe")
    print(f"warm-up: {_line(warm)}; context {bench.context} tokens", flush=True)
    print("phase 1: long prefills against a stream", flush=True)
    steal = HostSteal()
    gap = await gap_phase(bench)
    gap_steal = steal.share()
    fair = FairRun()
    if not args.gap_only:
        print("phase 2: fairness", flush=True)
        fair = await fair_phase(bench, args.max_running, args.seed)
    await bench.client.aclose()
    out = result(gap, fair, [warm])
    out["gap"]["host_steal_share"] = gap_steal
    return out


def result(gap: GapRun, fair: FairRun, other: list[Sample]) -> dict:
    figures = gap_figures(gap.times, gap.busy)
    ratios = ttft_ratios(gap.loaded, gap.unloaded)
    light_unloaded = statistics.median([s.ttft_s for s in fair.unloaded if s.status == "ok"] or [math.nan])
    light, heavy = tally(fair.light), tally(fair.heavy)
    everything = [*other, *[s for s in (gap.warmup, gap.stream) if s is not None], *gap.unloaded.values(),
                  *gap.loaded.values(), *fair.unloaded, *fair.capacity, *fair.heavy, *fair.light]
    out = {
        "max_gap_over_median": figures["max_gap_over_median"],
        "long_ttft_over_unloaded": worst(ratios),
        "light_p95_over_unloaded": light["ttft_p95_s"] / light_unloaded if fair.light else math.nan,
        "light_429": light["rejected"], "heavy_429": heavy["rejected"],
        "lost_requests": count(everything, "lost"), "error_requests": count(everything, "error"),
        "goals": GOALS,
        "gap": {**figures, "stream_status": gap.stream.status if gap.stream else None,
                "stream_tokens": len(gap.times), "stream_outlived_long": gap.outlived,
                "busy_window_s": round(gap.busy[1] - gap.busy[0], 3) if gap.busy else None},
        "long": {str(n): {"prompt_tokens": gap.unloaded[n].prompt_tokens, "unloaded_ttft_s": gap.unloaded[n].ttft_s,
                          "loaded_ttft_s": gap.loaded[n].ttft_s, "ratio": ratios[n]} for n in gap.loaded},
        "fair": {"light_unloaded_ttft_s": light_unloaded, "capacity_req_s": fair.capacity_req_s,
                 "period_s": round(fair.period_s, 2), "light": light, "heavy": heavy,
                 "capacity_phase": tally(fair.capacity)},
    }
    return nan_to_none(_rounded(out))


def _rounded(x: object) -> object:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def server_settings(max_running: int, max_queued: int, stall_steps: float | None = None,
                    interleave: str | None = None) -> dict:
    """Keys for every tenant, a small queue, answers up to the context (the stream is long);
    ``stall_steps``, ``interleave``: the server's ``scheduler.max_stall_steps`` and
    ``scheduler.interleave`` (None: its default)."""
    stall = {} if stall_steps is None else {"max_stall_steps": stall_steps}
    if interleave is not None:
        stall["interleave"] = interleave
    return {"api_keys": {key: tenant for tenant, key in KEYS.items()},
            "scheduler": {"max_running": max_running, "max_queued": max_queued, "request_deadline_s": 600, **stall},
            "limits": {"max_tokens": 1 << 20}, "store": {"tiers": ["memory"]}, "log_level": "warning",
            "drain_timeout_s": 5}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: short prompts, short phases")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--long-tokens", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="comma-separated long prompt sizes in tokens (default 3000,8000; --quick 400,1200)")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as hung")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads (OMP_NUM_THREADS)")
    p.add_argument("--stall-steps", type=float, default=None,
                   help="the server's scheduler.max_stall_steps (default: the server's default)")
    p.add_argument("--interleave", choices=("auto", "layers", "slices"), default=None,
                   help="the server's scheduler.interleave (default: the server's default)")
    p.add_argument("--gap-only", action="store_true", help="phase 1 only (the stall / long-TTFT trade-off)")
    args = p.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    try:
        if args.long_tokens is not None:
            plan = dataclasses.replace(plan, long_tokens=args.long_tokens)
    except ValueError as exc:
        p.error(str(exc))
    return args, plan


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    prompts = Prompts(load_tokenizer(args.model), args.seed)
    print(f"model {args.model}; {os.cpu_count()} CPUs; long prompts {plan.long_tokens} tokens", flush=True)
    t, steal = time.perf_counter(), HostSteal()
    config = server_settings(args.max_running, args.max_queued, args.stall_steps, args.interleave)
    with running_server(args.model, config, timeout_s=600, threads=args.threads) as url:
        out = asyncio.run(run(url, plan, args, prompts))
    out.update(model=args.model, quick=args.quick, server_threads=args.threads, stall_steps=args.stall_steps,
               interleave=args.interleave, plan=dataclasses.asdict(plan), wall_s=round(time.perf_counter() - t, 1),
               host_steal_share=steal.share())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
