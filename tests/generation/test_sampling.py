"""Sampling: greedy, seeds, top-k, top-p, validation."""

from __future__ import annotations

import pytest
import torch

from kvblend.errors import InvalidRequestError
from kvblend.generation import Sampler, SamplingParams, generate_ids
from kvblend.generation.sampling import filtered_probs
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
                                 dict(stop=("",))])
def test_bad_sampling_params_are_rejected(bad) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)
