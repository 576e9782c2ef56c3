"""Escalation (kvblend.engine.escalation): a blend whose risk is in the top of its tenant's
recent ones of the same kind recomputes at twice its ratio: without the shift a second
recompute, with it the whole blend again, each exactly the blend at twice the ratio."""

from __future__ import annotations

import math

import pytest
import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, PrefixCache, Request
from kvblend.engine.escalation import MIN_SAMPLES, RiskWindows, top_quantile
from kvblend.metrics import kl_divergence
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

MOVED = dict(selection="question", shift=False)  # a blend whose risk is the moved kind


def test_top_quantile_is_the_ceil_q_n_th_smallest_once_enough_are_in() -> None:
    assert top_quantile([0.3, 0.1, 0.2], 0.9, 4) is None  # too few yet
    risks = [i / 10 for i in range(10)]  # 0.0 .. 0.9
    assert top_quantile(risks, 0.9, 4) == 0.8  # the 9th smallest: 0.8 and 0.9 are its top
    assert top_quantile(risks, 1.0, 4) == 0.9 and top_quantile(risks, 0.0, 4) == 0.0


def test_risk_windows_keep_each_tenant_apart_and_forget_the_oldest() -> None:
    w = RiskWindows(window=4, min_samples=2, max_tenants=2)
    for r in (0.1, 0.2, 0.3, 0.4, 0.5):  # the window keeps the last 4
        w.add("a", r)
    assert w.threshold("a", 0.5) == 0.3 and w.threshold("a", None) is None
    assert w.threshold("b", 0.5) is None  # another tenant has none of a's
    w.add("b", 0.9)
    w.add("c", 0.9)  # a third tenant: the least recently seen (a) goes
    assert w.threshold("a", 0.5) is None
    with pytest.raises(ValueError):
        RiskWindows(window=2, min_samples=3)


def _prepare(eng: Engine, tenant: str = "t", **blend):
    req = Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                  blend=BlendConfig(**{**MOVED, **blend}), tenant=tenant)
    return eng.prepare(req)


def _engine() -> Engine:
    # no prefix cache: the warm-up's exact prompts would serve the blends below whole
    eng = Engine(make_loaded(), prefix_cache=PrefixCache(0), self_check=False, calibrate=False)
    for tenant in ("t", "calm", "fresh", "shifted"):  # each tenant's store is its own
        _prepare(eng, tenant=tenant, escalate=None, recompute_misses=True)
    eng.flush()  # every document stored (the warm-up's blends missed them all: no risk measured)
    assert all(eng.escalation.threshold(t, 0.0) is None for t in ("t", "calm", "fresh", "shifted"))
    return eng


def test_an_escalated_blend_is_the_blend_at_twice_its_ratio() -> None:
    eng = _engine()
    for _ in range(MIN_SAMPLES):
        eng.escalation.add("t", 0.0)  # any risk is now in the top of this tenant's
    plain = _prepare(eng, escalate=None, ratio=0.2)
    twice = _prepare(eng, escalate=None, ratio=0.4)
    escalated = _prepare(eng, ratio=0.2)
    assert not plain.stats.escalated and escalated.stats.escalated
    assert (plain.logits - twice.logits).abs().max().item() > 1e-3  # the test can tell the two ratios apart
    assert (escalated.logits - twice.logits).abs().max().item() <= 1e-5
    assert escalated.stats.checks[0].selected == twice.stats.checks[0].selected
    # its risk is the second recompute's (how little the answer moved from reuse's)
    reuse = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .",
                                method="reuse", tenant="t")).logits
    assert escalated.stats.risk == pytest.approx(math.exp(-kl_divergence(twice.logits, reuse)), rel=1e-4)
    # the work of the question pass and both recomputes, one more pass than the plain blend's
    extra = [e - p for e, p in zip(escalated.stats.recomputed_per_layer, plain.stats.recomputed_per_layer)]
    second = [t - q for t, q in zip(twice.stats.recomputed_per_layer, _prepare(eng, escalate=None, ratio=0.0)
                                    .stats.recomputed_per_layer)]
    assert extra == second


def test_below_its_tenants_top_a_blend_runs_once_and_other_tenants_are_not_moved() -> None:
    eng = _engine()
    plain = _prepare(eng, escalate=None, ratio=0.2)
    for _ in range(MIN_SAMPLES):
        eng.escalation.add("calm", 1.0)  # nothing below 1 is in this tenant's top
        eng.escalation.add("noisy", 0.0)
    calm = _prepare(eng, tenant="calm", ratio=0.2)
    assert not calm.stats.escalated and torch.equal(calm.logits, plain.logits)
    # a tenant with no history (or too little) never escalates, whatever another tenant's risks
    fresh = _prepare(eng, tenant="fresh", ratio=0.2)
    assert not fresh.stats.escalated and torch.equal(fresh.logits, plain.logits)


def test_the_window_records_the_risk_that_decided_per_kind() -> None:
    eng = _engine()
    for _ in range(MIN_SAMPLES):
        eng.escalation.add("t", 0.0)
    escalated = _prepare(eng, ratio=0.2).stats
    before = _prepare(eng, escalate=None, ratio=0.2).stats.risk  # the first recompute's risk
    assert escalated.escalated and escalated.risk != pytest.approx(before)
    assert eng.escalation.threshold("t", 1.0) == pytest.approx(before)  # the largest in: the deciding risk, twice
    for _ in range(MIN_SAMPLES - 1):
        eng.escalation.add("shifted", 0.0)  # each window one short of a threshold
        eng.escalation.add("shifted", 0.0, "shift")
    shifted = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                                  blend=BlendConfig(ratio=0.2), tenant="shifted")).stats
    assert eng.escalation.threshold("shifted", 0.0) is None  # the shift's risk is another kind: not added here
    assert shifted.risk is not None and not shifted.escalated  # (15 in: no bar yet)
    assert eng.escalation.threshold("shifted", 1.0, "shift") == pytest.approx(shifted.risk)  # but in its own


SHIFTED = dict(selection="question", budget=True, sinks=4, shift=True)  # the default's strategy


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_shift_blend_above_its_tenants_bar_runs_again_whole_at_twice_its_ratio(arch: str) -> None:
    # issue #44: models that keep the shift escalate too, on the shift's own risk
    eng = Engine(make_loaded(arch), prefix_cache=PrefixCache(0), self_check=False, calibrate=False)
    for tenant in ("t", "calm"):
        _prepare(eng, tenant=tenant, escalate=None, recompute_misses=True)
    eng.flush()
    plain = _prepare(eng, escalate=None, ratio=0.2, **SHIFTED)
    twice = _prepare(eng, escalate=None, ratio=0.4, **SHIFTED)
    assert plain.stats.risk is not None and (plain.logits - twice.logits).abs().max().item() > 1e-3
    for _ in range(MIN_SAMPLES):
        eng.escalation.add("t", 0.0, "shift")  # any shift risk is now in t's top
        eng.escalation.add("calm", 1.0, "shift")  # and none in calm's
        eng.escalation.add("calm", 0.0)  # (a moved risk sets no bar for the shift's)
    up = _prepare(eng, ratio=0.2, **SHIFTED)
    assert up.stats.escalated and (up.logits - twice.logits).abs().max().item() <= 1e-5
    assert up.stats.risk == pytest.approx(twice.stats.risk)  # the served blend's, as with no escalation
    assert up.stats.checks[0].selected == twice.stats.checks[0].selected
    # the first blend's work and the second's, whole
    assert up.stats.recomputed_per_layer == [p + t for p, t in zip(plain.stats.recomputed_per_layer,
                                                                    twice.stats.recomputed_per_layer)]
    assert eng.escalation.threshold("t", 1.0, "shift") == pytest.approx(plain.stats.risk)  # the risk that decided
    calm = _prepare(eng, tenant="calm", ratio=0.2, **SHIFTED)
    assert not calm.stats.escalated and torch.equal(calm.logits, plain.logits)


def test_escalate_is_a_quantile_or_none() -> None:
    from kvblend.errors import InvalidRequestError

    assert BlendConfig().escalate == 0.9 and BlendConfig(escalate=None).escalate is None
    with pytest.raises(InvalidRequestError, match="escalate"):
        BlendConfig(escalate=1.5)
