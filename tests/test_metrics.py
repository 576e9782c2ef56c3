import math

import numpy as np
import pytest
import torch

from kvblend.metrics import (
    best_f1,
    first_line,
    first_token_agree,
    kl_divergence,
    mean_nll,
    normalize_answer,
    rouge_l,
    token_f1,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The  Cat, sat!", "cat sat"),
        ("An apple a day", "apple day"),
        ("Theatre of the Absurd", "theatre of absurd"),
        ("  Exeter\tCollege.\n", "exeter college"),
        ("the a an", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_token_f1_hand_computed() -> None:
    # pred {cat, sat}, ref {cat, sat, down}: P = 2/2, R = 2/3, F1 = 0.8
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)


def test_token_f1_counts_repeated_tokens_once_per_match() -> None:
    # overlap 1, P = 1/2, R = 1/1
    assert token_f1("cat cat", "cat") == pytest.approx(2 / 3)


def test_token_f1_exact_none_and_empty() -> None:
    assert token_f1("Charles County", "charles county.") == 1.0
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("the", "a") == 1.0
    assert token_f1("the", "cat") == 0.0
    assert token_f1("cat", "") == 0.0


def test_best_f1_takes_the_best_reference() -> None:
    assert best_f1("cat sat", ["dog", "the cat sat down", "cat sat"]) == 1.0
    assert best_f1("cat", ["dog", "cat sat"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        best_f1("cat", [])


def test_first_line() -> None:
    assert first_line("\n  \n  Paris \nsecond line") == "Paris"
    assert first_line("Lisbon") == "Lisbon"
    assert first_line(" \n\t\n") == ""
    assert first_line("") == ""


def test_rouge_l_hand_worked_lcs() -> None:
    # LCS(red green blue yellow, red blue orange yellow purple) = red blue yellow = 3
    # P = 3/4, R = 3/5, F = 2 * 0.45 / 1.35 = 2/3
    assert rouge_l("red green blue yellow", "red blue orange yellow purple") == pytest.approx(2 / 3)


def test_rouge_l_is_order_sensitive_unlike_f1() -> None:
    assert rouge_l("blue red", "red blue") == pytest.approx(0.5)
    assert token_f1("blue red", "red blue") == 1.0
    assert rouge_l("The cat sat.", "cat sat") == 1.0
    assert rouge_l("", "") == 1.0
    assert rouge_l("dog", "cat") == 0.0


def test_kl_of_identical_and_shifted_logits_is_zero() -> None:
    torch.manual_seed(0)
    p = torch.randn(5, 50) * 10
    assert kl_divergence(p, p) == 0.0
    assert kl_divergence(p, p + 7.0) == pytest.approx(0.0, abs=1e-12)


def test_kl_two_class_hand_computed() -> None:
    p = torch.tensor([[0.0, 0.0]])  # (0.5, 0.5)
    q = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)  # (0.25, 0.75)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-12)
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl_divergence(q, p) == pytest.approx(reverse, rel=1e-12)


def test_kl_is_a_mean_over_positions() -> None:
    p = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    q = torch.tensor([[0.0, math.log(3.0)], [1.0, 2.0]], dtype=torch.float64)
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(4 / 3) / 2, rel=1e-12)


def test_kl_is_stable_for_large_float32_logits_and_zero_probabilities() -> None:
    p = torch.tensor([[1e4, 0.0, -float("inf")]], dtype=torch.float32)
    q = torch.tensor([[1e4, 1.0, 3.0]], dtype=torch.float32)
    value = kl_divergence(p, q)
    assert math.isfinite(value) and value >= 0.0
    from_numpy = kl_divergence(np.array([0.0, 0.0]), np.array([0.0, math.log(3.0)]))
    assert from_numpy == pytest.approx(0.5 * math.log(4 / 3))


def test_kl_with_a_nan_on_either_side_is_nan_not_agreement() -> None:
    """A broken reference (NaN logits) read as KL 0, perfect agreement, before."""
    good = torch.tensor([[1.0, 2.0, 3.0]])
    bad = torch.tensor([[float("nan"), 2.0, 3.0]])
    assert math.isnan(kl_divergence(bad, good))
    assert math.isnan(kl_divergence(good, bad))
    assert math.isnan(kl_divergence(torch.full((1, 3), float("nan")), good))


def test_kl_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        kl_divergence(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))


def test_mean_nll() -> None:
    assert mean_nll([-1.0, -2.0, -3.0]) == pytest.approx(2.0)
    assert mean_nll(torch.log(torch.tensor([0.5, 0.25]))) == pytest.approx(1.5 * math.log(2))
    with pytest.raises(ValueError):
        mean_nll([])


def test_first_token_agree() -> None:
    assert first_token_agree([5, 6], [5, 7])
    assert not first_token_agree([5], [6])
    assert first_token_agree(torch.tensor([[9, 1]]), (9,))
    assert not first_token_agree([], [])
    assert not first_token_agree([5], [])
