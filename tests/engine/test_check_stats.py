"""Per-check-layer and per-document selection statistics in the request stats (issue #15, point 3)."""

from __future__ import annotations

import dataclasses

import torch

from kvblend.blend.config import PLAIN_STRATEGY, BlendConfig
from kvblend.engine import Engine, Request
from kvblend.store.keys import chunk_key
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

BLEND = BlendConfig(check_layers=(1, 2), schedule=(0.5, 0.2), **PLAIN_STRATEGY)  # deviation's check layers


def stats(eng: Engine, docs, **kw):
    return eng.prepare(Request(documents=docs, question=QUESTION, blend=BLEND, **kw)).stats


def test_each_check_layer_reports_scores_and_where_its_tokens_fell() -> None:
    eng = Engine(make_loaded(num_hidden_layers=4), self_check=False)
    docs = [DOCS[0], "", DOCS[1], DOCS[0]]
    stats(eng, docs)
    eng.flush()
    s = stats(eng, docs)
    assert [c.layer for c in s.checks] == [1, 2]
    first, second = s.checks
    assert first.candidates == s.candidates and second.candidates == first.selected
    forced = s.recomputed_per_layer[-1] - second.selected
    for c in s.checks:
        assert s.recomputed_per_layer[c.layer] == forced + c.selected
        assert sum(c.doc_selected) == c.selected and c.doc_selected[1] == 0
        assert all(n <= d.tokens for n, d in zip(c.doc_selected, s.docs))
        assert 0 <= c.mean_score <= c.max_score
        assert abs(sum(c.doc_share) - 1.0) < 1e-9
    assert first.selected == round(0.5 * s.candidates) and second.selected == round(0.2 * s.candidates)
    assert s.to_dict()["checks"][0]["doc_share"] == first.doc_share
    assert stats(eng, docs, method="full").checks == ()


def test_a_corrupted_document_draws_the_selection() -> None:
    eng = Engine(make_loaded(num_hidden_layers=4), self_check=False)
    stats(eng, DOCS)
    eng.flush()
    ctx = eng.key_context((eng.tokenizer.bos_token_id,), "default")
    ids = eng.layout(Request(documents=DOCS, question=QUESTION)).docs[2]
    good = eng.store.get(chunk_key(ids, ctx), ids)
    noisy = tuple(v + 5 * torch.randn(v.shape, generator=torch.Generator().manual_seed(i))
                  for i, v in enumerate(good.values))
    eng.store.put(chunk_key(ids, ctx), dataclasses.replace(good, values=noisy))  # passes every checksum
    s = stats(eng, DOCS)
    first = s.checks[0]
    assert first.doc_selected[2] == s.docs[2].tokens  # every corrupted token is recomputed
    assert first.doc_share[2] == max(first.doc_share)
