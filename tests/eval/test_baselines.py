"""MapReduce and MapRerank on the tiny random model."""

from __future__ import annotations

import math

import pytest
import torch

from kvblend.blend.layout import tokenize_document
from kvblend.engine import Engine
from kvblend.eval.baselines import (
    BaselineConfig, MapCall, answer_request, decode_logprobs, format_note, map_reduce, map_rerank, pick_answer,
    reduce_request, score_baseline,
)
from kvblend.eval.datasets import Example
from kvblend.eval.runner import decode_answer, parse_method, reference, score_method, teacher_force
from tests.conftest import make_loaded

EXAMPLE = Example(
    question="which city is the project led by the doctor in ?",
    documents=("the doctor led the project alpha in north paris .",
               "project alpha was approved in the city of lisbon .",
               "the company is headquartered in rome , west of the river ."),
    answers=("lisbon",),
    id="tiny-0",
)
CONFIG = BaselineConfig(map_tokens=6, max_tokens=6, kl_tokens=3)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(make_loaded(seed=3))


def _call(i: int, text: str, logprobs: list[float]) -> MapCall:
    return MapCall(i, text, list(range(len(logprobs))), logprobs, 10, 0.1, 0.2)


def test_pick_answer_rules() -> None:
    maps = [_call(0, "rome", [-1.0, -3.0]), _call(1, "", [-0.1]), _call(2, "paris", [-0.5, -1.5]),
            _call(3, "oslo", [-2.0])]
    assert [round(m.confidence, 3) for m in maps] == [-2.0, -0.1, -1.0, -2.0]
    assert pick_answer(maps) == 2  # the empty answer is more confident but cannot win
    assert pick_answer([maps[0], maps[3]]) == 0  # a tie goes to the earlier document
    assert pick_answer([_call(0, "", [-3.0]), _call(1, " ", [-1.0])]) == 1  # all empty: most confident
    assert _call(0, "", []).confidence == -math.inf


def test_decode_logprobs_matches_the_runner_decoder(engine: Engine) -> None:
    prepared = engine.prepare(answer_request(EXAMPLE, EXAMPLE.documents[:1]), 6)
    out = decode_logprobs(engine, prepared, 6)
    assert (out.text, out.token_ids) == decode_answer(engine, prepared, 6)
    assert prepared.cache.length == prepared.stats.prompt_tokens  # rewound
    logp = torch.log_softmax(teacher_force(engine, prepared, out.token_ids).double(), dim=-1)
    expected = logp[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_map_rerank_picks_the_answer_with_the_highest_mean_logprob(engine: Engine) -> None:
    run = map_rerank(engine, EXAMPLE, CONFIG)
    recomputed = []
    for doc, call in zip(EXAMPLE.documents, run.maps):
        prepared = engine.prepare(answer_request(EXAMPLE, [doc]), CONFIG.max_tokens)
        logits = teacher_force(engine, prepared, call.token_ids).double()
        logp = torch.log_softmax(logits, dim=-1)[torch.arange(len(call.token_ids)), torch.tensor(call.token_ids)]
        recomputed.append(float(logp.mean()))
    assert [m.confidence for m in run.maps] == pytest.approx(recomputed, abs=1e-4)
    assert len({round(c, 3) for c in recomputed}) > 1  # the choice is not a tie
    eligible = [i for i, m in enumerate(run.maps) if m.text.strip()] or range(len(run.maps))
    best = max(eligible, key=lambda i: recomputed[i])
    assert run.picked == best
    assert (run.text, run.token_ids) == (run.maps[best].text, run.maps[best].token_ids)
    assert run.final.layout == engine.layout(answer_request(EXAMPLE, [EXAMPLE.documents[best]]))


def test_map_reduce_final_prompt_holds_every_note(engine: Engine) -> None:
    run = map_reduce(engine, EXAMPLE, CONFIG)
    assert [m.document for m in run.maps] == [0, 1, 2] and run.picked is None
    assert any(m.text.strip() for m in run.maps)
    assert run.final.layout == engine.layout(reduce_request(EXAMPLE, run.maps))
    for i, m in enumerate(run.maps):
        assert run.final.layout.docs[i] == tokenize_document(engine.tokenizer, format_note(i, m.text))
        assert m.text.strip() in format_note(i, m.text)


@pytest.mark.parametrize("method", ["mapreduce", "maprerank"])
def test_baseline_scores_and_ttft(engine: Engine, method: str) -> None:
    ref, _ = reference(engine, EXAMPLE, CONFIG.max_tokens, CONFIG.kl_tokens)
    scores = score_baseline(engine, EXAMPLE, method, ref, CONFIG)
    engine_keys = score_method(engine, EXAMPLE, parse_method("reuse"), ref, CONFIG.max_tokens, CONFIG.kl_tokens)
    assert set(engine_keys) <= set(scores)
    n = len(EXAMPLE.documents)
    assert scores["calls"] == (n + 1 if method == "mapreduce" else n)
    assert len(scores["map_outputs"]) == n and scores["recompute_frac"] == 1.0
    assert scores["ttft_s"] >= scores["map_s"] > 0  # every map call, decode included, precedes the answer
    assert scores["ttft_s"] >= scores["prefill_s"] > 0  # so does each call's prefill, the final one's too
    assert scores["kl"] >= 0 and math.isfinite(scores["kl"])
    assert (scores["picked"] is None) == (method == "mapreduce")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="map_tokens"):
        BaselineConfig(map_tokens=0)
    with pytest.raises(ValueError, match="needs at least one document"):
        score_baseline(None, Example("q", (), ("a",), "empty"), "maprerank", None)  # type: ignore[arg-type]
