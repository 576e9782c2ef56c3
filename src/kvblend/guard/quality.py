"""The quality guard: rolling shadow-check agreement per (model, tenant), and fallback.

CacheBlend is lossy by design; the guard watches how lossy it is in production and
falls back before users notice. Its interface is four calls, independent of HTTP:

    guard = QualityGuard(GuardConfig(min_f1=0.6, window=32, min_samples=8))
    routing = guard.route(model, request)   # what to serve; whether to shadow-check it
    result = engine.generate(routing.request, sampling)
    if routing.shadow:                      # off the request's path (ShadowRunner), or inline
        guard.record(shadow_check(engine, routing.request, result, routing.probe))

``route`` resolves ``method="auto"`` (blend with the request's knobs) and, while the
(model, tenant) is in fallback, replaces blended methods (auto always; blend/reuse
unless ``GuardConfig.override_explicit`` is off) by full prefill or by blend at
``fallback_ratio``; the blended request it would have served becomes the ``probe`` the
shadow check judges, so that the guard sees when blending recovers. ``record`` adds a
``ShadowResult`` to the rolling window; once ``min_samples`` results are in and the
window's mean F1, first-token agreement rate or mean KL leaves its bound, the key
switches to fallback.

A second, free signal needs no shadow check: ``observe(model, tenant, stats)`` takes
each served blend's mean selection score at its first check layer (``stats.checks``;
question selection reports there the layer-1 V deviation of the tokens it recomputed).
The first ``calibration`` of them set the key's band ``[min / band_factor, max *
band_factor]``; when more than ``max_out_of_band`` of a window of later scores fall
outside it (e.g. a corrupted chunk that passes its checksums deviates wildly), the key
falls back too. Probes report their blended prompt's score as well.

A key in fallback switches back when a fresh window of probe results is within every
bound (and its scores, if banded, are in band). Each switch is logged on the
``kvblend.guard`` logger (with model and tenant) and counted in ``switches``;
``state``/``snapshot`` expose the rolling values for metrics.
``serve`` is the reference composition of these calls; ``ShadowRunner`` runs shadow
checks as jobs of small steps in a scheduler's low-priority lane (the model worker runs
them only when no request waits, between decode steps), at most ``max_pending`` at a
time (more are dropped, counted), and records their results into the guard.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections import Counter, OrderedDict, deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kvblend.blend.strategies import risk_kind
from kvblend.engine.engine import Engine
from kvblend.engine.escalation import top_quantile
from kvblend.engine.request import Request, RequestStats, Result
from kvblend.engine.scheduler import Scheduler
from kvblend.generation import SamplingParams
from kvblend.generation.chunked import InPlace
from kvblend.guard.shadow import DEFAULT_CHUNK_TOKENS, ShadowResult, first_score, shadow_check, shadow_steps

log = logging.getLogger("kvblend.guard")
GUARDED = ("auto", "blend", "reuse")


@dataclass(frozen=True)
class GuardConfig:
    """When to shadow-check, how to judge the window, and what to fall back to.

    A bound set to None is not checked. ``fallback_ratio`` None means full prefill.
    """

    shadow_fraction: float = 0.05  # of blended requests, while blending is trusted
    probe_fraction: float = 0.5  # of guarded requests while in fallback (to see recovery)
    window: int = 32
    min_samples: int = 8
    min_f1: float | None = 0.5
    min_first_token: float | None = None
    max_kl: float | None = None
    fallback_ratio: float | None = None
    calibration: int = 0  # served blends whose selection scores set the band (0: no band)
    band_factor: float = 4.0
    max_out_of_band: float = 0.5  # share of the score window outside the band that fails
    override_explicit: bool = True  # also fall back for explicit blend/reuse requests
    # a served blend whose risk (RequestStats.risk) is at least this quantile of its key's last
    # ``window`` risks (once ``min_samples`` are in) is shadow-checked whatever the draw, ahead
    # of the drawn ones (None: risk is not used); a quantile, not a level, so it is the same on every model
    risk_quantile: float | None = 0.9
    max_keys: int = 4096  # (model, tenant) pairs tracked; the least recently used go first
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("shadow_fraction", "probe_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError("min_samples must be within [1, window]")
        if self.max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        for name in ("min_f1", "min_first_token", "fallback_ratio"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1] or None")
        if self.max_kl is not None and self.max_kl < 0:
            raise ValueError("max_kl must be >= 0 or None")
        if self.risk_quantile is not None and not 0.0 <= self.risk_quantile <= 1.0:
            raise ValueError("risk_quantile must be within [0, 1] or None")
        if self.calibration < 0 or self.band_factor < 1 or not 0 <= self.max_out_of_band < 1:
            raise ValueError("calibration must be >= 0, band_factor >= 1, max_out_of_band within [0, 1)")


class GuardState(NamedTuple):
    """One (model, tenant): fallback or not, and its rolling window's means."""

    fallback: bool
    samples: int
    answer_f1: float | None
    first_token: float | None
    kl: float | None
    switches: int
    band: tuple[float, float] | None = None  # calibrated selection-score band
    out_of_band: float | None = None  # share of the score window outside it


class Routing(NamedTuple):
    """What ``route`` decided for one request."""

    request: Request  # to serve
    probe: Request | None  # in fallback: the blended request the shadow check judges
    shadow: bool  # whether to shadow-check this request
    fallback: str | None  # "guard" when the guard changed the method or ratio


@dataclass
class _Track:
    results: deque[ShadowResult]
    scores: deque[float]
    # served blends' RequestStats.risk, the last ``window`` of each kind (``strategies.risk_kind``)
    risks: dict[str, deque[float]] = field(default_factory=dict)
    calibration: list[float] = field(default_factory=list)
    band: tuple[float, float] | None = None
    fallback: bool = False
    switches: int = 0

    def out_of_band(self) -> float | None:
        if self.band is None or not self.scores:
            return None
        lo, hi = self.band
        return sum(not lo <= s <= hi for s in self.scores) / len(self.scores)


@dataclass
class QualityGuard:
    """Rolling shadow-check agreement and fallback state per (model, tenant). Thread-safe."""

    config: GuardConfig = field(default_factory=GuardConfig)
    switches: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (model, tenant, kind) -> n

    def __post_init__(self) -> None:
        self._tracks: OrderedDict[tuple[str, str], _Track] = OrderedDict()
        self._lock = threading.Lock()
        self._rng = random.Random(self.config.seed)

    def _track(self, model: str, tenant: str) -> _Track:
        key = (model, tenant)
        track = self._tracks.get(key)
        if track is None:
            w = self.config.window
            track = self._tracks[key] = _Track(deque(maxlen=w), deque(maxlen=w))
            while len(self._tracks) > self.config.max_keys:
                self._tracks.popitem(last=False)
        self._tracks.move_to_end(key)
        return track

    def route(self, model: str, request: Request) -> Routing:
        """Resolve ``auto`` and apply the key's fallback; decide on a shadow check."""
        if request.method not in GUARDED:
            return Routing(request, None, False, None)
        blended = dataclasses.replace(request, method="blend") if request.method == "auto" else request
        cfg = self.config
        with self._lock:
            falling_back = self._track(model, request.tenant).fallback
            if not falling_back or not (request.method == "auto" or cfg.override_explicit):
                return Routing(blended, None, self._rng.random() < cfg.shadow_fraction, None)
            shadow = self._rng.random() < cfg.probe_fraction
        return Routing(self._fallback(blended), blended, shadow, "guard")

    def risky(self, model: str, tenant: str, stats: RequestStats | None) -> bool:
        """Whether a served request's own risk (``RequestStats.risk``) asks for a shadow check:
        it is at least the ``risk_quantile`` of the key's recent risks of the same kind
        (``observe`` adds them; False before ``min_samples`` are in)."""
        q = self.config.risk_quantile
        risk = None if stats is None else getattr(stats, "risk", None)
        if q is None or risk is None:
            return False
        with self._lock:
            recent = tuple(self._track(model, tenant).risks.get(risk_kind(getattr(stats, "strategy", None)), ()))
        bar = top_quantile(recent, q, self.config.min_samples)
        return bar is not None and risk >= bar

    def shadow_after(self, model: str, routing: Routing, stats: RequestStats | None) -> bool:
        """Whether to shadow-check a served request: the route's draw, or its risk (``risky``)."""
        return routing.shadow or self.risky(model, routing.request.tenant, stats)

    def _fallback(self, blended: Request) -> Request:
        ratio = self.config.fallback_ratio
        if ratio is None:
            return dataclasses.replace(blended, method="full")
        b = blended.blend
        raised = dataclasses.replace(b, ratio=max(b.ratio, ratio),
                                     schedule=None if b.schedule is None else tuple(max(r, ratio) for r in b.schedule))
        return dataclasses.replace(blended, method="blend", blend=raised)

    def record(self, result: ShadowResult) -> GuardState:
        """Add one shadow-check result; switch the key's state if its windows say so."""
        with self._lock:
            track = self._track(result.model, result.tenant)
            track.results.append(result)
            log.info("shadow check for model %s tenant %s (%s): f1 %.3f, first token %s, kl %.4f over %d tokens",
                     result.model, result.tenant, result.method, result.answer_f1,
                     "agrees" if result.first_token_agree else "differs", result.kl, result.tokens,
                     extra={"model": result.model, "tenant": result.tenant})
            if result.score is not None and track.band is not None and track.fallback:
                track.scores.append(result.score)  # a probe's; served blends' come through observe
            return self._judge(result.model, result.tenant, track)

    def observe(self, model: str, tenant: str, stats: RequestStats) -> GuardState:
        """Take a served blend's first-check-layer selection score: calibrate, or judge."""
        with self._lock:
            track = self._track(model, tenant)
            if getattr(stats, "risk", None) is not None:
                kind = risk_kind(getattr(stats, "strategy", None))
                track.risks.setdefault(kind, deque(maxlen=self.config.window)).append(stats.risk)
            score = first_score(stats)
            if score is None or self.config.calibration == 0:
                return self._state(track)
            if track.band is None:
                track.calibration.append(score)
                if len(track.calibration) >= self.config.calibration:
                    f = self.config.band_factor
                    track.band = (min(track.calibration) / f, max(track.calibration) * f)
                    log.info("selection-score band for model %s tenant %s: [%.4g, %.4g]", model, tenant, *track.band)
                return self._state(track)
            track.scores.append(score)
            return self._judge(model, tenant, track)

    def _judge(self, model: str, tenant: str, track: _Track) -> GuardState:
        quality, band = self._quality_failing(track), self._band_failing(track)
        if track.fallback:
            switch = quality is False and band is not True
        else:
            switch = quality is True or band is True
        if switch:
            self._switch(model, tenant, track)
        return self._state(track)

    def _quality_failing(self, track: _Track) -> bool | None:
        """None until ``min_samples`` shadow results are in."""
        if len(track.results) < self.config.min_samples:
            return None
        f1, first, kl = _means(track.results)
        cfg = self.config
        return ((cfg.min_f1 is not None and f1 < cfg.min_f1)
                or (cfg.min_first_token is not None and first < cfg.min_first_token)
                or (cfg.max_kl is not None and kl > cfg.max_kl))

    def _band_failing(self, track: _Track) -> bool | None:
        """None without a band or before ``min_samples`` scores."""
        share = track.out_of_band()
        if share is None or len(track.scores) < self.config.min_samples:
            return None
        return share > self.config.max_out_of_band

    def _switch(self, model: str, tenant: str, track: _Track) -> None:
        f1, first, kl = _means(track.results) if track.results else (float("nan"),) * 3
        share = track.out_of_band()
        track.fallback = not track.fallback
        track.switches += 1
        kind = "fallback" if track.fallback else "recover"
        self.switches[(model, tenant, kind)] += 1
        to = ("full prefill" if self.config.fallback_ratio is None else f"ratio {self.config.fallback_ratio}")
        message = (f"blending for model {model} tenant {tenant}: "
                   + (f"falling back to {to}" if track.fallback else "recovered, blending again")
                   + f" (over {len(track.results)} shadow checks: f1 {f1:.3f}, first-token {first:.3f}, kl {kl:.4f}"
                   + ("" if share is None else f"; {share:.0%} of {len(track.scores)} selection scores out of band")
                   + ")")
        (log.warning if track.fallback else log.info)(message, extra={"model": model, "tenant": tenant,
                                                                      "guard_switch": kind})
        track.results.clear()  # the next verdict rests on fresh evidence
        track.scores.clear()

    def _state(self, track: _Track) -> GuardState:
        f1, first, kl = _means(track.results) if track.results else (None, None, None)
        return GuardState(track.fallback, len(track.results), f1, first, kl, track.switches, track.band,
                          track.out_of_band())

    def state(self, model: str, tenant: str) -> GuardState:
        with self._lock:
            return self._state(self._track(model, tenant))

    def snapshot(self) -> dict[tuple[str, str], GuardState]:
        """Every tracked key's state, e.g. for metrics."""
        with self._lock:
            return {key: self._state(track) for key, track in self._tracks.items()}


def _means(results: deque[ShadowResult]) -> tuple[float, float, float]:
    n = len(results)
    return (sum(r.answer_f1 for r in results) / n, sum(r.first_token_agree for r in results) / n,
            sum(r.kl for r in results) / n)


StartCheck = Callable[[Request, Result, "Request | None"], "Future | None"]


def paced_slice(scheduler: Scheduler, chunk_tokens: int) -> int | InPlace:
    """A shadow check's next slice: at most ``chunk_tokens``, and no more than the
    scheduler's pace allows while streams decode (a check is background work: it must not
    stall them longer than a prefill may)."""
    paced = scheduler.slice_tokens(None)
    if isinstance(paced, InPlace):
        return InPlace(min(paced.tokens, chunk_tokens))
    return chunk_tokens if paced is None else min(paced, chunk_tokens)


def start_check(scheduler: Scheduler, request: Request, served: Result, probe: Request | None,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Future | None:
    """Queue the shadow check of a served request as a background job of ``scheduler``
    (``shadow_steps``, each slice ``paced_slice``); its Future, or None when the lane
    refuses it (full, draining)."""
    steps = shadow_steps(scheduler.engine, request, served, probe, lambda: paced_slice(scheduler, chunk_tokens))
    return scheduler.submit_background(steps, name=f"shadow check (tenant {request.tenant})")


class ShadowRunner:
    """Shadow checks as low-priority jobs of ``scheduler`` (``Scheduler.submit_background``),
    recorded into a guard; never blocks a caller.

    At most ``max_pending`` checks are queued or running, and at most half of them (at
    least one) drawn at random: the rest of the room is kept for ``risky`` checks (a served
    blend whose risk is in the top of its key's recent ones: ``GuardConfig.risk_quantile``), so under load the riskier
    requests are checked first. More, or any the scheduler's lane
    refuses (full, draining), are dropped and counted in ``dropped``, as are checks the
    scheduler drops on drain. A failing check is counted in ``failed`` and logged (by the
    scheduler), never raised to the caller. ``chunk_tokens`` bounds each step's prefill, and
    while streams decode the scheduler's pace bounds it too (``slice_size``).
    The Future ``submit`` returns resolves to the ``ShadowResult`` (None when the check
    failed) or is cancelled (dropped), on the thread that ends the check (the scheduler's
    worker here). ``start`` runs a check elsewhere (a model replica, ``cluster.remote``):
    ``start(request, served, probe)`` returns a Future of the ``ShadowResult`` that fails
    when the check fails and is cancelled when it was dropped, or None when it is refused
    now; by default it is ``start_check`` on ``scheduler``."""

    def __init__(self, guard: QualityGuard, scheduler: Scheduler, max_pending: int = 8,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, start: StartCheck | None = None) -> None:
        if max_pending < 1 or chunk_tokens < 1:
            raise ValueError(f"max_pending and chunk_tokens must be >= 1, got {max_pending}, {chunk_tokens}")
        self.guard = guard
        self.scheduler = scheduler
        self.max_pending = max_pending
        self.chunk_tokens = chunk_tokens
        self._start = start if start is not None else self._start_here
        self.dropped = 0
        self.failed = 0
        self.ok = 0
        self._pending = 0
        self._lock = threading.Lock()

    def slice_size(self) -> int | InPlace:
        """A check's next slice here (``paced_slice`` on this runner's scheduler)."""
        return paced_slice(self.scheduler, self.chunk_tokens)

    def _start_here(self, request: Request, served: Result, probe: Request | None) -> Future | None:
        return start_check(self.scheduler, request, served, probe, self.chunk_tokens)

    @property
    def drawn_limit(self) -> int:
        """Pending checks a drawn (not risky) check may join: half of ``max_pending``, at least 1."""
        return max(1, self.max_pending // 2)

    def submit(self, request: Request, served: Result, probe: Request | None, risky: bool = False) -> Future | None:
        """Queue the shadow check of a served request; None (counted) when it is dropped now.
        ``risky``: its risk asked for the check, which may then use all of ``max_pending``."""
        with self._lock:
            if self._pending >= (self.max_pending if risky else self.drawn_limit):
                self.dropped += 1
                return None
            self._pending += 1
        try:
            job = self._start(request, served, probe)
        except Exception:  # noqa: BLE001 - a check must never break serving
            log.exception("starting a shadow check failed (tenant %s)", request.tenant)
            with self._lock:
                self._pending -= 1
                self.failed += 1
            failed: Future = Future()
            failed.set_result(None)  # as a check that failed: counted so, never raised
            return failed
        if job is None:
            with self._lock:
                self._pending -= 1
                self.dropped += 1
            return None
        out: Future = Future()
        job.add_done_callback(lambda done: self._done(done, out))
        return out

    def _done(self, job: Future, out: Future) -> None:
        """On the worker thread: count the job's outcome, record its result."""
        result: ShadowResult | None = None
        try:
            result = job.result()
        except CancelledError:
            outcome = "dropped"
        except Exception:  # noqa: BLE001 - logged by the scheduler; a check must never break serving
            outcome = "failed"
        else:
            try:
                self.guard.record(result)
                outcome = "ok"
            except Exception:  # noqa: BLE001 - as above
                log.exception("recording a shadow check failed (tenant %s)", result.tenant)
                outcome, result = "failed", None
        with self._lock:
            self._pending -= 1
            setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome == "dropped":
            out.cancel()
        else:
            out.set_result(result)


def serve(engine: Engine, guard: QualityGuard, request: Request, sampling: SamplingParams | None = None,
          runner: ShadowRunner | None = None) -> Result:
    """One request under the guard: route, generate, then shadow-check. With a ``runner``
    the request is served by its scheduler (whose worker owns the model) and the check
    queued there at low priority; without one, generated here and checked inline after
    the answer is complete."""
    routing = guard.route(engine.loaded.name, request)
    if runner is not None:
        result = runner.scheduler.submit(routing.request, sampling or SamplingParams()).result()
    else:
        result = engine.generate(routing.request, sampling)
    guard.observe(engine.loaded.name, request.tenant, result.stats)
    if routing.fallback is not None:
        result = result._replace(stats=result.stats._replace(fallback=routing.fallback))
    if guard.shadow_after(engine.loaded.name, routing, result.stats):
        if runner is not None:
            runner.submit(routing.request, result, routing.probe,
                          guard.risky(engine.loaded.name, request.tenant, result.stats))
        else:
            guard.record(shadow_check(engine, routing.request, result, routing.probe))
    return result
