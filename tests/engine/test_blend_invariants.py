"""The exact invariants of fusion, on a tiny random model: ratio 1 == full prefill,
ratio 0 == full reuse, a document at its computed position needs no correction.
The first three hold on every model family: Mistral's sliding window and Gemma 3's
local/global layers (windows shorter than the prompt) and Llama 3 RoPE scaling."""

from __future__ import annotations

import pytest
import torch

from kvblend.blend.config import PLAIN_STRATEGY, BlendConfig
from kvblend.engine import Engine, PrefixCache, Request
from kvblend.errors import ContextLengthError, InvalidRequestError
from kvblend.store import StoreConfig, build_store
from tests.conftest import make_loaded

DOCS = [
    "the city of paris is blue . the river was red and the project led to rome .",
    "doctor alpha works in lisbon . the company headquartered in oslo was green .",
    "the novel published in year one was about madrid and the north river .",
]
QUESTION = "which city is blue ?"
FAMILIES = {
    "llama": {},
    "qwen2": {"arch": "qwen2"},
    "mistral-window": {"arch": "mistral", "sliding_window": 16},
    "llama3-rope": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                        "rope_theta": 5e5}},
    "gemma3": {"arch": "gemma3"},
}


def engine(kv_dtype: str | None = None, **kw) -> Engine:
    """An engine on a tiny model; ``kv_dtype``: its memory store's storage dtype (None: the default, fp16)."""
    store = None if kv_dtype is None else build_store(StoreConfig(tiers=("memory",), kv_dtype=kv_dtype))
    return Engine(make_loaded(**kw), store=store)


def logits(eng: Engine, method: str, docs=DOCS, **blend) -> torch.Tensor:
    req = Request(documents=docs, question=QUESTION, system="answer the question .", method=method,
                  blend=BlendConfig(**blend))
    return eng.prepare(req).logits


def warmed(eng: Engine, docs=DOCS, **blend) -> Engine:
    logits(eng, "blend", docs, **blend)  # first call: misses are computed and written back
    eng.flush()
    return eng


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ratio_one_reproduces_full_prefill(family: str) -> None:
    eng = warmed(engine(**FAMILIES[family]))  # KV stored in the default dtype, fp16
    assert eng.kv_dtype == "fp16"
    full = logits(eng, "full")
    blended = logits(eng, "blend", ratio=1.0)
    assert (blended - full).abs().max().item() <= 1e-3


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "int8"])
def test_ratio_one_reproduces_full_prefill_whatever_the_storage_dtype(kv_dtype: str) -> None:
    """Every token recomputed: what the stored KV lost to rounding never reaches the logits,
    while reuse of the same stored KV does differ from full prefill."""
    eng = warmed(engine(kv_dtype))
    assert [d.source for d in eng.prepare(Request(documents=DOCS, question=QUESTION)).stats.docs] == ["memory"] * 3
    full = logits(eng, "full")
    assert (logits(eng, "blend", ratio=1.0) - full).abs().max().item() <= 1e-3
    # the paper's selection too: its layer 0 reads no stored K/V that rounding changed
    assert (logits(eng, "blend", ratio=1.0, selection="deviation") - full).abs().max().item() <= 1e-4
    assert (logits(eng, "reuse") - full).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ratio_zero_reproduces_full_reuse(family: str) -> None:
    eng = warmed(engine(**FAMILIES[family]))
    reuse = logits(eng, "reuse")
    blended = logits(eng, "blend", ratio=0.0)
    assert (blended - reuse).abs().max().item() <= 1e-3
    assert (reuse - logits(eng, "full")).abs().max().item() > 1e-3  # reuse really is approximate


def test_progressive_schedule_at_ratio_one_is_still_exact() -> None:
    eng = warmed(engine(num_hidden_layers=4))
    full = logits(eng, "full")
    blended = logits(eng, "blend", check_layers=(1, 2), schedule=(1.0, 1.0))
    assert (blended - full).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_single_document_at_its_computed_position_needs_no_recompute(family: str) -> None:
    eng = warmed(engine("fp32", **FAMILIES[family]), docs=DOCS[:1], chunk_prefix="prompt")  # exact storage
    full = logits(eng, "full", docs=DOCS[:1])
    reused = logits(eng, "blend", docs=DOCS[:1], ratio=0.0, chunk_prefix="prompt")
    assert (reused - full).abs().max().item() <= 1e-3


def test_all_misses_are_computed_in_full() -> None:
    eng = engine()
    first = logits(eng, "blend", ratio=0.0, recompute_misses=True)  # nothing cached: every document recomputed
    assert (first - logits(eng, "full")).abs().max().item() <= 1e-3


@pytest.mark.parametrize("kv_dtype,tol", [("fp32", 1e-4), ("fp16", 3e-3)])
def test_a_miss_computed_alone_is_the_blend_a_warm_store_gives(kv_dtype: str, tol: float) -> None:
    """The default: a missed document is computed alone, stored and blended, so the first
    request gets the blend every later request gets (and no exact prefix is cached past the
    first document: the second request reads the store, not the prefix cache): exactly with
    fp32 storage; with fp16 (the default) up to the stored KV's rounding, which the first
    request, blending the KV it just computed, does not see."""
    eng = engine(kv_dtype)
    first = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend"))
    assert [d.source for d in first.stats.docs] == ["chunk"] * len(DOCS)
    again = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .", method="blend"))
    assert [d.source for d in again.stats.docs] == ["memory"] * len(DOCS)
    assert (first.logits - again.logits).abs().max().item() <= tol


def test_no_documents_is_a_plain_prefill() -> None:
    eng = engine()
    assert (logits(eng, "blend", docs=[]) - logits(eng, "full", docs=[])).abs().max().item() <= 1e-3


def test_prefix_method_reuses_an_exact_prefix_losslessly() -> None:
    eng = engine()
    logits(eng, "prefix")
    req = Request(documents=DOCS, question="where is the river ?", system="answer the question .", method="prefix")
    prepared = eng.prepare(req)
    assert prepared.stats.prefix_hit_tokens > sum(len(d.split()) for d in DOCS)
    full = eng.prepare(Request(documents=DOCS, question="where is the river ?", system="answer the question .",
                               method="full")).logits
    assert (prepared.logits - full).abs().max().item() <= 1e-3


def test_selection_counts_follow_the_schedule() -> None:
    eng = warmed(engine(num_hidden_layers=5), check_layers=(1, 3), schedule=(0.5, 0.2))
    stats = eng.prepare(Request(documents=DOCS, question=QUESTION, system="answer the question .",
                                blend=BlendConfig(check_layers=(1, 3), schedule=(0.5, 0.2), **PLAIN_STRATEGY))).stats
    n_cand, forced = stats.candidates, stats.recomputed_per_layer[-1] - round(0.2 * stats.candidates)
    assert stats.recomputed_per_layer[1] == forced + round(0.5 * n_cand)
    assert stats.recomputed_per_layer[3] == forced + round(0.2 * n_cand)
    assert stats.recomputed_per_layer[0] > stats.recomputed_per_layer[1] >= stats.recomputed_per_layer[2]
    assert stats.recomputed_per_layer[2] > stats.recomputed_per_layer[3] == stats.recomputed_per_layer[4]


def test_bad_ratio_and_overlong_prompt_are_clear_errors() -> None:
    with pytest.raises(InvalidRequestError, match=r"\[0, 1\]"):
        BlendConfig(ratio=1.5)
    eng = engine(max_position_embeddings=40)
    with pytest.raises(ContextLengthError, match="40"):
        logits(eng, "blend")


def test_prefix_cache_is_byte_capped() -> None:
    eng = Engine(make_loaded(), prefix_cache=PrefixCache(max_bytes=1))
    logits(eng, "prefix")
    assert eng.prefix_cache.stats()["bytes"] == 0


def test_check_layer_beyond_the_model_is_rejected() -> None:
    eng = engine()  # two layers
    with pytest.raises(InvalidRequestError, match="below the model's 2 layers"):
        logits(eng, "blend", check_layers=(2,))


# ----- documents inside the messages' text, with text between them ---------------------------
def _inline_request(method: str, **blend) -> Request:
    """DOCS[0] in the system message, DOCS[1] and DOCS[2] in the user turn with text
    around and between them: every document placed where it stands."""
    from kvblend.blend.layout import DocPlace

    system = f"answer the question . {DOCS[0]}"
    user = f"document one : {DOCS[1]} then document two : {DOCS[2]} so {QUESTION}"
    places = [DocPlace(0, len(system) - len(DOCS[0]), len(system)),
              DocPlace(1, user.index(DOCS[1]), user.index(DOCS[1]) + len(DOCS[1])),
              DocPlace(1, user.index(DOCS[2]), user.index(DOCS[2]) + len(DOCS[2]))]
    return Request(documents=DOCS, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                   placement=places, method=method, blend=BlendConfig(**blend))


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])
def test_documents_between_text_keep_both_invariants(family: str) -> None:
    eng = Engine(make_loaded(**FAMILIES[family]), prefix_cache=PrefixCache(0))  # the store, not an exact prompt, serves
    first = eng.prepare(_inline_request("blend", ratio=0.0, recompute_misses=True))
    assert eng.layout(_inline_request("full")).gaps  # text between the documents
    assert [d.source for d in first.stats.docs] == ["computed"] * 3
    eng.flush()
    full = eng.prepare(_inline_request("full")).logits
    assert (first.logits - full).abs().max().item() <= 1e-3  # every document missed: computed in full
    at_one = eng.prepare(_inline_request("blend", ratio=1.0))
    assert all(d.hit for d in at_one.stats.docs)
    assert (at_one.logits - full).abs().max().item() <= 1e-3
    reuse = eng.prepare(_inline_request("reuse")).logits
    assert (eng.prepare(_inline_request("blend", ratio=0.0)).logits - reuse).abs().max().item() <= 1e-3
    assert (reuse - full).abs().max().item() > 1e-3


def test_documents_between_text_under_question_selection() -> None:
    eng = engine(num_hidden_layers=3)
    eng.prepare(_inline_request("blend", ratio=0.0))
    eng.flush()
    full = eng.prepare(_inline_request("full")).logits
    at_one = eng.prepare(_inline_request("blend", ratio=1.0, selection="question")).logits
    assert (at_one - full).abs().max().item() <= 1e-3
