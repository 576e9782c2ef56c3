"""``Request(explain=True)``: each check lists, per document, the tokens it chose with their
scores, as offsets within the document, agreeing with the counts the stats already give."""

from __future__ import annotations

import pytest

from kvblend.blend.config import PLAIN_STRATEGY, BlendConfig
from kvblend.engine import Engine, Request
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

CONFIGS = {
    "cacheblend": BlendConfig.cacheblend(0.3),
    "two checks": BlendConfig(check_layers=(1, 2), schedule=(0.5, 0.2), **PLAIN_STRATEGY),
    "blend (default)": BlendConfig(ratio=0.3),
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    eng = Engine(make_loaded(num_hidden_layers=4), self_check=False)
    eng.prepare(Request(documents=DOCS, question=QUESTION))
    eng.flush()  # every document stored: the next requests reuse them all
    return eng


@pytest.mark.parametrize("name", CONFIGS)
def test_explained_tokens_lie_in_their_documents_and_match_the_counts(engine, name) -> None:
    stats = engine.prepare(Request(documents=DOCS, question=QUESTION, blend=CONFIGS[name], explain=True)).stats
    assert stats.checks and all(d.hit for d in stats.docs)
    for check in stats.checks:
        assert check.tokens is not None and len(check.tokens) == len(stats.docs)
        for doc, sel, n_kept in zip(stats.docs, check.tokens, check.doc_selected):
            assert len(sel.kept) == n_kept and len(sel.kept_scores) == n_kept
            every = sel.kept + sel.reused
            assert len(set(every)) == len(every) and all(0 <= o < doc.tokens for o in every)
            assert sel.kept == sorted(sel.kept) and set(sel.forced) <= set(sel.kept)
            assert set(sel.measured) <= set(every) and len(sel.measured) == len(sel.deviation)
    assert stats.to_dict()["checks"][0]["tokens"][0]["kept"] == stats.checks[0].tokens[0].kept


def test_cacheblend_keeps_the_most_deviating_tokens_and_measures_every_candidate(engine) -> None:
    stats = engine.prepare(Request(documents=DOCS, question=QUESTION, blend=CONFIGS["cacheblend"],
                                   explain=True)).stats
    (check,) = stats.checks
    kept = [s for sel in check.tokens for s in sel.kept_scores]
    reused = [s for sel in check.tokens for s in sel.reused_scores]
    assert min(kept) >= max(reused)  # one global top-k by deviation
    assert max(kept) == pytest.approx(check.max_score, rel=1e-5)
    for sel in check.tokens:  # the check layer measured the deviation of every candidate: its score
        assert sel.measured == sorted(sel.kept + sel.reused)
        by_offset = dict(zip(sel.kept + sel.reused, sel.kept_scores + sel.reused_scores))
        assert sel.deviation == [by_offset[o] for o in sel.measured]


def test_question_selection_measures_deviation_on_its_recomputed_tokens_only(engine) -> None:
    stats = engine.prepare(Request(documents=DOCS, question=QUESTION, blend=CONFIGS["blend (default)"],
                                   explain=True)).stats
    (check,) = stats.checks
    for sel in check.tokens:
        assert sel.measured == sel.kept
        assert sel.kept[:4] == [0, 1, 2, 3]  # the sinks: each document's first 4 tokens
    assert any(sel.forced for sel in check.tokens)  # the shift's uniform sample


def test_without_explain_the_stats_carry_no_tokens(engine) -> None:
    stats = engine.prepare(Request(documents=DOCS, question=QUESTION, blend=CONFIGS["cacheblend"])).stats
    assert stats.checks and all(c.tokens is None for c in stats.checks)
    assert "tokens" not in stats.to_dict()["checks"][0]
