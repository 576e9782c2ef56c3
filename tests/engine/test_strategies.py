"""Selection/correction strategies (kvblend.blend.strategies) on tiny random models:
scores against an explicit attention matrix, budgets, the shift's frame, and the fusion
invariants for every strategy (ratio 1 == full, ratio 0 == reuse, own position exact)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvblend import rope as rope_lib
from kvblend.blend.chunks import compute_chunk_kv
from kvblend.blend.config import PLAIN_STRATEGY, BlendConfig
from kvblend.blend.fusion import FusionPlan, PlacedChunk
from kvblend.blend.strategies import (
    QuestionScores, ShiftCorrection, allocate, blend_risk, choose, covering_count, moved_risk, question_scores, shift_samples,
)
from kvblend.models.attention import attend, causal_mask
from kvblend.engine import Engine, PrefixCache, Request
from kvblend.eval.runner import parse_method
from kvblend.metrics import kl_divergence
from kvblend.models.config import ModelConfig
from kvblend.models.kv_cache import KVCache
from kvblend.models.loader import build_model
from kvblend.store import StoreConfig, build_store
from tests.conftest import make_hf_model, make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

STRATEGIES = [
    dict(selection="question"),
    dict(selection="question", budget=True, sinks=2),
    dict(selection="question", shift=True),
    dict(selection="question", budget=True, sinks=2, shift=True),
    dict(selection="question", budget=True, sinks=2, shift=True, shift_test=False),
    dict(selection="question", budget=True, sinks=2, shift=True, shift_question=True),
    dict(selection="deviation", budget=True, sinks=2, shift=True),
    dict(selection="oracle", budget=True),
    dict(selection="question", cover=0.9),  # ratio 0 recomputes nothing, whatever the share
    dict(selection="question", budget=True, sinks=2, shift=True, cover=0.9),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_question_scores_equal_an_explicit_attention_matrix(arch: str) -> None:
    hf = make_hf_model(arch, seed=3, attn_implementation="eager")
    model = build_model(ModelConfig.from_hf(hf.config), {k: v.clone() for k, v in hf.state_dict().items()},
                        "cpu", torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (30,))
    prefix, doc_end = 5, 22  # prefix | one document | question
    # the document's KV computed after the real prefix, at its own position: reuse is exact here
    chunk = compute_chunk_kv(model, ids[:prefix].tolist(), ids[prefix:doc_end].tolist())
    scores, _ = question_scores(model, FusionPlan(ids, [PlacedChunk(prefix, chunk)]))
    with torch.no_grad():
        att = hf(ids[None], output_attentions=True).attentions  # per layer (1, Hq, N, N)
    expected = sum(a[0, :, doc_end:, :].sum(dim=(0, 1)) for a in att)  # the question rows of every layer
    cand = slice(prefix, doc_end)
    torch.testing.assert_close(scores[cand], expected[cand], atol=1e-4, rtol=1e-4)


def test_budgets_sum_to_the_total_and_respect_floors_and_sizes() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(1, 6, (1,), generator=gen))
        sizes = torch.randint(0, 40, (k,), generator=gen).tolist()
        weights = (torch.rand(k, generator=gen) * (torch.rand(k, generator=gen) > 0.3)).tolist()
        total = int(torch.randint(0, sum(sizes) + 5, (1,), generator=gen))
        floor = float(torch.rand(1, generator=gen))
        out = allocate(total, sizes, weights, floor)
        assert sum(out) == min(total, sum(sizes))
        for n, b in zip(sizes, out):
            assert 0 <= b <= n
            if sum(sizes):
                assert b >= min(n, int(floor * min(total, sum(sizes)) * n / sum(sizes)))
    assert allocate(10, [20, 20], [3.0, 1.0], 0.0) == [8, 2]  # proportional to mass without a floor
    assert allocate(10, [20, 20], [1.0, 0.0], 0.6) == [7, 3]  # the floor: 0.6 of the equal share


def test_choose_takes_sinks_first_and_keeps_within_document_budgets() -> None:
    spans = [(10, 20), (20, 30)]
    pos = torch.arange(10, 30)
    scores = torch.zeros(20)
    scores[15:20] = torch.tensor([5.0, 6.0, 7.0, 8.0, 9.0])  # all the mass in document 2's tail
    plain = BlendConfig(**PLAIN_STRATEGY)
    top = choose(scores, pos, 4, spans, plain)
    assert pos[top].tolist() == [26, 27, 28, 29]
    sinks = choose(scores, pos, 4, spans, replace(plain, sinks=1))
    assert pos[sinks].tolist() == [10, 20, 28, 29]
    budget = choose(scores, pos, 6, spans, replace(plain, budget=True, budget_floor=1.0))
    assert pos[budget].tolist() == [10, 11, 12, 27, 28, 29]  # 3 + 3 by the floor, top by score in each


def test_covering_count_is_the_fewest_tokens_that_hold_the_share() -> None:
    scores = torch.tensor([1.0, 5.0, 1.0, -2.0, 1.0, 1.0, 1.0])  # mass 10 (a negative score counts 0)
    assert covering_count(scores, 0.5) == 1  # the 5 alone holds half
    assert covering_count(scores, 0.51) == 2
    assert covering_count(scores, 0.9) == 5
    assert covering_count(scores, 1.0) == 6  # every positive score; the negative one is never needed
    assert covering_count(scores, 0.0) == 0 and covering_count(torch.zeros(4), 0.5) == 0


def test_cover_keeps_at_least_the_tokens_holding_the_share_of_the_question_attention(monkeypatch) -> None:
    # a question that spreads its attention gets more tokens than the ratio's, enough that the
    # recomputed ones hold the share; one whose ratio already covers it keeps the ratio's count
    import kvblend.blend.strategies as strategies

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = strategies.choose
    monkeypatch.setattr(strategies, "choose", lambda scores, *a, **kw: seen.append(
        (scores, out := real(scores, *a, **kw))) or out)
    eng = Engine(make_loaded(num_hidden_layers=3))
    _logits(eng, "blend")
    eng.flush()

    def kept(**blend) -> tuple[int, float, int]:
        seen.clear()
        st = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                                 blend=BlendConfig(**{**PLAIN_STRATEGY, "selection": "question", **blend}))).stats
        (scores, chosen), = seen
        return int(chosen.numel()), float(scores[chosen].sum() / scores.sum()), st.candidates

    n, held, cand = kept(ratio=0.1)
    assert n == round(0.1 * cand) and held < 0.9  # the ratio alone leaves the share uncovered
    n, held, _ = kept(ratio=0.1, cover=0.9)
    assert held >= 0.9 and n > round(0.1 * cand)
    assert kept(ratio=0.1, cover=0.9, budget=True, sinks=2, shift=True)[0] == n  # the count, whatever spends it
    assert kept(ratio=0.95, cover=0.9)[0] == round(0.95 * cand)  # never below the ratio's
    assert parse_method("blend:0.1:q+cover0.9").blend.cover == 0.9


def _stale_cache(seed: int, n: int = 12):
    """One layer of random stale K/V for the tiny model's shapes: (cfg, cos, sin, stale K, stale V, cache)."""
    cfg = make_loaded().config
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_lib.cos_sin(cfg.rope, torch.arange(n))
    torch.manual_seed(seed)
    stale_k, stale_v = torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    cache = KVCache(1, hkv, d, n, torch.float32, "cpu")
    cache.keys[0][:], cache.values[0][:] = stale_k, stale_v
    return cfg, cos, sin, stale_k, stale_v, cache


def test_shift_moves_untouched_tokens_by_the_mean_residual_in_the_pre_rope_frame() -> None:
    cfg, cos, sin, stale_k, stale_v, cache = _stale_cache(0)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    written = torch.tensor([3, 5, 9])  # document [2, 8) has 3 and 5 recomputed; 9 is not in it
    c_k, c_v = torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
    fresh_k = stale_k[:, written] + rope_lib.apply_rope(c_k.expand(-1, 3, -1).contiguous(), cos[written], sin[written])
    fresh_v = stale_v[:, written] + c_v
    ShiftCorrection([(2, 8)], [(cos, sin)], cfg.rope.interleaved)(cache, 0, written, fresh_k, fresh_v)
    moved = torch.tensor([2, 4, 6, 7])
    want_k = stale_k[:, moved] + rope_lib.apply_rope(c_k.expand(-1, 4, -1).contiguous(), cos[moved], sin[moved])
    torch.testing.assert_close(cache.keys[0][:, moved], want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.values[0][:, moved], stale_v[:, moved] + c_v, atol=1e-5, rtol=1e-5)
    outside = torch.tensor([0, 1, 3, 5, 8, 9, 10, 11])  # written ones are left to the caller
    assert torch.equal(cache.keys[0][:, outside], stale_k[:, outside])


@pytest.mark.parametrize("tested", [False, True])
def test_the_tested_shift_moves_only_documents_whose_residual_is_a_shift(tested: bool) -> None:
    """Document [0, 6) has the same residual c on every written token: a shift, moved either
    way. Document [6, 12) has residuals 3r, -2r, 0: their mean r / 3 moves a left-out
    token farther than not moving it (held-out error (3/2)^2 x 12.67|r|^2 against 13|r|^2),
    so the tested shift leaves it (before session 9 it was moved by r / 3)."""
    n = 12
    cfg, cos, sin, stale_k, stale_v, cache = _stale_cache(2, n)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    written = torch.tensor([0, 1, 2, 6, 7, 8])
    c, r = torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
    fresh_v = stale_v[:, written] + torch.cat([c, c, c, 3 * r, -2 * r, 0 * r], dim=1)
    shift = ShiftCorrection([(0, 6), (6, 12)], [(cos, sin)], cfg.rope.interleaved, tested=tested)
    shift(cache, 0, written, stale_k[:, written].clone(), fresh_v)
    torch.testing.assert_close(cache.values[0][:, 3:6], stale_v[:, 3:6] + c, atol=1e-5, rtol=1e-5)
    moved = stale_v[:, 9:12] + (0 if tested else r / 3)
    torch.testing.assert_close(cache.values[0][:, 9:12], moved, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.keys[0], stale_k)  # no K residual: nothing to move
    before, after, ids = shift.errors[0]
    assert ids == [0, 1] and after[0] <= before[0] * 1e-4  # c removed entirely from document 1
    assert float(after[1]) == pytest.approx(float(before[1]) if tested else 2.25 * 38 / 3 / 3 * float(r.pow(2).sum()),
                                            rel=1e-4)


def _question_case(residuals: list[torch.Tensor], question: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Document [0, 8) of a 12-token prompt; its tokens 1, 3, 5 are recomputed with pre-RoPE K
    residuals ``residuals`` (each (d,), the same on every KV head) and exact V, and the
    question row 9 reads with queries in RoPE plane 1 (dims 1 and 1 + d/2), so it sees a
    residual's plane-1 part and not its plane-0 part. Returns (stale K, K after the shift,
    the moved positions)."""
    n, written = 12, torch.tensor([1, 3, 5, 9])
    cfg, cos, sin, stale_k, stale_v, cache = _stale_cache(4, n)
    hkv, hq, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    res = torch.stack(residuals)[None].expand(hkv, -1, -1).contiguous()  # (Hkv, 3, d)
    fresh_k = torch.cat([stale_k[:, written[:3]] + rope_lib.apply_rope(res, cos[written[:3]], sin[written[:3]]),
                         stale_k[:, 9:10]], dim=1)
    q0 = torch.zeros(hq, 4, d)
    q0[:, 3, 1], q0[:, 3, 1 + d // 2] = 3.0, 2.0
    q = rope_lib.apply_rope(q0, cos[written], sin[written])
    shift = ShiftCorrection([(0, 8)], [(cos, sin)], cfg.rope.interleaved, tested=True,
                            question_from=8 if question else None)
    shift(cache, 0, written, fresh_k, stale_v[:, written].clone(), q)
    return stale_k, cache.keys[0].clone(), torch.tensor([0, 2, 4, 6, 7])


def test_the_question_test_leaves_a_k_shift_that_passes_on_k_but_moves_the_question_logits_wrong() -> None:
    """Residuals c + u, c - u, c: c (plane 0) large, so the mean c passes the per-document
    test (held-out K error (3/2)^2 x 2|u|^2 = 4.5|u|^2 against 3|c|^2 + 2|u|^2), but the question
    reads only plane 1, where the unshifted logit errors are q.u, -q.u, 0 and a held-out mean
    makes them 1.5 q.u, -1.5 q.u, 0: moving K by c brings no token nearer what the question
    reads and the held-out tokens farther. Session 9's shift (per-document test only) moved it."""
    d = _stale_cache(0)[0].head_dim
    c, u = torch.zeros(d), torch.zeros(d)
    c[0], c[d // 2], u[1] = 10.0, 10.0, 1.0
    stale_k, kv_tested, moved = _question_case([c + u, c - u, c], question=False)
    assert not torch.allclose(kv_tested[:, moved], stale_k[:, moved])  # the K test alone shifts
    stale_k, both, moved = _question_case([c + u, c - u, c], question=True)
    assert torch.equal(both[:, moved], stale_k[:, moved])


def test_the_question_test_keeps_a_shift_the_question_reads() -> None:
    """Every sampled token has the same residual w in the plane the question reads: the
    held-out mean is exact, so the question test keeps the shift and moves K by w."""
    d = _stale_cache(0)[0].head_dim
    w = torch.zeros(d)
    w[1], w[1 + d // 2] = 0.7, -0.4
    stale_k, after, moved = _question_case([w, w, w], question=True)
    cfg = make_loaded().config
    cos, sin = rope_lib.cos_sin(cfg.rope, torch.arange(12))
    moved_w = w.expand(stale_k.shape[0], 5, -1).contiguous()
    want = stale_k[:, moved] + rope_lib.apply_rope(moved_w, cos[moved], sin[moved])
    torch.testing.assert_close(after[:, moved], want, atol=1e-5, rtol=1e-5)


def test_blend_risk_is_the_share_not_recomputed_times_what_the_shift_left() -> None:
    shift = ShiftCorrection([(0, 4), (4, 8)], [], False)
    shift.errors = [(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 4.0]), [0, 1]),  # layer 1: doc 2 not shifted
                    (torch.tensor([1.0]), torch.tensor([0.5]), [1])]  # layer 2: only doc 2 corrected
    assert blend_risk(shift, 2, 8) == pytest.approx(0.75 * 5.5 / 7.0)
    assert blend_risk(shift, 8, 8) == 0.0
    assert blend_risk(ShiftCorrection([(0, 4)], [], False), 2, 8) is None  # nothing measured


def test_a_blend_reports_its_risk_and_reuse_none() -> None:
    eng = Engine(make_loaded())
    docs = [" ".join(f"w{i}{j}" for j in range(40)) + " ." for i in range(3)]  # long enough for a shift sample

    def stats(method: str, **blend):
        req = Request(documents=docs, question=QUESTION, system="answer .", method=method, blend=BlendConfig(**blend))
        return eng.prepare(req).stats
    stats("blend")
    eng.flush()  # every document stored
    risk = stats("blend").risk
    assert risk is not None and 0.0 <= risk < 10.0
    assert stats("reuse").risk is None and stats("full").risk is None
    assert stats("blend", ratio=0.6).risk < risk  # more recomputed: less of reuse's error left
    assert 0.0 < stats("blend", shift=False).risk <= 1.0  # without the shift: moved_risk


def test_without_the_shift_the_risk_is_how_little_the_blend_moved_the_answer_from_reuse() -> None:
    """Ratio 1 without the shift recomputes every token (the blend is full prefill's) and its
    question pass is plain reuse: the risk is exp(-KL(full || reuse)) at the last token."""
    eng = Engine(make_loaded())
    docs = [" ".join(f"w{i}{j}" for j in range(40)) + " ." for i in range(3)]

    def prepared(method: str, **blend):
        req = Request(documents=docs, question=QUESTION, system="answer .", method=method, blend=BlendConfig(**blend))
        return eng.prepare(req)
    prepared("blend")
    eng.flush()  # every document stored
    full, reuse = prepared("full").logits, prepared("reuse").logits
    moved = math.exp(-kl_divergence(full, reuse))
    assert moved < 0.999  # reuse's answer differs from full prefill's here: the test can tell
    assert prepared("blend", ratio=1.0, shift=False).stats.risk == pytest.approx(moved, rel=1e-4)
    assert moved_risk(reuse, reuse) == 1.0  # the answer left where reuse had it
    assert moved_risk(reuse, torch.full_like(reuse, float("nan"))) is None  # never a NaN risk for the guard


def test_a_blend_with_shiftq_runs_the_question_test_on_the_question_rows(monkeypatch) -> None:
    """Fusion hands the shift the written rows' queries: with ``shift_question`` the test runs
    at every layer that moves tokens, on the question's rows; without it, never."""
    import kvblend.blend.strategies as strategies

    made: list[ShiftCorrection] = []

    class Kept(ShiftCorrection):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(strategies, "ShiftCorrection", Kept)
    eng = Engine(make_loaded())
    docs = [" ".join(f"w{i}{j}" for j in range(40)) + " ." for i in range(3)]
    for question in (False, True, True):  # the first stores the documents
        made.clear()
        req = Request(documents=docs, question=QUESTION, system="answer .", method="blend",
                      blend=BlendConfig(shift_question=question))
        eng.prepare(req)
        eng.flush()
    shift = made[-1]
    assert shift.question_from is not None and len(shift.attn_errors) == len(shift.errors) > 1
    assert all(float(a.sum()) > 0 for a, _ in shift.attn_errors[1:])  # layer 0's K/V are exact
    req = Request(documents=docs, question=QUESTION, system="answer .", method="blend", blend=BlendConfig())
    made.clear()
    eng.prepare(req)
    assert made[-1].question_from is None and made[-1].attn_errors == []


def _logits(eng: Engine, method: str, docs=DOCS, **blend) -> torch.Tensor:
    req = Request(documents=docs, question=QUESTION, system="answer the question .", method=method,
                  blend=BlendConfig(**blend))
    return eng.prepare(req).logits


def assert_fusion_invariants(arch: str, strategies: list[dict]) -> None:
    """Ratio 1 is a full prefill, ratio 0 without the shift is full reuse, ratio 0.3 is finite."""
    eng = Engine(make_loaded(arch=arch))
    _logits(eng, "blend")
    eng.flush()
    full, reuse = _logits(eng, "full"), _logits(eng, "reuse")
    assert (reuse - full).abs().max().item() > 1e-3  # reuse is approximate here
    for strategy in strategies:
        assert (_logits(eng, "blend", ratio=1.0, **strategy) - full).abs().max().item() <= 1e-3, strategy
        if not strategy.get("shift"):
            assert (_logits(eng, "blend", ratio=0.0, **strategy) - reuse).abs().max().item() <= 1e-3, strategy
        assert torch.isfinite(_logits(eng, "blend", ratio=0.3, **strategy)).all()


def assert_own_position_exact(strategies: list[dict]) -> None:
    """A document alone at its own position (chunk KV computed after the prompt) is exact
    (stored losslessly: fp16 storage rounds what is reused)."""
    eng = Engine(make_loaded(), store=build_store(StoreConfig(kv_dtype="fp32")))
    _logits(eng, "blend", docs=DOCS[:1], chunk_prefix="prompt")
    eng.flush()
    full = _logits(eng, "full", docs=DOCS[:1])
    for strategy in strategies:
        for ratio in (0.0, 0.3):
            got = _logits(eng, "blend", docs=DOCS[:1], ratio=ratio, chunk_prefix="prompt", **strategy)
            assert (got - full).abs().max().item() <= 1e-3, (strategy, ratio)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_strategy_keeps_the_fusion_invariants(arch: str) -> None:
    assert_fusion_invariants(arch, STRATEGIES)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_document_at_its_own_position_stays_exact(strategy: dict) -> None:
    assert_own_position_exact([strategy])


def test_a_cold_request_computes_its_prompt_once(monkeypatch) -> None:
    # every document misses: the question pass would compute the whole prompt and a second
    # pass all of it again (2x a full prefill, seen as blend slower than full in serving)
    import kvblend.blend.strategies as strategies

    passes: list[int] = []
    real = strategies.fuse_steps
    monkeypatch.setattr(strategies, "fuse_steps", lambda m, p: passes.append(1) or real(m, p))
    eng = Engine(make_loaded(num_hidden_layers=3))
    full = _logits(eng, "full")
    cold_blend = BlendConfig(ratio=0.15, selection="question", budget=True, sinks=4, shift=True, recompute_misses=True)
    # min_reuse 0: fusion itself, not the exact prefill a blend reusing nothing is routed to
    cold = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                               blend=replace(cold_blend, min_reuse=0.0)))
    assert len(passes) == 1 and all(d.source == "computed" for d in cold.stats.docs)
    assert (cold.logits - full).abs().max().item() <= 1e-3
    eng.flush()
    passes.clear()
    other = Engine(make_loaded(num_hidden_layers=3))  # a cold store again
    routed = other.prepare(
        Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend", blend=cold_blend))
    assert not passes and routed.stats.fallback == "little-reuse"  # at the default: no fusion at all
    assert (routed.logits - _logits(other, "full")).abs().max().item() <= 1e-3
    other.flush()
    eng.flush()
    passes.clear()
    _logits(eng, "blend", ratio=0.0, selection="question", shift=True)  # all cached, nothing kept: one pass
    assert len(passes) == 1


def _with_a_miss(eng: Engine, method: str, fresh: str, at: int, **blend):
    """Prepared DOCS with document ``at`` replaced by ``fresh`` text the store has not seen; the
    store forgets it again afterwards (a write-back would turn the next request's miss into a hit)."""
    known = set(eng.store.keys("default"))
    docs = DOCS[:at] + [fresh] + DOCS[at + 1:]
    out = eng.prepare(Request(documents=docs, question=QUESTION, system="answer the question .", method=method,
                              blend=BlendConfig(**{"recompute_misses": True, **blend})))
    eng.flush()
    for key in set(eng.store.keys("default")) - known:
        eng.store.delete(key)
    want = ["memory"] * len(DOCS)
    want[at] = "computed"
    assert method == "full" or [d.source for d in out.stats.docs] == want
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("at", [0, 1])
def test_question_selection_computes_a_missed_document_once(arch: str, at: int) -> None:
    # a document that missed the store is computed once, in the question pass (it used to be
    # computed again in full in the second pass: a partial miss cost twice its tokens). After
    # a stored chunk (at=1) it read reused K/V there, so the second pass blends it like a
    # chunk (its share recomputed); before every stored chunk (at=0) it read exact K/V only,
    # so it is final and not recomputed at all. The invariants hold with the miss: ratio 1 =
    # full, ratio 0 = reuse. (No prefix cache: an exact prefix over the miss would serve it.)
    eng = Engine(make_loaded(arch=arch, num_hidden_layers=3), prefix_cache=PrefixCache(0))
    _logits(eng, "blend")
    eng.flush()
    fresh = "a passage nobody stored before , about the river and the old bridge near the town ."
    warm = Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                   blend=BlendConfig(ratio=0.0, selection="question"))
    forced = eng.prepare(warm).stats.recomputed_per_layer[0]  # the prefix (computed once) and the question
    again = forced - len(eng.layout(warm).prefix)  # what the second pass computes again
    for strategy in STRATEGIES[:4]:
        part = _with_a_miss(eng, "blend", fresh, at, ratio=0.25, **strategy).stats
        missed = part.docs[at].tokens
        blended = part.candidates + (missed if at else 0)
        assert part.recomputed_per_layer == [forced + missed + again + round(0.25 * blended)] * 3, strategy
        assert part.checks[0].candidates == part.candidates  # stats count the placed chunks only
        full = _with_a_miss(eng, "full", fresh, at).logits
        one = _with_a_miss(eng, "blend", fresh, at, ratio=1.0, **strategy).logits
        assert (one - full).abs().max().item() <= 1e-3, strategy
        if not strategy.get("shift"):
            zero = _with_a_miss(eng, "blend", fresh, at, ratio=0.0, **strategy).logits
            reuse = _with_a_miss(eng, "reuse", fresh, at).logits
            assert (zero - reuse).abs().max().item() <= 1e-3, strategy


def test_question_selection_computes_an_uncached_prompt_prefix_once() -> None:
    # nothing before the first document depends on the documents: the question pass computes
    # it exactly and the second pass leaves it in that pass's cache (it computed it again)
    eng = Engine(make_loaded(num_hidden_layers=3))
    req = Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                  blend=BlendConfig(ratio=0.25, selection="question"))
    layout = eng.layout(req)
    eng.warm(list(layout.docs), eng.chunk_prefix(req, layout))
    st = eng.prepare(req).stats  # the prefix cache is empty
    p, q = len(layout.prefix), len(layout.suffix)
    assert st.prefix_hit_tokens == 0 and p > 0
    assert st.recomputed_per_layer == [p + q + q + round(0.25 * st.candidates)] * 3
    full = eng.prepare(replace(req, method="full")).logits
    assert (eng.prepare(replace(req, blend=BlendConfig(ratio=1.0, selection="question"))).logits - full).abs().max() <= 1e-3


def test_question_selection_recomputes_the_kept_tokens_at_every_layer() -> None:
    eng = Engine(make_loaded(num_hidden_layers=3))
    _logits(eng, "blend")
    eng.flush()
    def stats(ratio: float):
        return eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .",
                                   method="blend", blend=BlendConfig(ratio=ratio, selection="question"))).stats

    forced, kept = stats(0.0).recomputed_per_layer[0], stats(0.25)  # ratio 0: the question pass alone
    # both passes counted; no layer in full
    assert kept.recomputed_per_layer == [forced + forced + round(0.25 * kept.candidates)] * 3


@pytest.mark.parametrize("extra", [{}, {"budget": True, "sinks": 2, "shift": True}])
def test_question_selection_reports_its_selection_like_a_check_layer(extra: dict) -> None:
    # the guard's score band and the per-document stats read stats.checks: question
    # selection fills them as check layer 1 would, with the layer-1 V deviation of the
    # tokens it recomputed (the shift, when on, must not change what is measured)
    eng = Engine(make_loaded(num_hidden_layers=3))
    _logits(eng, "blend")
    eng.flush()
    cfg = BlendConfig(ratio=0.25, **{**PLAIN_STRATEGY, "selection": "question", **extra})
    st = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                             blend=cfg)).stats
    (check,) = st.checks
    assert (check.layer, check.candidates) == (1, st.candidates)
    assert check.selected == round(0.25 * st.candidates) == sum(check.doc_selected)
    assert len(check.doc_selected) == len(DOCS)
    assert all(n >= 2 for n in check.doc_selected) or not extra  # sinks2: every document keeps its first 2
    assert 0.0 < check.mean_score <= check.max_score
    paper = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                                blend=BlendConfig.cacheblend(1.0))).stats.checks[0]
    assert check.max_score <= paper.max_score * (1 + 1e-5)  # a subset of the tokens check layer 1 scores
    every = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend",
                                blend=replace(cfg, ratio=1.0))).stats.checks[0]
    assert every.mean_score == pytest.approx(paper.mean_score, rel=1e-4)  # all tokens: check layer 1's scores
    assert every.max_score == pytest.approx(paper.max_score, rel=1e-4)


def test_method_grammar_names_the_strategies() -> None:
    q = parse_method("blend:0.15:q+budget+sinks4+shift").blend
    assert (q.selection, q.ratio, q.budget, q.sinks, q.shift) == ("question", 0.15, True, 4, True)
    paper = parse_method("cacheblend:0.2").blend
    assert paper == BlendConfig.cacheblend(0.2)
    assert parse_method("cacheblend+prompt").blend.chunk_prefix == "prompt"
    assert parse_method("blend:0.1:oracle").blend.selection == "oracle"
    assert parse_method("blend:0.1:k").blend.selection == "deviation"
    with pytest.raises(ValueError, match="modifier"):
        parse_method("reuse+budget")
    with pytest.raises(ValueError, match="sinksK"):
        parse_method("blend:0.1+sinks")


def test_a_spec_that_names_its_selection_does_not_inherit_the_default_strategy() -> None:
    # the sweep's labels must mean the same after the engine's default changes
    default = BlendConfig(selection="question", budget=True, sinks=4, shift=True)
    assert parse_method("blend:0.3", default).blend == replace(default, ratio=0.3)
    assert parse_method("blend:0.3+prompt", default).blend == replace(default, ratio=0.3, chunk_prefix="prompt")
    q = parse_method("blend:0.15:q", default).blend
    assert (q.selection, q.budget, q.sinks, q.shift) == ("question", False, 0, False)
    assert parse_method("blend:0.15:q+shift", default).blend.budget is False
    assert parse_method("cacheblend:0.15", default).blend == BlendConfig.cacheblend(0.15)
    assert parse_method("cacheblend:0.15+shift", default).blend == replace(BlendConfig.cacheblend(0.15), shift=True)
    at4 = parse_method("blend:0.15@4", default).blend
    assert (at4.selection, at4.check_layers, at4.shift, at4.sinks) == ("deviation", (4,), False, 0)
    assert parse_method("blend:0.15:k", default).blend.selection == "deviation"


def test_the_shift_averages_only_its_uniform_sample() -> None:
    """Residuals of the tokens a selection picked are not averaged when a sample is given:
    a selected outlier must not move the rest of its document."""
    n = 12
    cfg, cos, sin, stale_k, stale_v, cache = _stale_cache(1, n)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    written = torch.tensor([3, 5])  # 3 is the sample; 5 a selected token with a huge residual
    samples = torch.zeros(n, dtype=torch.bool)
    samples[3] = True
    c_v = torch.randn(hkv, 1, d)
    fresh_k = stale_k[:, written].clone()
    fresh_v = stale_v[:, written] + torch.cat([c_v, 1000 * torch.ones(hkv, 1, d)], dim=1)
    ShiftCorrection([(2, 8)], [(cos, sin)], cfg.rope.interleaved, samples)(cache, 0, written, fresh_k, fresh_v)
    moved = torch.tensor([2, 4, 6, 7])
    torch.testing.assert_close(cache.values[0][:, moved], stale_v[:, moved] + c_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.keys[0][:, moved], stale_k[:, moved], atol=1e-5, rtol=1e-5)


def test_the_shift_sample_is_uniform_kept_first_and_at_most_half_the_budget() -> None:
    spans = [(4, 68), (70, 198)]
    n_cand = 64 + 128
    for keep, stride in ((40, 16), (8, 16), (100, 4)):
        mask = shift_samples(spans, 200, keep, n_cand, stride, torch.device("cpu"))
        s = max(stride, -(-2 * n_cand // keep))
        want = [p for a, b in spans for p in range(a + s // 2, b, s)]
        assert mask.nonzero().squeeze(1).tolist() == want
        assert len(want) <= keep // 2 + len(spans)
        positions = torch.tensor([p for a, b in spans for p in range(a, b)])
        scores = torch.rand(positions.shape[0])
        kept = positions[choose(scores, positions, keep, spans, BlendConfig(**{**PLAIN_STRATEGY, "shift": True}), forced=mask)]
        assert set(want) <= set(kept.tolist()) and kept.numel() == keep
    assert not shift_samples(spans, 200, 0, n_cand, 16, torch.device("cpu")).any()


def _shift_by_document(spans, cos, sin, interleaved, keys, values, written, k, v) -> None:
    """The shift written out one document at a time (the definition the batched one keeps)."""
    for a, b in spans:
        rows = ((written >= a) & (written < b)).nonzero().squeeze(1)
        if rows.numel() in (0, b - a):
            continue
        pos = written[rows]
        others = torch.tensor([p for p in range(a, b) if p not in set(pos.tolist())])
        dv = (v[:, rows] - values[:, pos]).mean(dim=1, keepdim=True)
        dk = rope_lib.apply_rope(k[:, rows] - keys[:, pos], cos[pos], -sin[pos], interleaved).mean(dim=1, keepdim=True)
        keys[:, others] += rope_lib.apply_rope(dk.expand(-1, others.numel(), -1).contiguous(), cos[others],
                                               sin[others], interleaved)
        values[:, others] += dv


@pytest.mark.parametrize("interleaved", [False, True])
def test_batched_shift_equals_the_shift_one_document_at_a_time(interleaved: bool) -> None:
    # several documents at once: one partly written, one fully, one not at all, one written
    # token outside every document; the rows are cached per `written` across layers
    cfg = make_loaded().config
    n, hkv, d, layers = 40, cfg.num_kv_heads, cfg.head_dim, 2
    cos, sin = rope_lib.cos_sin(cfg.rope, torch.arange(n))
    spans = [(2, 12), (12, 15), (15, 30), (30, 38)]
    written = torch.tensor([3, 7, 8, 12, 13, 14, 16, 29, 39])  # (30, 38) keeps all its stale K/V
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(layers, hkv, d, n, torch.float32, "cpu")
    want = KVCache(layers, hkv, d, n, torch.float32, "cpu")
    shift = ShiftCorrection(spans, [(cos, sin)] * layers, interleaved)
    for layer in range(layers):
        for a, b in ((cache.keys, want.keys), (cache.values, want.values)):
            a[layer][:] = b[layer][:] = torch.randn(hkv, n, d, generator=gen)
        k, v = torch.randn(hkv, written.numel(), d, generator=gen), torch.randn(hkv, written.numel(), d, generator=gen)
        shift(cache, layer, written, k, v)
        _shift_by_document(spans, cos, sin, interleaved, want.keys[layer], want.values[layer], written, k, v)
        torch.testing.assert_close(cache.keys[layer], want.keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.values[layer], want.values[layer], atol=1e-5, rtol=1e-5)
        assert torch.equal(cache.keys[layer][:, 30:38], want.keys[layer][:, 30:38])  # untouched document


@pytest.mark.parametrize("window", [None, 6])
def test_question_scores_mask_only_what_a_query_cannot_see(window: int | None) -> None:
    # scattered query positions (rows before first_row, e.g. an uncached prefix, are not scored),
    # against softmax over an explicit full mask; with a window every key row is masked
    torch.manual_seed(0)
    hkv, per_kv, d, n = 2, 3, 8, 24
    positions = torch.tensor([0, 1, 9, 10, 11, 18, 20, 21, 22, 23])  # the active rows, ascending
    q, keys, values = torch.randn(hkv * per_kv, positions.numel(), d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    scorer = QuestionScores(n, 5, [window], torch.device("cpu"))
    assert scorer(0, q, keys, values, positions) is None  # rows 0, 1 are not question rows: fusion attends
    rows = positions >= 5
    qq = q[:, rows].reshape(hkv, per_kv * int(rows.sum()), d)
    logits = qq @ keys.transpose(1, 2) / d**0.5
    allowed = causal_mask(positions[rows], torch.arange(n), window).repeat(per_kv, 1)
    want = logits.masked_fill(~allowed, float("-inf")).softmax(-1).sum(dim=(0, 1))
    torch.testing.assert_close(scorer.total, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_question_pass_attention_equals_sdpa_in_blocks_of_rows(window: int | None) -> None:
    # every active row is a question row: the scorer's attention output replaces fusion's, and
    # splitting the rows into blocks (a long question) changes neither scores nor output
    torch.manual_seed(1)
    hkv, per_kv, d, n = 2, 3, 8, 24
    positions = torch.tensor([12, 15, 16, 17, 20, 21, 22, 23])
    q, keys, values = torch.randn(hkv * per_kv, positions.numel(), d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    whole = QuestionScores(n, 5, [window], torch.device("cpu"))
    blocks = QuestionScores(n, 5, [window], torch.device("cpu"), max_elements=2 * hkv * per_kv * n)  # 2 rows
    out, out_blocks = whole(0, q, keys, values, positions), blocks(0, q, keys, values, positions)
    want = attend(q, keys, values, mask=causal_mask(positions, torch.arange(n), window))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_blocks, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(blocks.total, whole.total, atol=1e-6, rtol=1e-6)
    assert abs(float(whole.total.sum()) - hkv * per_kv * positions.numel()) < 1e-4  # each row's weights sum to 1


def test_shiftall_names_the_untested_shift_and_the_default_is_tested() -> None:
    assert BlendConfig().shift_test and not BlendConfig().shift_question
    assert BlendConfig().strategy == "question+budget+sinks4+shift"
    old = parse_method("blend:0.2:q+budget+sinks4+shiftall").blend
    assert old == replace(BlendConfig(), shift_test=False) and old.strategy == "question+budget+sinks4+shiftall"
    both = parse_method("blend:0.2:q+budget+sinks4+shiftq").blend  # also tested on what the question reads
    assert both == replace(BlendConfig(), shift_question=True) and both.strategy == "question+budget+sinks4+shiftq"
    assert parse_method("blend:0.2:q+budget+sinks4+shift").blend == BlendConfig()
