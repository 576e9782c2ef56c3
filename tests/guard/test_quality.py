"""The quality guard: shadow checks, fallback on bad agreement, recovery, method "auto",
and shadow checks that never change or delay a served answer (issue #15, points 2 and 4)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.engine.request import Result
from kvblend.engine.scheduler import UNITS_PER_TURN, Scheduler
from kvblend.errors import InvalidRequestError, NonFiniteLogitsError
from kvblend.generation import SamplingParams
from kvblend.guard import quality
from kvblend.guard.quality import GuardConfig, QualityGuard, ShadowRunner, serve
from kvblend.generation.chunked import Forward, InPlace
from kvblend.guard.shadow import ShadowResult, shadow_check, shadow_steps
from kvblend.store.keys import chunk_key
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS

QUESTIONS = ["which city is blue ?", "where is the river ?", "who works in lisbon ?", "what was green ?"]
SAMPLING = SamplingParams(max_tokens=6)


def shadow(f1: float = 1.0, agree: bool = True, kl: float = 0.0, tenant: str = "acme") -> ShadowResult:
    return ShadowResult("m", tenant, "blend", f1, agree, kl, 6)


def request(method: str = "auto", tenant: str = "acme", **blend) -> Request:
    return Request(documents=DOCS, question=QUESTIONS[0], method=method, tenant=tenant, blend=BlendConfig(**blend))


def test_config_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        GuardConfig(window=4, min_samples=5)
    with pytest.raises(ValueError, match="shadow_fraction"):
        GuardConfig(shadow_fraction=1.5)
    with pytest.raises(ValueError, match="max_kl"):
        GuardConfig(max_kl=-1.0)
    with pytest.raises(ValueError, match="band_factor"):
        GuardConfig(calibration=4, band_factor=0.5)


def test_low_agreement_switches_to_full_and_back(caplog: pytest.LogCaptureFixture) -> None:
    guard = QualityGuard(GuardConfig(shadow_fraction=0.0, probe_fraction=1.0, window=4, min_samples=3, min_f1=0.5))
    assert guard.route("m", request()).request.method == "blend"  # auto blends while trusted
    with caplog.at_level(logging.INFO, logger="kvblend.guard"):
        for _ in range(2):
            assert not guard.record(shadow(f1=0.1)).fallback  # too few samples to judge
        assert guard.record(shadow(f1=0.1)).fallback
        routing = guard.route("m", request())
        assert routing.request.method == "full" and routing.probe.method == "blend"
        assert routing.shadow and routing.fallback == "guard"
        assert guard.route("m", request(method="blend")).request.method == "full"  # explicit blend too
        assert guard.route("m", request(method="prefix")) == (request(method="prefix"), None, False, None)
        assert guard.route("m", request(tenant="globex")).request.method == "blend"  # other tenants blend on
        for f1 in (0.9, 0.2):
            assert guard.record(shadow(f1=f1)).fallback  # judged on fresh results only: too few yet
        assert not guard.record(shadow(f1=0.9)).fallback  # mean 0.67 >= 0.5: recovered
    switches = [r for r in caplog.records if hasattr(r, "guard_switch")]
    assert [r.levelname for r in switches] == ["WARNING", "INFO"]
    assert "falling back to full prefill" in switches[0].getMessage()
    assert "tenant acme" in switches[0].getMessage() and switches[0].tenant == "acme"
    assert sum("shadow check for model m tenant acme" in r.getMessage() for r in caplog.records) == 6
    assert guard.switches == {("m", "acme", "fallback"): 1, ("m", "acme", "recover"): 1}
    assert not guard.state("m", "acme").fallback and guard.route("m", request()).request.method == "blend"


def test_each_bound_can_trigger_and_fallback_can_be_a_higher_ratio() -> None:
    cfg = GuardConfig(window=2, min_samples=2, min_f1=None, max_kl=0.5, fallback_ratio=0.6, override_explicit=False)
    guard = QualityGuard(cfg)
    guard.record(shadow(kl=0.1))
    assert not guard.record(shadow(kl=0.2)).fallback
    guard.record(shadow(kl=2.0))
    assert guard.record(shadow(kl=2.0)).fallback
    routed = guard.route("m", request(check_layers=(1, 2), schedule=(0.8, 0.3))).request
    assert routed.method == "blend" and routed.blend.ratios == (0.8, 0.6)
    assert guard.route("m", request(method="blend")).request.method == "blend"  # explicit kept
    first = QualityGuard(GuardConfig(window=2, min_samples=2, min_f1=None, min_first_token=0.75))
    first.record(shadow(agree=True))
    assert first.record(shadow(agree=False)).fallback


def test_tracked_keys_are_bounded() -> None:
    guard = QualityGuard(GuardConfig(max_keys=2))
    for tenant in ("a", "b", "c"):
        guard.record(shadow(tenant=tenant))
    assert set(guard.snapshot()) == {("m", "b"), ("m", "c")}


def corrupt(eng: Engine, scale: float) -> dict:
    """Replace every stored chunk's values with noisy ones (checksums are recomputed: they
    pass); returns the good chunks to restore."""
    ctx = eng.key_context((eng.tokenizer.bos_token_id,), "default")
    good = {}
    for ids in eng.layout(Request(documents=DOCS, question=QUESTIONS[0])).docs:
        key = chunk_key(ids, ctx)
        good[key] = chunk = eng.store.get(key, ids)
        g = torch.Generator().manual_seed(len(ids))
        noisy = tuple(v + scale * torch.randn(v.shape, generator=g) for v in chunk.values)
        eng.store.put(key, dataclasses.replace(chunk, values=noisy))
    return good


@pytest.fixture(scope="module")
def shared_engine() -> Engine:
    engine = Engine(make_loaded(num_hidden_layers=4), self_check=False)
    engine.generate(Request(documents=DOCS, question=QUESTIONS[0]), SAMPLING)
    engine.flush()
    return engine


@pytest.fixture
def eng(shared_engine: Engine) -> Engine:
    """The module's engine, its documents stored, with no prompt cached: each test's
    requests blend (a prompt an earlier test sent would be served that blend whole)."""
    shared_engine.prefix_cache.clear()
    return shared_engine


def corrupt_blends(eng: Engine, scale: float) -> dict:
    """``corrupt`` the stored chunks, and forget the blends kept whole that were made from
    them before (as deleting them would): the next blends read the corrupted KV."""
    good = corrupt(eng, scale)
    eng.prefix_cache.clear()
    return good


def test_corrupted_chunks_engage_the_fallback_until_quality_returns(eng: Engine) -> None:
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, probe_fraction=1.0, window=2, min_samples=2,
                                     min_f1=None, max_kl=0.4))
    for q in QUESTIONS[:2]:
        assert serve(eng, guard, Request(documents=DOCS, question=q, method="auto"), SAMPLING).stats.method == "blend"
    assert not guard.state("tiny-llama", "default").fallback
    good = corrupt_blends(eng, 3.0)
    try:
        for q in QUESTIONS[:2]:
            serve(eng, guard, Request(documents=DOCS, question=q, method="auto"), SAMPLING)
        state = guard.state("tiny-llama", "default")
        assert state.fallback and state.switches == 1
        served = serve(eng, guard, Request(documents=DOCS, question=QUESTIONS[2], method="auto"), SAMPLING)
        full = eng.generate(Request(documents=DOCS, question=QUESTIONS[2], method="full"), SAMPLING)
        assert served.stats.method == "full" and served.stats.fallback == "guard"
        assert served.token_ids == full.token_ids  # users get full prefill's answer
    finally:
        for key, chunk in good.items():
            eng.store.put(key, chunk)
    for q in QUESTIONS[2:]:  # the probes judge blending again and find it good
        serve(eng, guard, Request(documents=DOCS, question=q, method="auto"), SAMPLING)
    state = guard.state("tiny-llama", "default")
    assert not state.fallback and state.switches == 2
    assert serve(eng, guard, Request(documents=DOCS, question=QUESTIONS[0], method="auto"), SAMPLING).stats.method \
        == "blend"


def test_shadow_checks_never_change_the_served_answer(eng: Engine) -> None:
    twin = Engine(make_loaded(num_hidden_layers=4), self_check=False)  # same weights, never shadowed
    twin.generate(Request(documents=DOCS, question=QUESTIONS[0]), SAMPLING)
    twin.flush()
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, min_samples=1, window=1, min_f1=None, max_kl=100.0))
    for q in QUESTIONS:
        req = Request(documents=DOCS, question=q, method="blend")
        served = serve(eng, guard, req, SAMPLING)
        before = served.to_dict()
        result = shadow_check(eng, req, served)
        assert served.to_dict() == before and result.tokens == len(served.token_ids)
        assert served.token_ids == twin.generate(req, SAMPLING).token_ids
    assert guard.state("tiny-llama", "default").samples == 1


def test_a_shadow_check_with_nan_logits_is_an_error_not_a_verdict(eng: Engine, monkeypatch) -> None:
    """NaN in full prefill's teacher-forced logits read as KL 0 (perfect agreement) before."""
    import kvblend.guard.shadow as shadow_mod
    real = shadow_mod._teacher_forced
    calls = []

    def nan_full(*args, **kwargs):
        logits, stats, text = yield from real(*args, **kwargs)
        calls.append(1)
        return (torch.full_like(logits, float("nan")) if len(calls) == 1 else logits), stats, text
    req = Request(documents=DOCS, question=QUESTIONS[2], method="blend")
    served = eng.generate(req, SAMPLING)
    monkeypatch.setattr(shadow_mod, "_teacher_forced", nan_full)
    with pytest.raises(NonFiniteLogitsError):
        shadow_check(eng, req, served)


def test_a_full_answer_needs_a_probe_to_be_judged(eng: Engine) -> None:
    req = Request(documents=DOCS, question=QUESTIONS[1], method="full")
    served = eng.generate(req, SAMPLING)
    with pytest.raises(InvalidRequestError, match="probe"):
        shadow_check(eng, req, served)
    judged = shadow_check(eng, req, served, probe=dataclasses.replace(req, method="blend"))
    assert judged.method == "blend" and judged.tokens == len(served.token_ids) and judged.kl >= 0


def test_auto_without_a_guard_is_blend(eng: Engine) -> None:
    stats = eng.prepare(Request(documents=DOCS, question=QUESTIONS[0], method="auto")).stats
    assert stats.method == "blend" and all(d.hit for d in stats.docs)


def test_the_runner_never_blocks_the_answer(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shadow check waiting on the model worker's lane never holds a request: the next
    request is served while the check is still unfinished (its steps keep yielding)."""
    release, started = threading.Event(), threading.Event()

    def slow(engine, req, served, probe, chunk_tokens):
        started.set()
        while not release.is_set():
            yield
        return shadow(kl=0.0, tenant=req.tenant)

    monkeypatch.setattr(quality, "shadow_steps", slow)
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, min_samples=1, window=1))
    sched = Scheduler(eng)
    sched.start()
    runner = ShadowRunner(guard, sched, max_pending=1)
    try:
        first = serve(eng, guard, request(method="blend", tenant="default"), SAMPLING, runner)
        assert first.token_ids and started.wait(30)
        second = serve(eng, guard, request(method="blend", tenant="default"), SAMPLING, runner)  # check dropped
        assert second.token_ids == first.token_ids
        assert runner.dropped == 1 and guard.state("m", "default").samples == 0 and sched.num_background == 1
        release.set()
        deadline = time.monotonic() + 30
        while runner.ok == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        sched.drain(5)
    assert runner.ok == 1 and guard.state("m", "default").samples == 1


def test_shadow_checks_on_the_worker_never_change_the_served_answer(eng: Engine) -> None:
    """Every blended request shadow-checked in the scheduler's lane, interleaved with the
    next requests: the same tokens as with shadow checks off, every check recorded."""
    want = [eng.generate(Request(documents=DOCS, question=q, method="blend"), SAMPLING).token_ids for q in QUESTIONS]
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, min_samples=1, window=8, min_f1=None, max_kl=100.0))
    sched = Scheduler(eng)
    sched.start()
    runner = ShadowRunner(guard, sched, max_pending=8, chunk_tokens=4)  # small steps: many turns interleave
    try:
        handles = [sched.submit(Request(documents=DOCS, question=q, method="blend"), SAMPLING) for q in QUESTIONS]
        results = [h.result() for h in handles]
        jobs = [runner.submit(h.request, r, None) for h, r in zip(handles, results)]
        again = [sched.submit(h.request, SAMPLING).result() for h in handles]  # served beside the checks
        judged = [j.result(60) for j in jobs]
    finally:
        sched.drain(5)
    assert [r.token_ids for r in results] == want == [r.token_ids for r in again]
    assert all(j is not None and j.tokens == len(r.token_ids) for j, r in zip(judged, results))
    assert runner.ok == len(QUESTIONS) and runner.failed == runner.dropped == 0
    assert guard.state("tiny-llama", "default").samples == len(QUESTIONS)


def test_a_shadow_checks_slices_keep_the_running_streams_pace(eng: Engine, monkeypatch) -> None:
    """A check is background work: while streams decode, its slices are no larger than the
    scheduler's pace allows (a 256-token slice beside a stream was a gap of ~12 decode
    steps on a CPU), and never larger than its own ``chunk_tokens``."""
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, min_samples=1, window=1))
    runner = ShadowRunner(guard, Scheduler(eng, prefill_chunk_tokens=1024, interleave="slices"), chunk_tokens=256)
    sched = runner.scheduler
    assert runner.slice_size() == 256  # nothing decodes
    sched._running = [object()]  # a stream decodes: the scheduler's measured pace
    sched._decode_s, sched._token_s, sched._last_slice = 0.07, 0.0035, 10_000
    assert runner.slice_size() == 40
    sched.in_place, sched._layer_s = True, 0.0002
    assert runner.slice_size() == InPlace(int(0.14 / (UNITS_PER_TURN * 0.0002)))  # under its own 256 tokens...
    sched._layer_s = 0.00001
    assert runner.slice_size() == InPlace(256)  # ... and never over
    seen = []
    monkeypatch.setattr(quality, "shadow_steps", lambda *args: seen.append(args[-1]) or iter(()))
    runner.submit(request(method="blend", tenant="default"), Result("", [], "stop", None), None)
    assert len(seen) == 1 and seen[0]() == runner.slice_size() == InPlace(256)  # the check asks before each slice


def test_shadow_steps_in_small_chunks_judge_as_one_pass(eng: Engine) -> None:
    """Chunked prefill and teacher forcing change where the check runs, not what it finds."""
    req = Request(documents=DOCS, question=QUESTIONS[2], method="blend")
    served = eng.generate(req, SAMPLING)
    whole = shadow_check(eng, req, served, chunk_tokens=4096)
    steps = shadow_steps(eng, req, served, chunk_tokens=3)
    n, reply = 0, None
    while True:  # driven as the scheduler's worker does: each Forward run and its logits sent back
        try:
            step = steps.send(reply)
            n += 1
        except StopIteration as stop:
            small = stop.value
            break
        reply = eng.model(step.ids, step.cache, step.logits_for) if isinstance(step, Forward) else None
    prompt = len(eng.layout(req))
    assert n >= -(-prompt // 3) + len(served.token_ids)  # prefill chunks, decode tokens, ...
    assert (small.answer_f1, small.first_token_agree, small.tokens) == (whole.answer_f1, whole.first_token_agree,
                                                                        whole.tokens)
    assert small.kl == pytest.approx(whole.kl, abs=1e-4) and small.score == pytest.approx(whole.score)


def test_a_failing_shadow_check_is_counted_and_the_next_request_served(eng: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(engine, req, served, probe, chunk_tokens):
        yield
        raise RuntimeError("corrupt state in the shadow check")

    monkeypatch.setattr(quality, "shadow_steps", broken)
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, min_samples=1, window=1))
    sched = Scheduler(eng)
    sched.start()
    runner = ShadowRunner(guard, sched)
    try:
        served = serve(eng, guard, request(method="blend", tenant="default"), SAMPLING, runner)
        deadline = time.monotonic() + 30
        while runner.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.failed == 1 and sched.alive
        assert serve(eng, guard, request(method="blend", tenant="default"), SAMPLING, runner).token_ids \
            == served.token_ids
        while runner.failed < 2 and time.monotonic() < deadline:  # the second check fails alone too
            time.sleep(0.01)
    finally:
        sched.drain(5)
    assert runner.failed == sched.background_stats().failed == 2 and guard.state("m", "default").samples == 0


def test_selection_scores_out_of_their_band_engage_the_fallback_without_shadow_checks(eng: Engine) -> None:
    # no shadow check at all, risk-first ones included (which blend's risk tops the window
    # depends on the ratio): the scores alone decide
    guard = QualityGuard(GuardConfig(shadow_fraction=0.0, probe_fraction=1.0, window=2, min_samples=2,
                                     min_f1=None, max_kl=0.4, calibration=3, risk_quantile=None))
    for q in QUESTIONS[:3]:
        serve(eng, guard, Request(documents=DOCS, question=q, method="auto"), SAMPLING)
    state = guard.state("tiny-llama", "default")
    assert state.band is not None and state.samples == 0 and not state.fallback
    good = corrupt_blends(eng, 3.0)
    try:
        for q in QUESTIONS[:2]:  # no shadow check runs: the scores alone say it
            assert serve(eng, guard, Request(documents=DOCS, question=q, method="auto"), SAMPLING).stats.checks
        state = guard.state("tiny-llama", "default")
        assert state.fallback and state.samples == 0 and guard.switches[("tiny-llama", "default", "fallback")] == 1
    finally:
        for key, chunk in good.items():
            eng.store.put(key, chunk)
    for q in QUESTIONS[2:]:  # probes: good agreement and in-band scores
        assert serve(eng, guard, Request(documents=DOCS, question=q, method="auto"), SAMPLING).stats.method == "full"
    state = guard.state("tiny-llama", "default")
    assert not state.fallback and state.switches == 2


def test_a_risky_blend_is_shadow_checked_whatever_the_draw(eng: Engine) -> None:
    """Risky: at least the 0.75 quantile of the key's recent risks, once min_samples are in."""
    guard = QualityGuard(GuardConfig(shadow_fraction=0.0, risk_quantile=0.75, min_samples=4, window=8))
    routing = guard.route("m", request(method="blend", tenant="default"))
    assert not routing.shadow
    stats = eng.prepare(request(method="blend", tenant="default")).stats
    for risk in (0.1, 0.2, 0.3):
        guard.observe("m", "default", stats._replace(risk=risk))
    assert not guard.shadow_after("m", routing, stats._replace(risk=5.0))  # 3 risks: not yet calibrated
    guard.observe("m", "default", stats._replace(risk=0.4))
    for risk, checked in ((0.5, True), (0.3, True), (0.25, False), (None, False)):  # 0.75 quantile of 4: 0.3
        assert guard.shadow_after("m", routing, stats._replace(risk=risk)) is checked, risk
    assert not guard.risky("m", "other", stats._replace(risk=5.0))  # another tenant has its own risks
    # a blend without the shift has the other kind of risk (moved_risk): not ranked against these
    moved = stats._replace(strategy="question+budget+sinks4")
    assert "shift" in stats.strategy and not guard.risky("m", "default", moved._replace(risk=5.0))
    for risk in (0.7, 0.8, 0.85, 0.9):
        guard.observe("m", "default", moved._replace(risk=risk))
    assert guard.risky("m", "default", moved._replace(risk=0.9)) and not guard.risky("m", "default", moved._replace(risk=0.8))
    assert guard.risky("m", "default", stats._replace(risk=0.35))  # the shift's window is unchanged by them
    off = QualityGuard(GuardConfig(shadow_fraction=0.0, risk_quantile=None, min_samples=1))
    off.observe("m", "default", stats._replace(risk=0.1))
    assert not off.shadow_after("m", routing, stats._replace(risk=5.0))
    with pytest.raises(ValueError, match="risk_quantile"):
        GuardConfig(risk_quantile=1.5)


def test_drawn_checks_leave_room_for_risky_ones(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn checks take at most half of ``max_pending``; a risky one is still queued then."""
    release = threading.Event()

    def slow(engine, req, served, probe, chunk_tokens):
        while not release.is_set():
            yield
        return shadow(tenant=req.tenant)

    monkeypatch.setattr(quality, "shadow_steps", slow)
    guard = QualityGuard(GuardConfig(min_samples=1, window=4))
    sched = Scheduler(eng)
    sched.start()
    runner = ShadowRunner(guard, sched, max_pending=2)
    try:
        served = sched.submit(request(method="blend", tenant="default"), SAMPLING).result()
        req = request(method="blend", tenant="default")
        assert runner.drawn_limit == 1
        first = runner.submit(req, served, None)
        assert first is not None and runner.submit(req, served, None) is None  # a second drawn one: dropped
        risky = runner.submit(req, served, None, risky=True)
        assert risky is not None and runner.submit(req, served, None, risky=True) is None  # max_pending reached
        release.set()
        assert first.result(30) is not None and risky.result(30) is not None
    finally:
        release.set()
        sched.drain(5)
    assert runner.ok == 2 and runner.dropped == 2


def test_a_check_that_cannot_start_is_counted_failed_and_frees_its_place(eng: Engine) -> None:
    """A check whose start raises (e.g. the hop to a replica) must not leak a pending place
    (all later checks would be dropped) nor reach the request that was served."""
    guard = QualityGuard(GuardConfig(shadow_fraction=1.0, min_samples=1, window=1))

    def broken(*_):
        raise RuntimeError("simulated start failure")

    runner = ShadowRunner(guard, Scheduler(eng), max_pending=1, start=broken)
    for _ in range(3):
        job = runner.submit(request(method="blend", tenant="default"), Result("a", [1], "stop", None), None)
        assert job is not None and job.result() is None  # resolved as a failed check
    assert (runner.failed, runner.dropped, runner._pending) == (3, 0, 0)
