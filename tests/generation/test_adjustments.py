"""Logit bias, penalties, logprobs and forked caches: the decode rules beyond plain sampling."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from kvblend.errors import InvalidRequestError
from kvblend.generation import Sampler, SamplingParams, prefill
from kvblend.generation.sampling import adjusted_logits, token_logprobs
from kvblend.generation.slot import DecodeSlot, fork_cache
from tests.conftest import make_loaded


def test_logit_bias_adds_to_the_logits_and_can_force_or_forbid_a_token() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    assert Sampler(SamplingParams(logit_bias=((2, 100.0),)))(logits) == 2
    assert Sampler(SamplingParams(logit_bias=((1, -100.0),)))(logits) == 3
    x = adjusted_logits(logits, SamplingParams(logit_bias=((0, 1.5), (3, -0.5))), frozenset(), Counter())
    assert x.tolist() == [1.5, 5.0, 1.0, 1.5]


def test_frequency_and_presence_penalties_follow_the_output_counts() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    x = adjusted_logits(logits, params, frozenset(), Counter({1: 3, 2: 1}))
    assert x.tolist() == pytest.approx([1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0])


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0])
    x = adjusted_logits(logits, SamplingParams(repetition_penalty=2.0), frozenset({0}), Counter({1: 1}))
    assert x.tolist() == [1.0, -4.0, 2.0, -2.0]  # 0 seen in the prompt, 1 in the output


def test_a_greedy_sampler_with_a_frequency_penalty_stops_repeating() -> None:
    logits = torch.tensor([3.0, 2.0, 0.0])
    plain, penalised = Sampler(SamplingParams()), Sampler(SamplingParams(frequency_penalty=2.0))
    assert [plain(logits) for _ in range(3)] == [0, 0, 0]
    assert [penalised(logits) for _ in range(3)] == [0, 1, 0]  # 3-2=1 < 2; then 2-2=0 < 1


@pytest.mark.parametrize("bad", [
    dict(n=0), dict(n=17), dict(logprobs=21), dict(logprobs=-1), dict(presence_penalty=2.5),
    dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0), dict(repetition_penalty=float("inf")),
    dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, float("nan")),)),
])
def test_out_of_range_values_are_refused_naming_the_field(bad) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**bad)
    name = next(iter(bad))
    assert err.value.field == ("top_logprobs" if name == "logprobs" else name)


def test_logprobs_are_the_raw_log_softmax_with_the_top_alternatives_best_first() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    lp = token_logprobs(logits, 3, 2)
    ref = torch.log_softmax(logits.double(), -1)
    assert lp.logprob == pytest.approx(float(ref[3]), abs=1e-12)
    assert [t for t, _ in lp.top] == [1, 3] and lp.top[0][1] == pytest.approx(float(ref[1]), abs=1e-12)


def test_a_slot_reports_logprobs_of_the_logits_the_draw_used_or_raw_ones_when_asked() -> None:
    loaded = make_loaded()
    cache, logits = prefill(loaded.model, [1, 5, 6], 4)
    params = SamplingParams(max_tokens=4, logprobs=3, logit_bias=((7, 100.0),), presence_penalty=1.0)
    event = DecodeSlot(None, cache, params, (), 1 << 16).next_event(logits)
    assert event.token_id == 7
    biased = logits.double().reshape(-1).clone()
    biased[7] += 100.0
    used = torch.log_softmax(biased, -1)
    assert event.logprobs.logprob == pytest.approx(float(used[7]), abs=1e-9)  # ~0: the biased distribution
    assert [t for t, _ in event.logprobs.top] == torch.topk(used, 3).indices.tolist()
    raw_event = DecodeSlot(None, cache, replace(params, logprobs_mode="raw"), (), 1 << 16).next_event(logits)
    raw = torch.log_softmax(logits.double().reshape(-1), -1)
    assert raw_event.token_id == 7
    assert raw_event.logprobs.logprob == pytest.approx(float(raw[7]), abs=1e-9)  # not ~0
    assert len(raw_event.logprobs.top) == 3 and raw_event.logprobs.top[0][0] == int(raw.argmax())


def test_masked_tokens_are_never_listed_among_the_top_logprobs() -> None:
    logits = torch.tensor([0.5, float("-inf"), float("-inf"), 2.0])
    lp = token_logprobs(logits, 3, 4)
    assert [t for t, _ in lp.top] == [3, 0]
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logprobs_mode="sampled")
    assert err.value.field == "logprobs_mode"

def test_choices_are_seeded_apart_and_each_reproducible() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.5, seed=11)

    def draws(choice: int) -> list[int]:
        sampler = Sampler(params, (), choice)
        return [sampler(logits) for _ in range(30)]

    assert draws(0) == draws(0) and draws(1) == draws(1)
    assert draws(0) != draws(1)


def test_a_forked_cache_decodes_as_the_original_without_copying_or_touching_it() -> None:
    model = make_loaded().model
    cache, logits = prefill(model, [1, 5, 6, 7], 8)
    fork = fork_cache(cache, 8)
    assert fork.length == cache.length and fork.capacity >= cache.length + 8
    assert fork.keys[0].shape[1] == 8  # room for its own tokens only: the prompt is not copied
    before = [k[:, : cache.length].clone() for k in cache.keys]
    a = [model(torch.tensor([t]), fork) for t in (9, 3, 2)]
    assert cache.length == 4 and all(torch.equal(b, k[:, :4]) for b, k in zip(before, cache.keys))
    b = [model(torch.tensor([t]), cache) for t in (9, 3, 2)]
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))
    # the parent decoding on (and growing its buffers) leaves the fork's prompt as it was
    for t in range(20):
        model(torch.tensor([t % 9 + 1]), cache)
    again = model(torch.tensor([4]), fork)
    ref_cache, _ = prefill(model, [1, 5, 6, 7, 9, 3, 2], 8)
    assert torch.allclose(again, model(torch.tensor([4]), ref_cache), atol=1e-5)
    with pytest.raises(TypeError):
        fork.view(0)


