"""Fusion with per-layer RoPE and sliding windows (tiny Gemma 3: local layers θ 1e4 with
a window of 8, global layers θ 1e6; every prompt here is longer than the window).

Exact invariants: re-rotated keys equal keys computed at the target position, layer by
layer with each layer's own RoPE; ratio 1 rebuilds the full prefill's cache; a cached
document at its own position needs no correction; layer 0's fused keys equal the full
prefill's wherever the documents moved (layer-0 K depends only on token and position)."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from kvblend import rope as rope_lib
from kvblend.blend.chunks import compute_chunk_kv
from kvblend.blend.fusion import FusionPlan, PlacedChunk, fuse
from tests.conftest import make_loaded

LOCAL_FIRST = ("sliding_attention", "full_attention", "sliding_attention")
GLOBAL_FIRST = ("full_attention", "sliding_attention", "sliding_attention")
PREFIX = [1]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 80, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOCS = [ids(19, 1), ids(23, 2), ids(13, 3)]
QUESTION = ids(6, 4)


@lru_cache(maxsize=None)
def gemma(layer_types: tuple[str, ...] = LOCAL_FIRST):
    """Read-only tiny models, built once per layer pattern for this module."""
    return make_loaded("gemma3", layer_types=list(layer_types)).model


def prompt(docs) -> tuple[torch.Tensor, list[int]]:
    """The prompt's ids and each document's start."""
    starts, pos = [], len(PREFIX)
    for d in docs:
        starts.append(pos)
        pos += len(d)
    return torch.tensor(PREFIX + [t for d in docs for t in d] + QUESTION), starts


def fused(model, docs, **plan):
    full_ids, starts = prompt(docs)
    placed = [PlacedChunk(s, compute_chunk_kv(model, PREFIX, d)) for s, d in zip(starts, docs)]
    return fuse(model, FusionPlan(ids=full_ids, placed=placed, **plan))


def full_prefill(model, docs):
    full_ids, _ = prompt(docs)
    cache = model.new_cache(full_ids.shape[0])
    logits = model(full_ids, cache, logits_for="last")[0]
    return cache, logits


def test_rerotated_keys_equal_keys_at_the_target_position_per_layer() -> None:
    model = gemma()
    h = torch.randn(11, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    src, dst = torch.arange(3, 14), torch.arange(40, 51)
    for layer in model.layers:
        k_src, _ = layer.project_kv(h, *rope_lib.cos_sin(layer.rope, src))
        k_dst, _ = layer.project_kv(h, *rope_lib.cos_sin(layer.rope, dst))
        assert torch.allclose(rope_lib.rotate(k_src, 37, layer.rope), k_dst, atol=1e-5)
        other = model.cfg.rope if layer.rope is model.cfg.rope_local else model.cfg.rope_local
        assert (rope_lib.rotate(k_src, 37, other) - k_dst).abs().max() > 1e-2  # the base matters


@pytest.mark.parametrize("layer_types", [LOCAL_FIRST, GLOBAL_FIRST], ids=["local-first", "global-first"])
def test_fused_layer0_keys_equal_the_full_prefill_keys(layer_types) -> None:
    model = gemma(layer_types)
    docs = DOCS[::-1]  # every document away from where its chunk was computed but the first
    out = fused(model, docs, ratios=(0.0,), select_from_start=True)
    cache, _ = full_prefill(model, docs)
    n = cache.length
    assert torch.allclose(out.cache.keys[0][:, :n], cache.keys[0][:, :n], atol=1e-5)
    assert torch.allclose(out.cache.values[0][:, :n], cache.values[0][:, :n], atol=1e-5)


def test_ratio_one_rebuilds_the_full_prefill_cache_past_the_window() -> None:
    model = gemma()
    out = fused(model, DOCS, ratios=(1.0,))
    cache, logits = full_prefill(model, DOCS)
    assert cache.length > 5 * model.cfg.sliding_window
    for layer in range(model.cfg.num_layers):
        assert torch.allclose(out.cache.keys[layer][:, : cache.length], cache.keys[layer][:, : cache.length], atol=1e-4)
        assert torch.allclose(out.cache.values[layer][:, : cache.length], cache.values[layer][:, : cache.length],
                              atol=1e-4)
    assert (out.logits - logits).abs().max().item() <= 1e-3


@pytest.mark.parametrize("layer_types", [LOCAL_FIRST, GLOBAL_FIRST], ids=["local-first", "global-first"])
def test_a_document_at_its_own_position_is_exact_past_the_window(layer_types) -> None:
    model = gemma(layer_types)
    doc = [ids(29, 6)]  # longer than the window on its own
    out = fused(model, doc, ratios=(0.0,), select_from_start=True)
    _, logits = full_prefill(model, doc)
    assert (out.logits - logits).abs().max().item() <= 1e-3


def test_moved_documents_make_reuse_approximate() -> None:
    model = gemma()
    _, logits = full_prefill(model, DOCS)
    reuse = fused(model, DOCS, ratios=(0.0,), select_from_start=True).logits
    assert (reuse - logits).abs().max().item() > 1e-3  # cross-document attention is missing
