"""Answer-quality and fidelity metrics: the evaluation harness scores methods with them,
the guard's shadow checks and ``kvblend ask --compare`` judge served answers with them.

Text metrics follow the SQuAD evaluation script (Rajpurkar et al., 2016): answers are
normalised, split on whitespace and compared as bags of tokens (F1) or as sequences
(ROUGE-L, Lin 2004). Fidelity metrics compare a method's logits or tokens with those
of full prefill.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)

LogitsLike = torch.Tensor | np.ndarray | Sequence[Sequence[float]]


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split()


def _f_measure(overlap: int, n_pred: int, n_ref: int) -> float:
    """Harmonic mean of precision overlap/n_pred and recall overlap/n_ref.

    Two empty sides count as a perfect match, one empty side as no match.
    """
    if n_pred == 0 or n_ref == 0:
        return float(n_pred == n_ref)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_ref
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1: harmonic mean of bag-of-token precision and recall."""
    pred, ref = _tokens(prediction), _tokens(reference)
    overlap = sum((Counter(pred) & Counter(ref)).values())
    return _f_measure(overlap, len(pred), len(ref))


def best_f1(prediction: str, references: Sequence[str]) -> float:
    """Highest `token_f1` of the prediction against any of the reference answers."""
    if not references:
        raise ValueError("best_f1 needs at least one reference answer")
    return max(token_f1(prediction, ref) for ref in references)


def first_line(text: str) -> str:
    """The first non-empty line of generated text, stripped ("" if there is none)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (beta = 1) over normalised tokens.

    precision = LCS / len(prediction), recall = LCS / len(reference); unlike token F1 it
    rewards tokens only when they appear in the same order.
    """
    pred, ref = _tokens(prediction), _tokens(reference)
    return _f_measure(_lcs_length(pred, ref), len(pred), len(ref))


def _as_2d_float64(logits: LogitsLike) -> torch.Tensor:
    t = torch.as_tensor(logits).detach().to(device="cpu", dtype=torch.float64)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"logits must have shape (T, V) or (V,), got {tuple(t.shape)}")
    return t


def kl_divergence(p_logits: LogitsLike, q_logits: LogitsLike) -> float:
    """Mean over positions of KL(softmax(p) || softmax(q)), in nats.

    ``p_logits`` and ``q_logits`` have shape (T, V) (a single (V,) row is allowed); p is
    the reference (usually full prefill). Computed with log_softmax in float64;
    vocabulary entries where p is exactly zero (logit -inf) contribute nothing. A NaN on
    either side gives NaN (a broken reference must not read as perfect agreement).
    """
    p, q = _as_2d_float64(p_logits), _as_2d_float64(q_logits)
    if p.shape != q.shape:
        raise ValueError(f"logit shapes differ: {tuple(p.shape)} vs {tuple(q.shape)}")
    if p.shape[0] == 0:
        raise ValueError("kl_divergence needs at least one position")
    log_p = torch.log_softmax(p, dim=-1)  # (T, V)
    log_q = torch.log_softmax(q, dim=-1)  # (T, V)
    prob_p = log_p.exp()
    terms = torch.where(prob_p == 0, torch.zeros_like(prob_p), prob_p * (log_p - log_q))
    return float(terms.sum(dim=-1).mean())


def mean_nll(logprobs_of_targets: torch.Tensor | np.ndarray | Sequence[float]) -> float:
    """Mean negative log-likelihood of target tokens, from their log-probabilities."""
    t = torch.as_tensor(logprobs_of_targets, dtype=torch.float64).flatten()
    if t.numel() == 0:
        raise ValueError("mean_nll needs at least one target log-probability")
    return float(-t.mean())


def _first_id(ids: torch.Tensor | Sequence[int]) -> int | None:
    flat = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return int(flat[0]) if flat else None


def first_token_agree(a_ids: torch.Tensor | Sequence[int], b_ids: torch.Tensor | Sequence[int]) -> bool:
    """Whether two generations start with the same token id.

    False when either generation is empty: an empty output agrees with nothing.
    """
    a, b = _first_id(a_ids), _first_id(b_ids)
    return a is not None and a == b
