"""Fusion invariants on the real default model, with short documents."""

from __future__ import annotations

import pytest

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.store import StoreConfig, build_store

DOCS = [
    "Hannibal and Scipio is a tragedy by Thomas Nabbes, first performed in 1635 by Queen Henrietta's Men.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford, and lived in London.",
    "Queen Henrietta's Men was a playing company of the Caroline era, formed in 1625 at the Cockpit Theatre.",
]
QUESTION = "Where was the author of Hannibal and Scipio educated?"


def warm_engine(loaded, kv_dtype: str | None) -> Engine:
    """An engine whose memory store holds DOCS' chunks, after both chunk prefixes
    (``kv_dtype`` None: the default storage, fp16)."""
    store = None if kv_dtype is None else build_store(StoreConfig(tiers=("memory",), kv_dtype=kv_dtype))
    eng = Engine(loaded, store=store)
    for prefix_mode in ("bos", "prompt"):
        eng.prepare(Request(documents=DOCS, question=QUESTION, blend=BlendConfig(chunk_prefix=prefix_mode)))
    eng.flush()
    return eng


@pytest.fixture(scope="module")
def engine(smollm2):
    """fp32 storage: the invariants below are exact up to float arithmetic only."""
    return warm_engine(smollm2, "fp32")


@pytest.fixture(scope="module")
def default_engine(smollm2):
    return warm_engine(smollm2, None)


def logits(engine: Engine, method: str, docs=DOCS, **blend):
    return engine.prepare(Request(documents=docs, question=QUESTION, method=method, blend=BlendConfig(**blend)))


def test_ratio_one_is_full_prefill(engine: Engine) -> None:
    full = logits(engine, "full").logits
    blended = logits(engine, "blend", ratio=1.0)
    assert all(d.hit for d in blended.stats.docs)
    assert (blended.logits - full).abs().max().item() <= 1e-3


def test_ratio_one_is_full_prefill_with_kv_stored_in_fp16(default_engine: Engine) -> None:
    """The default storage (fp16) loses nothing a full recompute needs."""
    assert default_engine.kv_dtype == "fp16"
    full = logits(default_engine, "full").logits
    blended = logits(default_engine, "blend", ratio=1.0)
    assert all(d.source == "memory" for d in blended.stats.docs)
    assert (blended.logits - full).abs().max().item() <= 1e-3
    assert (logits(default_engine, "reuse").logits - full).abs().max().item() > 1e-2  # the stored KV is used


def test_ratio_zero_is_full_reuse(engine: Engine) -> None:
    reuse = logits(engine, "reuse").logits
    assert (logits(engine, "blend", ratio=0.0).logits - reuse).abs().max().item() <= 1e-3


def test_reordered_documents_all_hit(engine: Engine) -> None:
    stats = logits(engine, "blend", docs=[DOCS[2], DOCS[0], DOCS[1]]).stats
    assert [d.hit for d in stats.docs] == [True, True, True]


def test_first_document_after_its_own_prefix_needs_no_correction(engine: Engine) -> None:
    full = logits(engine, "full", docs=DOCS[:1]).logits
    reused = logits(engine, "blend", docs=DOCS[:1], ratio=0.0, chunk_prefix="prompt")
    assert reused.stats.docs[0].hit
    assert (reused.logits - full).abs().max().item() <= 1e-3


def test_blend_is_closer_to_full_than_reuse(engine: Engine) -> None:
    import torch

    full = torch.log_softmax(logits(engine, "full").logits, -1)

    def kl(method: str, **kw) -> float:
        other = torch.log_softmax(logits(engine, method, **kw).logits, -1)
        return float((full.exp() * (full - other)).sum())

    assert kl("blend", ratio=0.5) < kl("reuse")


def test_rerotated_layer0_keys_equal_keys_computed_at_the_target_position(engine: Engine) -> None:
    """Layer-0 K/V depend only on a token and its position, so the cached, re-rotated
    layer-0 keys of a moved document must equal a full prefill's keys there."""
    docs = [DOCS[2], DOCS[0], DOCS[1]]  # every document away from where it was computed
    reused = logits(engine, "reuse", docs=docs)
    full = logits(engine, "full", docs=docs)
    start, end = reused.layout.doc_starts[0], len(reused.layout) - len(reused.layout.suffix)
    assert start > 1 and all(d.hit for d in reused.stats.docs)
    k_moved, v_moved = reused.cache.view(0, end)
    k_full, v_full = full.cache.view(0, end)
    assert (k_moved[:, start:] - k_full[:, start:]).abs().max().item() < 1e-4
    assert (v_moved[:, start:] - v_full[:, start:]).abs().max().item() < 1e-4
    assert (reused.cache.view(1, end)[1][:, start:] - full.cache.view(1, end)[1][:, start:]).abs().max() > 1e-3
