"""Document-affinity routing against Ray Serve's default router: two model replicas, one run.

    PYTHONPATH=src .venv/bin/python benchmarks/cluster.py [--quick] [--docs 32] [--requests 400]
        [--seconds 300] [--concurrency 4] [--zipf 0.8] [--memory-fraction 0.6] [--load-factor F]
        [--dump FILE]

Needs the ``cluster`` extra (``pip install kvblend[cluster]``). Starts one local Ray
instance and, for each router in turn (Ray's default power of two choices, then
``DocumentAffinityRouter``), the ``kvblend.cluster`` application with 2 model replicas
(one torch thread each, ``cluster.replica_cpus`` 1) whose only store tier is memory,
drives it over HTTP, and tears it down, so each router starts from cold replicas.

Workload: a pool of ``--docs`` MuSiQue passages; each request takes
``--docs-per-request`` distinct passages drawn by Zipf popularity (rank^-s) and a
question, answers ``--max-tokens`` greedy tokens, method blend. One request sequence,
drawn once, is sent to both routers by ``--concurrency`` closed-loop clients, for
``--requests`` requests or ``--seconds`` seconds, whichever ends first. The first
``--warmup`` requests fill the memory tiers and are left out of the figures.

Memory sizing: each replica's memory tier gets ``--memory-fraction`` of the pool's KV
bytes (tokens x KV bytes per token of the model, fp32, +2 % for entry headers): with the
default 0.6 the pool is 1.7x one replica's memory and 0.83x two, so one replica cannot
hold it all but two together can, if each holds its own half: what affinity routing is
for.

Figures per router: the memory-tier hit rate (documents whose KV a replica's memory tier
served, over all documents of the measured requests; ``kvblend.documents[].source`` of
the usage chunk), the same weighted by tokens, TTFT p50/p95 measured by the client
(request sent -> first token), throughput (ok requests per second of the phase's wall
time), how requests ended (ok, rejected 429, error, lost: broken or hung), and where they
went: requests per replica and ``replicas_per_passage`` (over passages asked for at least
twice, how many replicas answered requests carrying them: 1.0 is perfectly sticky, Ray's
default router tends to 2). Before any request it prints Che's estimate of the memory hit
rate of an LRU tier that sees every lookup (Ray's router: each replica sees the whole
popularity distribution) and so the most the hit-rate ratio can be on this workload
(``lru_hit_estimate``; with the defaults about 0.76, a ceiling of about 1.3x). Ends with
one JSON line: ``affinity_hit_rate``, ``default_hit_rate``, ``affinity_p95_ttft_s``,
``default_p95_ttft_s``, ``lost_requests`` (both phases), the ratios (``hit_rate_ratio``
= affinity / default, goal >= 1.5; ``p95_ttft_ratio`` = affinity / default, goal < 1;
``default_hit_rate_lru_estimate`` and ``hit_rate_ratio_ceiling``, above),
and each phase's figures. Timings on a shared host drift: read the ratios. ``--dump FILE``
appends every request's outcome (passages, TTFT, replica, its ``kvblend`` block: queue,
prefill and misses) as JSON lines, to see what the slow requests waited for.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import STREAM_OPTIONS, Workload, free_port, load_pool, nan_to_none, pct  # noqa: E402

import kvblend  # noqa: E402
from kvblend.eval.datasets import MUSIQUE_INSTRUCTION  # noqa: E402
from kvblend.models.registry import DEFAULT_MODEL  # noqa: E402

ROUTERS = ("default", "affinity")
REPLICAS = 2
ENTRY_OVERHEAD = 1.02


@dataclass(frozen=True)
class Plan:
    """One run's sizes (``--quick`` shrinks them); see the module docstring."""

    docs: int = 32
    docs_per_request: int = 2
    requests: int = 400
    warmup: int = 16
    seconds: float = 300.0  # per router, after its replicas are ready (p95 needs ~60 measured requests)
    concurrency: int = 4
    max_tokens: int = 16
    zipf_s: float = 0.8
    memory_fraction: float = 0.6
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if min(self.docs, self.docs_per_request, self.requests, self.concurrency, self.max_tokens) < 1:
            raise ValueError(f"plan sizes must be >= 1: {self}")
        if not 0 <= self.warmup < self.requests or self.seconds <= 0 or self.request_timeout_s <= 0:
            raise ValueError(f"need 0 <= warmup < requests, seconds > 0: {self}")
        if not 0.5 < self.memory_fraction < 1.0:
            raise ValueError("memory_fraction must be in (0.5, 1): the pool must not fit one replica but fit two")

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: 8 passages, 1 per request, 16 requests per router."""
        return cls(docs=8, docs_per_request=1, requests=16, warmup=4, seconds=60.0, concurrency=2, max_tokens=4)


@dataclass
class Outcome:
    """How one request ended: ``status`` ok / rejected / error / lost; ``docs`` each
    document's (source, tokens) from the usage chunk's ``kvblend`` block."""

    status: str
    ttft_s: float = math.nan
    docs: list[tuple[str, int]] = field(default_factory=list)
    detail: str = ""
    replica: str | None = None  # the model replica that answered (the kvblend block's "replica")
    sent_s: float = math.nan  # when it was sent, from the phase's start
    block: dict = field(default_factory=dict)  # the usage chunk's kvblend block (--dump)


# ----- one request ---------------------------------------------------------------------------
def chat_body(model: str, docs: list[str], question: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": MUSIQUE_INSTRUCTION},
                                         {"role": "user", "content": question}],
            "documents": docs, "kvblend": {"method": "blend"}, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": STREAM_OPTIONS}


async def send(client: httpx.AsyncClient, body: dict, timeout_s: float) -> Outcome:
    """One streamed chat completion; never raises."""
    sent = time.perf_counter()
    try:
        return await asyncio.wait_for(_stream(client, body, sent), timeout_s)
    except TimeoutError:
        return Outcome("lost", detail=f"hung: no end within {timeout_s} s")
    except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        return Outcome("lost", detail=f"{type(exc).__name__}: {exc}")


async def _stream(client: httpx.AsyncClient, body: dict, sent: float) -> Outcome:
    first, done, block, error = None, False, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            return Outcome("rejected" if r.status_code == 429 else "error", detail=f"HTTP {r.status_code}: {raw[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = str(chunk["error"].get("message"))
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason")):
                first = time.perf_counter()
            if chunk.get("usage"):
                block = chunk.get("kvblend") or {}
    if error is not None:
        return Outcome("error" if done else "lost", detail=f"in-stream error: {error}")
    if not done or block is None or first is None:
        return Outcome("lost", detail="the stream ended without a token, usage or [DONE]")
    docs = [(d["source"], int(d["tokens"])) for d in block.get("documents", [])]
    return Outcome("ok", first - sent, docs, replica=block.get("replica"), block=block)


# ----- one router ----------------------------------------------------------------------------
@dataclass
class Phase:
    router: str
    outcomes: list[Outcome]
    wall_s: float
    ready_s: float
    passages: list[tuple[int, ...]] = field(default_factory=list)  # each request's passages (pool indices)

    def placement(self) -> dict:
        """Requests per replica, and over the passages asked for at least twice, the mean
        number of replicas that answered a request carrying them (1.0: perfectly sticky)."""
        served: dict[int, set[str]] = {}
        asked: dict[int, int] = {}
        for o, docs in zip(self.outcomes, self.passages):
            for i in docs:
                asked[i] = asked.get(i, 0) + 1
                if o.replica is not None:
                    served.setdefault(i, set()).add(o.replica)
        repeated = [len(served[i]) for i, n in asked.items() if n >= 2 and i in served]
        per_replica: dict[str, int] = {}
        for o in self.outcomes:
            if o.replica is not None:
                per_replica[o.replica] = per_replica.get(o.replica, 0) + 1
        return {"requests_per_replica": sorted(per_replica.values(), reverse=True),
                "replicas_per_passage": round(sum(repeated) / len(repeated), 3) if repeated else math.nan}

    def figures(self, warmup: int) -> dict:
        measured = self.outcomes[warmup:]
        ok = [o for o in measured if o.status == "ok"]
        docs = [d for o in ok for d in o.docs if d[0] not in ("empty", "request")]
        mem = [d for d in docs if d[0] == "memory"]
        ttfts = [o.ttft_s for o in ok]
        statuses = {s: sum(o.status == s for o in self.outcomes) for s in ("ok", "rejected", "error", "lost")}
        return {
            "router": self.router, "requests": len(self.outcomes), "measured": len(measured), **statuses,
            "hit_rate": round(len(mem) / len(docs), 4) if docs else math.nan,
            "token_hit_rate": round(sum(t for _, t in mem) / max(1, sum(t for _, t in docs)), 4) if docs else math.nan,
            "sources": {s: sum(d[0] == s for d in docs) for s in sorted({d[0] for d in docs})},
            "p50_ttft_s": round(pct(ttfts, 50), 3), "p95_ttft_s": round(pct(ttfts, 95), 3),
            "throughput_req_s": round(statuses["ok"] / self.wall_s, 3) if self.wall_s else math.nan,
            "wall_s": round(self.wall_s, 1), "ready_s": round(self.ready_s, 1), **self.placement(),
            "details": sorted({o.detail for o in self.outcomes if o.status != "ok"})[:5],
        }


async def drive(url: str, bodies: list[dict], plan: Plan) -> tuple[list[Outcome], float]:
    """Send ``bodies`` in order from ``plan.concurrency`` clients until done or
    ``plan.seconds`` passed (requests not started by then are not sent)."""
    outcomes: list[Outcome | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=plan.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(plan.request_timeout_s), limits=limits) as client:
        async def client_loop() -> None:
            for i in queue:
                if time.perf_counter() - start > plan.seconds:
                    return
                sent = time.perf_counter() - start
                outcomes[i] = dataclasses.replace(await send(client, bodies[i], plan.request_timeout_s), sent_s=sent)
        await asyncio.gather(*(client_loop() for _ in range(plan.concurrency)))
    wall = time.perf_counter() - start
    # clients take requests in order and stop together at the deadline: the sent ones are a prefix
    sent = list(itertools.takewhile(lambda o: o is not None, outcomes))
    return sent, wall


def run_phase(router: str, settings_overrides: dict, bodies: list[dict], passages: list[tuple[int, ...]],
              plan: Plan, load_factor: float | None = None) -> Phase:
    """Start the application with ``router``, drive it, shut Serve down (Ray stays up).
    ``load_factor``: the affinity router's ``cluster.load_factor`` (None: the default)."""
    from kvblend.cluster.app import shutdown, start_local, wait_ready
    from kvblend.settings import Settings

    port = free_port()
    bound = {} if load_factor is None else {"load_factor": load_factor}
    settings = Settings.load(**settings_overrides, port=port, cluster={"router": router, "replica_cpus": 1.0,
                                                                       "ingress_cpus": 0.5, **bound})
    t = time.perf_counter()
    running = start_local(settings, replicas=REPLICAS, router=router)
    try:
        wait_ready(running.base_url, timeout_s=600)
        ready = time.perf_counter() - t
        outcomes, wall = asyncio.run(drive(running.base_url, bodies, plan))
    finally:
        shutdown(running)
    return Phase(router, outcomes, wall, ready, passages[:len(outcomes)])


# ----- sizing --------------------------------------------------------------------------------
def pool_kv_bytes(model: str, docs: list[str]) -> tuple[int, list[int]]:
    """(KV bytes of the pool in the default storage dtype (what the replicas store) with entry
    headers, each passage's tokens), from the model's config and tokenizer."""
    from kvblend.models import load_model
    from kvblend.store.config import StoreConfig
    from kvblend.store.plan import kv_bytes_per_token

    loaded = load_model(model)
    c = loaded.config
    tokens = [len(loaded.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs]
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, StoreConfig.kv_dtype)
    return math.ceil(sum(tokens) * per_token * ENTRY_OVERHEAD), tokens


def lru_hit_estimate(passages: list[tuple[int, ...]], sizes: list[int], capacity: float) -> float:
    """The hit rate of one LRU cache of ``capacity`` (in the units of ``sizes``) that sees
    every lookup of ``passages`` (the request sequence, one lookup per passage), by Che's
    approximation (Che, Tung and Wang, IEEE JSAC 2002; Fricker, Robert and Roberts, ITC
    2012): the characteristic time T solves sum_i size_i (1 - exp(-p_i T)) = capacity,
    and the hit rate is sum_i p_i (1 - exp(-p_i T)), p_i the passage's share of lookups.

    That is what Ray's router gets at best: it sends a passage's requests to both replicas
    alike, so each memory tier sees the whole popularity distribution and keeps its head.
    The affinity router's hit rate is at most 1, so ``1 / estimate`` bounds the hit-rate
    ratio the benchmark can show on its workload (cold misses aside)."""
    counts: dict[int, int] = {}
    for docs in passages:
        for i in docs:
            counts[i] = counts.get(i, 0) + 1
    total = sum(counts.values())
    if not total:
        return float("nan")
    shares = [(n / total, sizes[i]) for i, n in counts.items()]
    if sum(size for _, size in shares) <= capacity:
        return 1.0

    def held(t: float) -> float:
        return sum(size * -math.expm1(-p * t) for p, size in shares)

    lo, hi = 0.0, 1.0
    while held(hi) < capacity:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if held(mid) < capacity else (lo, mid)
    return sum(p * -math.expm1(-p * hi) for p, _ in shares)


def settings_for(model: str, memory_bytes: int, state_dir: str, recompute_misses: bool | None = None) -> dict:
    """What both phases serve with: memory tier only, a queue deep enough for the clients, quiet
    logs; ``recompute_misses`` the setting ``blend.recompute_misses`` (None: its default)."""
    blend = {} if recompute_misses is None else {"blend": {"recompute_misses": recompute_misses}}
    return {"model": model, "host": "127.0.0.1", "state_dir": state_dir, "log_level": "warning",
            "drain_timeout_s": 5.0, **blend,
            "store": {"tiers": ["memory"], "memory_bytes": memory_bytes},
            "scheduler": {"max_running": 8, "max_queued": 64, "request_deadline_s": 600}}


# ----- the run -------------------------------------------------------------------------------
def dump(path: str, phase: Phase) -> None:
    """Append ``phase``'s requests, one JSON line each (router, order, passages, outcome)."""
    with open(path, "a") as f:
        for i, (o, docs) in enumerate(zip(phase.outcomes, phase.passages)):
            f.write(json.dumps(nan_to_none({"router": phase.router, "i": i, "passages": list(docs),
                                            **dataclasses.asdict(o)})) + "\n")


def result(phases: dict[str, Phase], plan: Plan, lru_estimate: float | None = None) -> dict:
    figs = {r: p.figures(plan.warmup) for r, p in phases.items()}
    a, d = figs.get("affinity", {}), figs.get("default", {})

    def ratio(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x is not None and y and not math.isnan(x) and not math.isnan(y) else None

    return {
        "affinity_hit_rate": a.get("hit_rate"), "default_hit_rate": d.get("hit_rate"),
        "affinity_p95_ttft_s": a.get("p95_ttft_s"), "default_p95_ttft_s": d.get("p95_ttft_s"),
        "lost_requests": sum(f["lost"] for f in figs.values()),
        "hit_rate_ratio": ratio(a.get("hit_rate"), d.get("hit_rate")),
        "p95_ttft_ratio": ratio(a.get("p95_ttft_s"), d.get("p95_ttft_s")),
        "p50_ttft_ratio": ratio(a.get("p50_ttft_s"), d.get("p50_ttft_s")),
        "throughput_ratio": ratio(a.get("throughput_req_s"), d.get("throughput_req_s")),
        # Che's estimate of Ray's router's memory hit rate on this workload, and the most
        # the hit-rate ratio can be (an affinity router hitting every time)
        "default_hit_rate_lru_estimate": round(lru_estimate, 3) if lru_estimate is not None else None,
        "hit_rate_ratio_ceiling": ratio(1.0, lru_estimate),
        "phases": figs,
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 passages, 16 requests per router")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--docs", type=int, default=None, help="passages in the pool (default 32)")
    p.add_argument("--docs-per-request", type=int, default=None, help="default 2")
    p.add_argument("--requests", type=int, default=None, help="requests per router (default 400)")
    p.add_argument("--warmup", type=int, default=None, help="first requests left out of the figures (default 16)")
    p.add_argument("--seconds", type=float, default=None, help="per router, once its replicas are ready (default 300)")
    p.add_argument("--concurrency", type=int, default=None, help="closed-loop clients (default 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="answer tokens (default 16)")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of document popularity (default 0.8)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="each replica's memory tier, as a fraction of the pool's KV bytes (default 0.6)")
    p.add_argument("--routers", type=lambda s: s.split(","), default=list(ROUTERS),
                   help="comma-separated subset of default,affinity, in the order run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", default=None, help="write every request's outcome (JSON lines) to this file")
    p.add_argument("--recompute-misses", type=lambda s: {"true": True, "false": False}[s.lower()], default=None,
                   help="true|false: blend.recompute_misses on the replicas (default: the setting's default)")
    p.add_argument("--load-factor", type=float, default=None,
                   help="the affinity router's cluster.load_factor (default: the setting's default)")
    args = p.parse_args(argv)
    if not args.routers or set(args.routers) - set(ROUTERS):
        p.error(f"--routers takes a comma-separated subset of {','.join(ROUTERS)}")
    plan = Plan.quick() if args.quick else Plan()
    overrides = {"docs": args.docs, "docs_per_request": args.docs_per_request, "requests": args.requests,
                 "warmup": args.warmup, "seconds": args.seconds, "concurrency": args.concurrency,
                 "max_tokens": args.max_tokens, "zipf_s": args.zipf, "memory_fraction": args.memory_fraction}
    try:
        plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        p.error(str(exc))
    return args, plan


def start_ray() -> None:
    """A local Ray whose workers import this kvblend (the checkout the driver runs)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    src = str(Path(kvblend.__file__).resolve().parents[1])
    # logical CPUs: 2 replicas x 1 + the ingress's 0.5; each replica runs one torch thread
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": src, "RAY_USAGE_STATS_ENABLED": "0"}})


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    docs, questions = load_pool(plan.docs)
    workload = Workload(docs, questions, plan.docs_per_request, plan.zipf_s, args.seed)
    draws = [workload.draw() for _ in range(plan.requests)]
    index = {d: i for i, d in enumerate(docs)}
    bodies = [chat_body(args.model, chosen, question, plan.max_tokens) for chosen, question in draws]
    passages = [tuple(index[d] for d in chosen) for chosen, _ in draws]
    pool_bytes, sizes = pool_kv_bytes(args.model, docs)
    pool_tokens = sum(sizes)
    memory_bytes = math.ceil(pool_bytes * plan.memory_fraction)
    estimate = lru_hit_estimate(passages[plan.warmup:], sizes, pool_tokens * plan.memory_fraction)
    print(f"model {args.model}; pool {len(docs)} passages, {pool_tokens} tokens, {pool_bytes / 2**20:.0f} MiB of KV; "
          f"memory tier {memory_bytes / 2**20:.0f} MiB per replica x {REPLICAS}; {plan.docs_per_request} per request "
          f"(Zipf s={plan.zipf_s}); {plan.requests} requests x {plan.concurrency} clients per router; "
          f"{os.cpu_count()} CPUs; Che's estimate of one LRU tier's hit rate under Ray's router {estimate:.3f} "
          f"(a hit-rate ratio of at most {1 / estimate:.2f})", flush=True)
    t = time.perf_counter()
    start_ray()
    phases: dict[str, Phase] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="kvblend-cluster-bench-") as tmp:
            for router in args.routers:
                overrides = settings_for(args.model, memory_bytes, str(Path(tmp) / router), args.recompute_misses)
                phases[router] = run_phase(router, overrides, bodies, passages, plan, args.load_factor)
                print(json.dumps(nan_to_none({"phase": phases[router].figures(plan.warmup)})), flush=True)
                if args.dump:
                    dump(args.dump, phases[router])
    finally:
        import ray

        ray.shutdown()
    out = result(phases, plan, estimate)
    out.update(model=args.model, quick=args.quick, load_factor=args.load_factor,
               recompute_misses=args.recompute_misses, plan=dataclasses.asdict(plan),
               pool_tokens=pool_tokens,
               memory_bytes=memory_bytes, wall_s=round(time.perf_counter() - t, 1))
    print(json.dumps(nan_to_none(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
