"""Live RAG traffic against a real `kvblend serve` from a cold store: blend, full and prefix side by side.

    .venv/bin/python benchmarks/traffic.py [--minutes 2] [--clients 3] [--replicas 0,2]
        [--methods blend,full,prefix] [--questions 30] [--zipf 1.0] [--passages 2]
        [--order shuffled] [--documents-share 0.3] [--slo-ttft-s 2.0] [--max-tokens 16]
        [--data ../shared/data/musique_dev.json] [--seed 0] [--bare-home]

What a new user sees: for each deployment (``--replicas``: 0 is one process, N is
``kvblend serve --replicas N``) and each method (``--methods``; ``prefix`` is automatic
prefix caching alone, what vLLM gives), a fresh `kvblend serve` subprocess on a free
loopback port, with a fresh ``KVBLEND_HOME`` (so an empty disk tier, registry and memory)
and the method as the server's setting ``blend.method``: the requests are the same plain
OpenAI requests for every method. Anything else the servers read comes from their
defaults, or from ``KVBLEND_*`` variables set around this command (e.g.
``KVBLEND_CLUSTER__REPLICA_CPUS=0.5``, ``KVBLEND_DOCUMENTS__DISCOVER=true``; a
``KVBLEND_BLEND__METHOD`` would override the method: don't).

The fresh home holds only the model's one-off results, taken from the caller's home
(``$KVBLEND_HOME`` or ``~/.cache/kvblend``): the converted weights (``models``, linked),
and the self-check, calibration and profile verdicts, copied and carried from one
server to the next, so only the first server of a run pays for checks missing there.
``--bare-home`` seeds nothing (a first user's first start; ``start_s`` shows its cost).
A server that exits or is not healthy within ``--start-timeout-s`` is reported with the
end of its log (``failed_starts``), not waited for; the deployment's other methods are
then skipped, as they would fail the same way. Each server is stopped (SIGTERM, then
SIGKILL of its process group) after its traffic, on an error, Ctrl-C or SIGTERM.

The traffic, one sequence for every server (``--seed``). The corpus: the first
``--questions`` MuSiQue questions, each with its first ``--passages`` retrieved
passages (the CacheBlend evaluation's ``"{title}\\n\\n{text}\\n\\n"``; the retriever's top
ones, which hold the supporting paragraphs, then distractors). Each request asks a
question drawn by Zipf popularity (rank^-s, ``--zipf``, rank = file order) and pastes its
passages into the user message as a RAG framework does (``Context:``, the passages,
then the CacheBlend query), after the MuSiQue system instruction; ``--documents-share``
of the requests send the passages in the ``documents`` field instead (the user message
then holds the query alone). ``--order shuffled`` (default) pastes a question's passages
in an order drawn per request: a popular question asked in other words brings back the
same passages ranked differently, so an exact prefix reaches only up to the first
passage that moved; ``--order retrieved`` repeats each question's prompt exactly
(automatic prefix caching's best case). ``--clients`` closed-loop clients take the
requests in sequence order for ``--minutes`` (requests not started by then are not
sent; the ones in flight finish, each within ``--request-timeout-s``), so every server
gets a prefix of the same sequence, at the same concurrency. Answers are
``--max-tokens`` greedy tokens with EOS ignored (the same decode for every method).

Measured by the client on each streamed request: TTFT (sent -> first token), and from the
final usage chunk ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``. Per
minute of sending (``--bin-s``): requests sent, the share of prompt tokens served from
cache, p50/p95 TTFT of the ok requests. Over the run: p50/p95 TTFT, goodput (requests
that ended ok with TTFT <= ``--slo-ttft-s``, per second of the run's wall time: first
send to last end), lost requests (anything but ok: HTTP errors and 429s, in-stream
errors, broken streams, timeouts), and after the warm-up (the first ``--warmup-frac`` of
the sending time) the cached share beside ``repeat_share_after_warmup``: the share of
prompt tokens in requests whose question was asked before in the run: about what a
cache holding every passage seen before could serve, give or take the system prompt
every request shares and the few passages two questions share (an exact-prefix cache
serves less of it when the passages come in another order). ``methods_seen`` counts the ``kvblend.method`` each answer
reports.

Ends with one JSON line: ``cached_share_after_warmup`` (blend), ``blend_p95_ttft_over_prefix``,
``blend_p95_ttft_over_full``, ``goodput_blend_over_prefix``, ``goodput_blend_over_full``
(of the first deployment in ``--replicas`` that ran blend; each deployment's in
``by_deployment``; a ratio is null where a figure is missing or its divisor is 0),
``lost_requests`` (every server), ``failed_starts``, each server's figures
(``configs``), the parameters and ``host_steal_share``. Timings on a shared host drift:
read the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (STREAM_OPTIONS, Flight, HostSteal, ServerStartError, nan_to_none, pct,  # noqa: E402
                   running_server, stream_request)

from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, inline_context, load_musique, musique_query  # noqa: E402
from kvblend.models.gguf import cache_home  # noqa: E402
from kvblend.models.registry import DEFAULT_MODEL  # noqa: E402

METHODS = ("blend", "full", "prefix")
ORDERS = ("shuffled", "retrieved")
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"
# what a fresh home may hold: the model's one-off results, never its store (kv, rag, server)
HOME_LINKED = ("models",)
HOME_COPIED = ("gguf-digests.json", "selfcheck", "calibration", "profiles")


# ----- the traffic (pure) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """``questions[i]`` and its retrieved ``passages[i]`` (formatted, in retrieval order)."""

    questions: tuple[str, ...]
    passages: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if not self.questions or len(self.questions) != len(self.passages) or not all(self.passages):
            raise ValueError("a corpus needs questions, each with at least one passage")


class Draw(NamedTuple):
    """One request of the sequence: which question, its passages' order, which field carries them."""

    question: int
    order: tuple[int, ...]
    documents_field: bool


def load_corpus(path: Path, questions: int, passages: int) -> Corpus:
    """The first ``questions`` examples of a MuSiQue file, ``passages`` passages each."""
    examples = load_musique(path, n_docs=passages, limit=questions)
    return Corpus(tuple(ex.question for ex in examples), tuple(ex.documents for ex in examples))


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 0..n-1: rank^-s (rank counted from 1)."""
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def draw_sequence(n_questions: int, per_question: int, count: int, zipf_s: float, documents_share: float,
                  order: str, seed: int) -> list[Draw]:
    """``count`` requests. Questions, orders and fields come from three generators seeded
    apart, so that changing the share or the order leaves the questions as they were."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    rq, ro, rd = (random.Random(f"traffic:{seed}:{part}") for part in ("questions", "order", "field"))
    qs = rq.choices(range(n_questions), zipf_weights(n_questions, zipf_s), k=count)
    identity = tuple(range(per_question))
    return [Draw(q, tuple(ro.sample(identity, per_question)) if order == "shuffled" else identity,
                 rd.random() < documents_share) for q in qs]


def chat_body(model: str, corpus: Corpus, draw: Draw, max_tokens: int) -> dict:
    """A plain streamed chat request (the method is the server's setting): the passages
    pasted into the user message, or sent in the ``documents`` field."""
    passages = [corpus.passages[draw.question][i] for i in draw.order]
    query = musique_query(corpus.questions[draw.question])
    user, extra = (query, {"documents": passages}) if draw.documents_field else (inline_context(passages, query), {})
    return {"model": model, "messages": [{"role": "system", "content": MUSIQUE_INSTRUCTION},
                                         {"role": "user", "content": user}], **extra,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": STREAM_OPTIONS}


# ----- the figures (pure) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """How one request went: ``sent_s`` from the run's start; ``status`` as
    `serve.Sample`'s ("ok", "rejected", "error", "lost"); ``repeat``: its question was
    asked before in the run."""

    sent_s: float
    status: str
    ttft_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    repeat: bool = False
    method: str | None = None
    detail: str = ""


def cached_share(records: list[Record]) -> float:
    """Prompt tokens served from cache over all prompt tokens, of the ok requests (NaN: none)."""
    ok = [r for r in records if r.status == "ok"]
    total = sum(r.prompt_tokens for r in ok)
    return round(sum(r.cached_tokens for r in ok) / total, 4) if total else math.nan


def repeat_share(records: list[Record]) -> float:
    """Prompt tokens of ok requests whose question was asked before, over all of theirs."""
    ok = [r for r in records if r.status == "ok"]
    total = sum(r.prompt_tokens for r in ok)
    return round(sum(r.prompt_tokens for r in ok if r.repeat) / total, 4) if total else math.nan


def ttfts(records: list[Record]) -> list[float]:
    return [r.ttft_s for r in records if r.status == "ok"]


def goodput(records: list[Record], slo_ttft_s: float, wall_s: float) -> float:
    """Requests per second that ended ok with TTFT <= the SLO."""
    good = sum(r.status == "ok" and r.ttft_s <= slo_ttft_s for r in records)
    return round(good / wall_s, 4) if wall_s > 0 else math.nan


def bins(records: list[Record], bin_s: float) -> list[dict]:
    """Per ``bin_s`` of sending (a request counts in the bin it was sent in): requests sent,
    ok, cached share, p50/p95 TTFT; every bin up to the last request's."""
    if not records:
        return []
    last = int(max(r.sent_s for r in records) // bin_s)
    out = []
    for b in range(last + 1):
        rs = [r for r in records if int(r.sent_s // bin_s) == b]
        out.append({"bin": b + 1, "sent": len(rs), "ok": sum(r.status == "ok" for r in rs),
                    "cached_share": cached_share(rs), "ttft_p50_s": pct(ttfts(rs), 50),
                    "ttft_p95_s": pct(ttfts(rs), 95)})
    return out


def figures(records: list[Record], wall_s: float, slo_ttft_s: float, warmup_s: float, bin_s: float) -> dict:
    """One server's figures over its run, after its warm-up, and per bin."""
    after = [r for r in records if r.sent_s >= warmup_s]
    statuses = Counter(r.status for r in records)
    return {
        "sent": len(records), "ok": statuses["ok"], "lost": len(records) - statuses["ok"],
        "statuses": dict(statuses), "wall_s": round(wall_s, 2),
        "cached_share": cached_share(records), "cached_share_after_warmup": cached_share(after),
        "repeat_share_after_warmup": repeat_share(after), "measured_after_warmup": len(after),
        "ttft_p50_s": pct(ttfts(records), 50), "ttft_p95_s": pct(ttfts(records), 95),
        "ttft_p95_after_warmup_s": pct(ttfts(after), 95),
        "goodput_req_s": goodput(records, slo_ttft_s, wall_s),
        "throughput_req_s": round(statuses["ok"] / wall_s, 4) if wall_s > 0 else math.nan,
        "methods_seen": dict(Counter(r.method for r in records if r.status == "ok")),
        "bins": bins(records, bin_s),
        "details": sorted({r.detail for r in records if r.status != "ok"})[:5],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing (None or NaN) or b is 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return round(a / b, 3)


def headline(by_method: dict[str, dict]) -> dict:
    """One deployment's comparison, from its methods' ``figures``."""
    b, p, f = (by_method.get(m, {}) for m in ("blend", "prefix", "full"))
    return {"cached_share_after_warmup": b.get("cached_share_after_warmup"),
            "blend_p95_ttft_over_prefix": ratio(b.get("ttft_p95_s"), p.get("ttft_p95_s")),
            "blend_p95_ttft_over_full": ratio(b.get("ttft_p95_s"), f.get("ttft_p95_s")),
            "goodput_blend_over_prefix": ratio(b.get("goodput_req_s"), p.get("goodput_req_s")),
            "goodput_blend_over_full": ratio(b.get("goodput_req_s"), f.get("goodput_req_s")),
            "lost_requests": sum(x["lost"] for x in by_method.values())}


def mark_repeats(questions: list[int]) -> list[bool]:
    """For each position, whether its question came earlier in the list."""
    seen: set[int] = set()
    out = []
    for q in questions:
        out.append(q in seen)
        seen.add(q)
    return out


# ----- one server's run ------------------------------------------------------------------------
@dataclass
class ConfigRun:
    """One server (deployment x method): its records, or why it did not start."""

    deployment: str
    method: str
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    start_s: float = math.nan
    start_error: str | None = None


async def drive(url: str, bodies: list[dict], questions: list[int], clients: int, seconds: float,
                timeout_s: float) -> tuple[list[Record], float]:
    """Send ``bodies`` in order from ``clients`` closed-loop clients until all are sent,
    ``seconds`` passed, or the server refused a connection (it is gone: the clients stop
    rather than count every request left as lost); wait for those in flight. Returns the
    records of the requests sent (a prefix of the sequence) and the wall time, first send
    to last end."""
    records: list[Record | None] = [None] * len(bodies)
    repeats = mark_repeats(questions)
    queue = iter(range(len(bodies)))
    start, gone = time.perf_counter(), asyncio.Event()
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def client_loop() -> None:
            for i in queue:
                if time.perf_counter() - start >= seconds or gone.is_set():
                    return
                flight = Flight(time.perf_counter())
                s = await stream_request(client, bodies[i], timeout_s, flight)
                sent = flight.sent - start
                records[i] = Record(sent, s.status, s.ttft_s, s.prompt_tokens, s.cached_tokens, repeats[i],
                                    s.kvblend.get("method"), s.detail)
                if s.detail.startswith("ConnectError"):
                    print(f"the server refused a connection: no more requests to it ({s.detail})", flush=True)
                    gone.set()

        await asyncio.gather(*(client_loop() for _ in range(clients)))
    wall = time.perf_counter() - start
    # clients take requests in order and stop together at the deadline: the sent ones are a prefix
    return list(itertools.takewhile(lambda r: r is not None, records)), wall


def seed_home(source: Path, home: Path, carried: Path | None) -> list[str]:
    """A fresh ``home`` holding the model's one-off results only: ``source``'s converted
    weights (linked) and digests, then the check results ``carried`` from earlier servers
    of this run (None: nothing, ``--bare-home``). Returns what it holds."""
    home.mkdir(parents=True)
    if carried is None:
        return []
    for name in HOME_LINKED:
        (source / name).mkdir(parents=True, exist_ok=True)  # a conversion lands where the next one finds it
        (home / name).symlink_to((source / name).resolve(), target_is_directory=True)
    _copy_results(carried, home)
    return sorted(p.name for p in home.iterdir())


def _copy_results(src: Path, dst: Path) -> None:
    for name in HOME_COPIED:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name, dirs_exist_ok=True)
        elif (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def run_config(args: argparse.Namespace, replicas: int, method: str, bodies: list[dict], questions: list[int],
               home: Path, carried: Path | None) -> ConfigRun:
    """Start one server from a cold store, drive it, stop it; keep its check results in ``carried``."""
    run = ConfigRun(deployment_name(replicas), method)
    seeded = seed_home(cache_home(), home, carried)
    print(f"{run.deployment}/{method}: starting a server (home holds: {', '.join(seeded) or 'nothing'})", flush=True)
    config = {"blend": {"method": method}, "log_level": "warning", "drain_timeout_s": 5}
    extra = ("--replicas", str(replicas)) if replicas else ()
    t = time.perf_counter()
    try:
        with running_server(args.model, config, args.start_timeout_s, args.threads, {"KVBLEND_HOME": str(home)},
                            extra, stop_timeout_s=60.0 if replicas else 30.0) as url:
            run.start_s = time.perf_counter() - t
            print(f"{run.deployment}/{method}: healthy after {run.start_s:.1f} s; {args.clients} clients for "
                  f"{args.minutes:g} min", flush=True)
            run.records, run.wall_s = asyncio.run(drive(url, bodies, questions, args.clients, args.minutes * 60,
                                                        args.request_timeout_s))
    except ServerStartError as exc:
        run.start_error = str(exc)
        hint = (" (with --replicas, Ray may be unable to place the replicas: cluster.replica_cpus x replicas + "
                "cluster.ingress_cpus against this host's CPUs, e.g. KVBLEND_CLUSTER__REPLICA_CPUS)"
                if replicas and not exc.exited else "")
        print(f"{run.deployment}/{method}: did not start{hint}: {exc}", flush=True)
    if carried is not None:
        _copy_results(home, carried)
    return run


def deployment_name(replicas: int) -> str:
    return f"replicas{replicas}" if replicas else "one"


def print_run(run: ConfigRun, fig: dict, bin_s: float) -> None:
    name = f"{run.deployment}/{run.method}"
    for b in fig["bins"]:
        window = f"{(b['bin'] - 1) * bin_s:.0f}-{b['bin'] * bin_s:.0f} s"
        print(f"  {name:16s} {window:>11s}  sent {b['sent']:3d} ok {b['ok']:3d}  cached {b['cached_share']:.3f}  "
              f"TTFT p50/p95 {b['ttft_p50_s']:.3f}/{b['ttft_p95_s']:.3f} s", flush=True)
    print(f"  {name:16s} run: sent {fig['sent']} lost {fig['lost']}  cached {fig['cached_share']:.3f} (after warm-up "
          f"{fig['cached_share_after_warmup']:.3f} of a repeat share {fig['repeat_share_after_warmup']:.3f})  TTFT "
          f"p50/p95 {fig['ttft_p50_s']:.3f}/{fig['ttft_p95_s']:.3f} s  goodput {fig['goodput_req_s']:.3f} req/s  "
          f"methods {fig['methods_seen']}", flush=True)
    for d in fig["details"]:
        print(f"    not ok: {d}", flush=True)


# ----- the run ---------------------------------------------------------------------------------
def report(runs: list[ConfigRun], args: argparse.Namespace) -> dict:
    """The final line: the headline of the first deployment that ran blend, each
    deployment's, every server's figures, the parameters."""
    warmup_s = args.warmup_frac * args.minutes * 60
    figs = {(r.deployment, r.method): figures(r.records, r.wall_s, args.slo_ttft_s, warmup_s, args.bin_s)
            for r in runs if r.start_error is None}
    deployments = list(dict.fromkeys(d for d, _ in figs))
    by_dep = {d: headline({m: f for (dd, m), f in figs.items() if dd == d}) for d in deployments}
    first = next((d for d in deployments if (d, "blend") in figs), deployments[0] if deployments else None)
    head = dict(by_dep.get(first, headline({})))
    head["lost_requests"] = sum(f["lost"] for f in figs.values())
    return nan_to_none({
        **head, "headline_deployment": first, "slo_ttft_s": args.slo_ttft_s, "by_deployment": by_dep,
        "failed_starts": [{"deployment": r.deployment, "method": r.method, "error": (r.start_error or "")[-600:]}
                          for r in runs if r.start_error is not None],
        "configs": [{"deployment": r.deployment, "method": r.method, "start_s": round(r.start_s, 1),
                     **figs[(r.deployment, r.method)]} for r in runs if r.start_error is None],
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    })


def _csv(kind: type, choices: tuple | None = None):
    def parse(text: str) -> list:
        values = [kind(x) for x in text.split(",") if x.strip()]
        if not values or (choices and set(values) - set(choices)):
            raise argparse.ArgumentTypeError(f"a comma-separated list{' of ' + ','.join(choices) if choices else ''}")
        return values
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="MuSiQue file (default ../shared/data/musique_dev.json from the project root)")
    p.add_argument("--minutes", type=float, default=2.0, help="sending time per server (default 2)")
    p.add_argument("--clients", type=int, default=3, help="concurrent closed-loop clients (default 3)")
    p.add_argument("--replicas", type=_csv(int), default=[0, 2],
                   help="deployments, comma-separated: 0 one process, N `serve --replicas N` (default 0,2)")
    p.add_argument("--methods", type=_csv(str, METHODS), default=list(METHODS),
                   help="servers' blend.method, comma-separated, in the order run (default blend,full,prefix)")
    p.add_argument("--questions", type=int, default=30, help="questions in the corpus (default 30)")
    p.add_argument("--passages", type=int, default=2, help="passages per question (default 2: ~1,300-token prompts)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of question popularity (default 1.0)")
    p.add_argument("--order", choices=ORDERS, default="shuffled", help="passage order per request (default shuffled)")
    p.add_argument("--documents-share", type=float, default=0.3,
                   help="share of requests sending their passages in the documents field (default 0.3)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens, EOS ignored (default 16)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT a good request meets (default 2.0 s)")
    p.add_argument("--warmup-frac", type=float, default=0.5,
                   help="first share of the sending time left out of the after-warm-up figures (default 0.5)")
    p.add_argument("--bin-s", type=float, default=60.0, help="report bins, seconds of sending (default 60)")
    p.add_argument("--max-requests", type=int, default=2000, help="the sequence's length, a bound per server")
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="a request without its end by then is lost")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="a server not healthy by then failed to start")
    p.add_argument("--threads", type=int, default=None, help="the servers' torch threads (OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bare-home", action="store_true",
                   help="nothing in the fresh homes, not even the converted weights or the model's checks")
    args = p.parse_args(argv)
    sizes = (args.clients, args.questions, args.passages, args.max_tokens, args.max_requests)
    if min(sizes) < 1 or min(args.replicas) < 0:
        p.error("--clients, --questions, --passages, --max-tokens, --max-requests must be >= 1, --replicas >= 0")
    if not (args.minutes > 0 and args.slo_ttft_s > 0 and args.bin_s > 0 and args.request_timeout_s > 0
            and args.start_timeout_s > 0 and 0 <= args.documents_share <= 1 and 0 <= args.warmup_frac < 1):
        p.error("need --minutes, --slo-ttft-s, --bin-s and the timeouts > 0, --documents-share in [0, 1], "
                "--warmup-frac in [0, 1)")
    if not args.data.is_file():
        p.error(f"no MuSiQue file at {args.data} (pass --data)")
    return args


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds like Ctrl-C: every server is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    corpus = load_corpus(args.data, args.questions, args.passages)
    draws = draw_sequence(len(corpus.questions), args.passages, args.max_requests, args.zipf, args.documents_share,
                          args.order, args.seed)
    bodies = [chat_body(args.model, corpus, d, args.max_tokens) for d in draws]
    questions = [d.question for d in draws]
    print(f"model {args.model}; {len(corpus.questions)} questions x {args.passages} passages (Zipf s={args.zipf}, "
          f"order {args.order}); documents field in {args.documents_share:.0%} of requests; {args.clients} clients x "
          f"{args.minutes:g} min per server; deployments {args.replicas}; methods {args.methods}; TTFT SLO "
          f"{args.slo_ttft_s} s; {os.cpu_count()} CPUs", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    t, steal, runs, interrupted = time.perf_counter(), HostSteal(), [], False
    try:
        run_all(args, bodies, questions, runs)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: the server is stopped; the servers that finished follow", file=sys.stderr, flush=True)
    out = report(runs, args)
    out.update(interrupted=interrupted, wall_s=round(time.perf_counter() - t, 1), host_steal_share=steal.share())
    print(json.dumps(out))
    return 130 if interrupted else 1 if out["failed_starts"] else 0


def run_all(args: argparse.Namespace, bodies: list[dict], questions: list[int], runs: list[ConfigRun]) -> None:
    """Every deployment x method in turn, appending to ``runs`` as each ends."""
    with tempfile.TemporaryDirectory(prefix="kvblend-traffic-") as tmp:
        carried = None if args.bare_home else Path(tmp) / "carried"
        if carried is not None:
            carried.mkdir()
            _copy_results(cache_home(), carried)
        for replicas in args.replicas:
            for method in args.methods:
                run = run_config(args, replicas, method, bodies, questions,
                                 Path(tmp) / f"home-{deployment_name(replicas)}-{method}", carried)
                runs.append(run)
                if run.start_error is not None:
                    print(f"{run.deployment}: skipping its other methods", flush=True)
                    break
                print_run(run, figures(run.records, run.wall_s, args.slo_ttft_s,
                                       args.warmup_frac * args.minutes * 60, args.bin_s), args.bin_s)


if __name__ == "__main__":
    sys.exit(main())
