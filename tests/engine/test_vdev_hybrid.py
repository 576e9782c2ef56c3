"""The hybrid of question attention and V deviation (``blend:R:q+vdev``) on tiny random
models: the deviation against explicit projections and against fusion's own check layer,
the within-document ranks, the kept set, nested sets, and the fusion invariants."""

from __future__ import annotations

import pytest
import torch

import kvblend.blend.strategies as strategies
from kvblend.blend.chunks import compute_chunk_kv
from kvblend.blend.config import PLAIN_STRATEGY, BlendConfig
from kvblend.blend.fusion import FusionPlan, PlacedChunk, fuse
from kvblend.blend.select import kept_count, select_tokens
from kvblend.blend.strategies import doc_ranks, hybrid_scores, question_scores, vdev_scores
from kvblend.errors import InvalidRequestError
from kvblend.eval.runner import parse_method
from kvblend.models.config import ModelConfig
from kvblend.models.loader import build_model
from tests.conftest import make_hf_model, make_loaded
from tests.engine.test_strategies import assert_fusion_invariants, assert_own_position_exact

PREFIX, SPANS, N = 5, [(5, 17), (17, 29)], 36  # prefix | two documents | question


def _model(arch: str, layers: int = 2):
    hf = make_hf_model(arch, seed=3, attn_implementation="eager", num_hidden_layers=layers)
    model = build_model(ModelConfig.from_hf(hf.config), {k: v.clone() for k, v in hf.state_dict().items()},
                        "cpu", torch.float32)
    return hf, model


def _plan(model, ids: torch.Tensor) -> FusionPlan:
    """Both documents' chunk KV computed after the first token only: placed elsewhere, stale."""
    return FusionPlan(ids, [PlacedChunk(a, compute_chunk_kv(model, ids[:1].tolist(), ids[a:b].tolist()))
                            for a, b in SPANS])


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(3, 97, (N,))


def _naive_ranks(scores: list[float], docs: list[int]) -> list[float]:
    """Mean rank among the same document's scores, over (size - 1); 0.5 when alone."""
    out = []
    for s, d in zip(scores, docs):
        mine = [x for x, e in zip(scores, docs) if e == d]
        below, equal = sum(x < s for x in mine), sum(x == s for x in mine)
        out.append(0.5 if len(mine) < 2 else (below + (equal - 1) / 2) / (len(mine) - 1))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vdev_scores_equal_explicit_v_deviation_and_fusions_check_layer(arch: str) -> None:
    hf, model = _model(arch)
    ids = _ids()
    plan = _plan(model, ids)
    _, reused = question_scores(model, plan)
    got = vdev_scores(model, plan, reused.cache)
    with torch.no_grad():
        h1 = hf(ids[None], output_hidden_states=True).hidden_states[1]  # layer 0's output, (1, N, D)
        attn = hf.model.layers[1].self_attn
        v = attn.v_proj(hf.model.layers[1].input_layernorm(h1))[0]  # (N, Hkv*d)
    v = v.view(N, -1, model.cfg.head_dim).transpose(0, 1)  # (Hkv, N, d)
    expected = torch.zeros(N)
    for (a, b), placed in zip(SPANS, plan.placed):
        expected[a:b] = (v[:, a:b] - placed.chunk.values[1]).pow(2).sum(dim=(0, 2))
    # layer 0 over re-rotated chunk KV equals a full prefill's layer 0, so fresh V is full's
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got[:PREFIX].eq(0).all() and got[SPANS[-1][1]:].eq(0).all() and got[PREFIX:29].gt(0).all()

    seen = {}

    def capture(dev: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
        seen["dev"], seen["pos"] = dev.clone(), pos.clone()
        return select_tokens(dev, k)

    fuse(model, FusionPlan(ids, plan.placed, check_layers=(1,), ratios=(0.5,), pick=capture))
    torch.testing.assert_close(got[seen["pos"]], seen["dev"], atol=1e-5, rtol=1e-5)  # the paper's own signal


def test_doc_ranks_are_mean_ranks_within_each_document() -> None:
    scores = torch.tensor([3.0, 1.0, 1.0, 7.0, 5.0, 2.0, 9.0, 4.0])
    positions = torch.tensor([10, 11, 12, 13, 20, 21, 30, 40])
    spans = [(10, 14), (20, 22), (30, 31)]  # 40 is in no document: ranked alone
    assert doc_ranks(scores, positions, spans).tolist() == pytest.approx(
        [2 / 3, 1 / 6, 1 / 6, 1.0, 1.0, 0.0, 0.5, 0.5])  # the tie holds ranks 0 and 1
    assert doc_ranks(torch.ones(4), torch.arange(4), [(0, 4)]).tolist() == [0.5] * 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hybrid_keeps_the_top_of_the_averaged_within_document_ranks(arch: str, monkeypatch) -> None:
    _, model = _model(arch)
    ids = _ids()
    plan = _plan(model, ids)
    question, reused = question_scores(model, plan)
    vdev = vdev_scores(model, plan, reused.cache)
    pos = torch.arange(PREFIX, 29)
    docs = [0 if p < 17 else 1 for p in pos.tolist()]
    for weight in (0.5, 0.25):
        want = [(1 - weight) * a + weight * b for a, b in zip(_naive_ranks(question[pos].tolist(), docs),
                                                              _naive_ranks(vdev[pos].tolist(), docs))]
        got = hybrid_scores(question[pos], vdev[pos], pos, SPANS, weight)
        assert got.tolist() == pytest.approx(want, abs=1e-6)

    recomputed: list[torch.Tensor | None] = []
    real_fuse = strategies.fuse_steps
    monkeypatch.setattr(strategies, "fuse_steps", lambda m, p: recomputed.append(p.recompute) or real_fuse(m, p))
    kept_sets = []
    for ratio in (0.1, 0.25, 0.5, 0.75):
        cfg = BlendConfig(ratio=ratio, **{**PLAIN_STRATEGY, "selection": "question", "vdev": 0.5})
        strategies.run_strategy(model, FusionPlan(ids, plan.placed, ratios=(ratio,), strategy=cfg))
        kept = set(recomputed[-1].nonzero().squeeze(1).tolist())
        hybrid = hybrid_scores(question[pos], vdev[pos], pos, SPANS, 0.5)
        assert kept == set(pos[select_tokens(hybrid, kept_count(ratio, len(pos)))].tolist())
        kept_sets.append(kept)
    assert all(a < b for a, b in zip(kept_sets, kept_sets[1:]))  # nested as the ratio grows
    question_only = question[pos]
    top_q = set(pos[select_tokens(question_only, kept_count(0.25, len(pos)))].tolist())
    assert top_q != kept_sets[1]  # the deviation (and the per-document ranks) changed the choice


def test_nested_kept_sets_with_sinks_and_budgets(monkeypatch) -> None:
    _, model = _model("llama")
    ids = _ids()
    plan = _plan(model, ids)
    recomputed: list[torch.Tensor] = []
    real_fuse = strategies.fuse_steps
    monkeypatch.setattr(strategies, "fuse_steps", lambda m, p: recomputed.append(p.recompute) or real_fuse(m, p))
    for extra in (dict(sinks=2), dict(sinks=2, budget=True)):
        sets = []
        for ratio in (0.2, 0.4, 0.6, 0.8):
            cfg = BlendConfig(ratio=ratio, **{**PLAIN_STRATEGY, "selection": "question", "vdev": 0.5, **extra})
            strategies.run_strategy(model, FusionPlan(ids, plan.placed, ratios=(ratio,), strategy=cfg))
            sets.append(set(recomputed[-1].nonzero().squeeze(1).tolist()))
        assert {5, 6, 17, 18} <= sets[0]  # the sinks
        assert all(a <= b for a, b in zip(sets, sets[1:])), extra


HYBRIDS = [dict(selection="question", vdev=0.5), dict(selection="question", vdev=0.3, budget=True, sinks=2),
           dict(selection="question", vdev=0.5, shift=True)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_hybrid_keeps_the_fusion_invariants(arch: str) -> None:
    assert_fusion_invariants(arch, HYBRIDS)
    assert_own_position_exact(HYBRIDS)


def test_method_grammar_names_the_hybrid() -> None:
    hybrid = parse_method("blend:0.15:q+vdev").blend
    assert (hybrid.selection, hybrid.ratio, hybrid.vdev) == ("question", 0.15, 0.5)
    full = parse_method("blend:0.2:q+vdev0.3+budget+sinks4+shift").blend
    assert (full.vdev, full.budget, full.sinks, full.shift) == (0.3, True, 4, True)
    assert parse_method("blend:0.15:q+shift+vdev").blend == parse_method("blend:0.15:q+vdev+shift").blend
    assert parse_method("blend:0.15:q").blend.vdev == 0.0
    for bad, message in [("blend:0.15:v+vdev", "question selection"), ("cacheblend:0.15+vdev", "question selection"),
                         ("blend:0.1:oracle+vdev", "question selection"), ("blend:0.1:q+vdevx", "vdev weight"),
                         ("blend:0.1:q+vdev1.5", r"within \[0, 1\]"), ("reuse+vdev", "modifier")]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad)
    with pytest.raises(InvalidRequestError, match="at least 2 layers"):
        _, one = _model("llama", layers=1)
        ids = _ids()
        vdev_scores(one, _plan(one, ids), one.new_cache(N))
