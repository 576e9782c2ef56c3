"""Sampling: greedy, seeds, top-k, top-p, validation, numerical safety."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from kvblend.errors import InvalidRequestError, NonFiniteLogitsError
from kvblend.generation import Sampler, SamplingParams, generate_ids
from kvblend.generation.sampling import MIN_TEMPERATURE, draw, filtered_probs, nucleus, scaled_logits
from kvblend.generation.threads import serial_ops
from kvblend.generation.slot import DecodeSlot
from tests.conftest import make_loaded


def test_greedy_picks_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams())(logits) == 1


def test_same_seed_same_tokens_different_seed_differs() -> None:
    model = make_loaded().model
    run = lambda seed: generate_ids(model, [1, 5, 6, 7], SamplingParams(max_tokens=24, temperature=1.5, seed=seed,  # noqa: E731
                                                                         ignore_eos=True))
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_is_greedy() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g)
        assert Sampler(SamplingParams(temperature=2.0, top_k=1, seed=1))(logits) == int(logits.argmax())


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, top_k=0, top_p=0.75)
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    probs = filtered_probs(logits, top_k=0, top_p=0.5)
    assert torch.allclose(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_k_filters_before_softmax() -> None:
    probs = filtered_probs(torch.tensor([1.0, 2.0, 3.0, 4.0]), top_k=2, top_p=1.0)
    assert probs[:2].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))


def test_eos_stops_generation() -> None:
    model = make_loaded().model
    free = generate_ids(model, [1, 5, 6], SamplingParams(max_tokens=16, ignore_eos=True))
    eos = free[3]
    stopped = generate_ids(model, [1, 5, 6], SamplingParams(max_tokens=16), eos_ids=[eos])
    assert stopped == free[: free.index(eos) + 1]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(stop=("",)), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(seed=2**64), dict(seed=-(2**63) - 1)])  # seeds: an overflow in torch, before
def test_bad_sampling_params_are_rejected(bad) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


FILTERS = [dict(), dict(top_p=0.9), dict(top_k=5), dict(top_k=5, top_p=0.5)]


@pytest.mark.parametrize("temperature", [1e-36, 1e-37, 1e-38, MIN_TEMPERATURE / 2])
@pytest.mark.parametrize("filters", FILTERS)
def test_temperatures_below_the_floor_sample_greedily(temperature, filters) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        logits = torch.randn(50, generator=g) * 30  # (V,)
        sampler = Sampler(SamplingParams(temperature=temperature, seed=1, **filters))
        assert sampler(logits) == int(logits.argmax())


EXTREME = [
    torch.tensor([3e38, -3e38, 0.0, 1e38, -1e-38]),  # float32's range, both ends
    torch.tensor([6e4, -6e4, 6.5e4, 0.0], dtype=torch.float16),  # fp16's largest finite values
    torch.tensor([1.0, 1.0 + 1e-6, 1.0 - 1e-6, -1e30]),  # near-ties beside a huge gap
]


@pytest.mark.parametrize("logits", EXTREME)
@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-3, 0.7, 2.0, 1e6])
@pytest.mark.parametrize("filters", FILTERS)
def test_finite_logits_never_make_nan_probabilities(logits, temperature, filters) -> None:
    probs = filtered_probs(scaled_logits(logits, temperature), filters.get("top_k", 0), filters.get("top_p", 1.0))
    assert torch.isfinite(probs).all() and torch.isclose(probs.sum(), torch.tensor(1.0, dtype=probs.dtype))
    token = Sampler(SamplingParams(temperature=temperature, seed=0, **filters))(logits)
    assert 0 <= token < logits.shape[0] and probs[token] > 0


def test_a_huge_gap_at_the_floor_temperature_leaves_only_the_argmax() -> None:
    logits = torch.tensor([3e38, -3e38, 0.0, 1e38])  # the old logits / T overflowed to inf, then NaN
    for seed in range(5):
        assert Sampler(SamplingParams(temperature=MIN_TEMPERATURE, seed=seed))(logits) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_raise(bad, temperature) -> None:
    logits = torch.randn(20)  # (V,)
    logits[7] = bad
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits .* token 1$"):
        Sampler(SamplingParams(temperature=temperature, seed=0))(logits)


def test_a_slot_names_the_token_whose_logits_were_not_finite() -> None:
    slot = DecodeSlot(None, SimpleNamespace(length=3), SamplingParams(max_tokens=8, ignore_eos=True), [], 100)
    assert slot.next_event(torch.randn(20)).finish_reason is None
    with pytest.raises(NonFiniteLogitsError, match="token 2$"):
        slot.next_event(torch.full((20,), float("nan")))


def test_seeded_sampling_is_reproducible_draw_by_draw() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(5))  # (V,)

    def draws(seed: int, **filters) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, **filters))
        return [sampler(logits) for _ in range(30)]

    for filters in FILTERS:
        assert draws(11, **filters) == draws(11, **filters)
    assert draws(11) != draws(12)


def test_a_draw_follows_the_weights_and_never_picks_a_weightless_token() -> None:
    g = torch.Generator().manual_seed(11)
    weights = torch.tensor([1.0, 0.0, 3.0, 6.0, 0.0], dtype=torch.float64)
    counts = torch.zeros(5)
    for _ in range(20000):
        counts[draw(None, weights, g)] += 1
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0]), atol=0.015)
    ids = torch.tensor([7, 3, 9, 1, 4])
    assert {draw(ids, weights, g) for _ in range(200)} == {7, 9, 1}  # candidates' ids, not positions


@pytest.mark.parametrize("n, p", [(50, 0.5), (5000, 0.3), (5000, 0.9), (5000, 0.999), (300000, 0.9)])
def test_the_nucleus_is_a_full_sorts_smallest_prefix(n, p) -> None:
    """Flat weights put the nucleus past the first selections of 64 and 4,096 tokens."""
    weights = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    mass = p * float(weights.sum())
    kept = nucleus(weights, mass)
    values, order = weights.sort(descending=True)
    expected = int((values.cumsum(0) - values < mass).sum())
    assert kept.shape[0] == expected
    assert set(kept.tolist()) == set(order[:expected].tolist())
    assert torch.equal(weights[kept], values[:expected])  # heaviest first


def test_greedy_takes_the_first_of_tied_maxima_and_skips_masked_tokens() -> None:
    logits = torch.tensor([1.0, 5.0, 5.0, 2.0, 9.0])
    assert Sampler(SamplingParams())(logits) == 4
    assert Sampler(SamplingParams())(logits, torch.tensor([True, True, True, True, False])) == 1


def test_serial_ops_turn_one_threads_team_to_one_and_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: dict[str, int] = {}
        inside, release = threading.Event(), threading.Event()

        def worker() -> None:
            seen["before"] = torch.get_num_threads()
            with serial_ops():
                seen["inside"] = torch.get_num_threads()
                inside.set()
                release.wait(10)
            seen["after"] = torch.get_num_threads()

        t = threading.Thread(target=worker)
        t.start()
        inside.wait(10)
        seen["main, meanwhile"] = torch.get_num_threads()
        release.set()
        t.join()
        assert seen == {"before": 2, "inside": 1, "main, meanwhile": 2, "after": 2}
    finally:
        torch.set_num_threads(before)


def test_finite_float64_logits_near_its_limit_are_not_called_non_finite() -> None:
    """Finiteness is checked by one float64 sum; finite float64 logits can sum to inf."""
    assert Sampler(SamplingParams())(torch.tensor([1e308, 1e308, 0.0], dtype=torch.float64)) == 0
    with pytest.raises(NonFiniteLogitsError):
        Sampler(SamplingParams())(torch.tensor([1e308, float("inf"), 0.0], dtype=torch.float64))


def test_greedy_under_a_mask_equals_the_masked_argmax_and_reports_masked_logits() -> None:
    """Greedy under a grammar's mask takes the raw argmax when the mask allows it (the same
    token, ties included) and masks only otherwise; ``used`` (what processed logprobs are
    of) is the masked logits either way."""
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        logits = torch.randint(-3, 4, (40,), generator=g).float()  # (V,) many ties
        allowed = torch.rand(40, generator=g) < 0.5
        allowed[int(torch.randint(0, 40, (1,), generator=g))] = True
        sampler = Sampler(SamplingParams())
        masked = logits.masked_fill(~allowed, float("-inf"))
        assert sampler(logits, allowed) == int(masked.argmax())
        assert torch.equal(sampler.used, masked)
