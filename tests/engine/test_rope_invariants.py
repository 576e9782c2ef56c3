"""Fusion's exact invariants for every RoPE type, a sliding window and bf16, on prompts
longer than the type's trained window where it allows that (issue #10, point 3).

blend at ratio 1 == full prefill, blend at ratio 0 == reuse, and the prefix cache is
lossless. Dynamic NTK rotates a prompt past ``max_position_embeddings`` with frequencies
that depend on its length: cached chunk keys (made in a short sequence) must be
un-rotated with their own frequencies and re-rotated with the prompt's, and the prefix
cache, whose KV came from prompts of other lengths, is bypassed (said in the stats).
"""

from __future__ import annotations

import pytest
import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.rope import length_dependent
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

SYSTEM = "answer the question ."
# Each case: model overrides and the dtype. The tiny prompt has 63 tokens; windows are
# chosen below it wherever the RoPE type serves prompts past its window.
CASES = {
    "default": (dict(max_position_embeddings=64), torch.float32),
    "linear": (dict(max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 2.0}), torch.float32),
    "dynamic": (dict(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                torch.float32),
    "llama3": (dict(max_position_embeddings=64, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), torch.float32),
    "yarn": (dict(max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}), torch.float32),
    "mistral-window": (dict(arch="mistral", sliding_window=16), torch.float32),
    "bf16": (dict(), torch.bfloat16),
    "bf16-dynamic": (dict(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                     torch.bfloat16),
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}  # largest |logit| difference allowed


def engine(name: str) -> Engine:
    overrides, dtype = CASES[name]
    loaded = make_loaded(**overrides)
    loaded.model.to(dtype)
    return Engine(loaded)


def prepare(eng: Engine, method: str, docs=DOCS, **blend):
    req = Request(documents=docs, question=QUESTION, system=SYSTEM, method=method, blend=BlendConfig(**blend))
    return eng.prepare(req)


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_blend_invariants_hold_past_the_trained_window(name: str) -> None:
    eng, tol = engine(name), TOL[CASES[name][1]]
    prepare(eng, "blend", DOCS[:1])  # chunks made by other prompts, at their own lengths
    prepare(eng, "blend", DOCS[1:])
    eng.flush()
    full = prepare(eng, "full")
    cfg = eng.loaded.config
    window = cfg.sliding_window or cfg.rope.original_context
    assert full.stats.prompt_tokens > window or cfg.rope.rope_type in ("default", "linear")
    blended, reused = prepare(eng, "blend", ratio=1.0), prepare(eng, "reuse")
    assert all(d.hit for d in blended.stats.docs)
    assert gap(blended.logits, full.logits) <= tol, "blend at ratio 1 must equal full prefill"
    assert gap(prepare(eng, "blend", ratio=0.0).logits, reused.logits) <= tol, "ratio 0 must equal reuse"
    assert gap(reused.logits, full.logits) > tol  # reuse is really approximate: the checks can fail


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefix_cache_stays_lossless_past_the_trained_window(name: str) -> None:
    eng, tol = engine(name), TOL[CASES[name][1]]
    prepare(eng, "prefix", DOCS[:1])  # a shorter prompt sharing the system prompt and first document
    hit = prepare(eng, "prefix")
    assert gap(hit.logits, prepare(eng, "full").logits) <= tol
    past = length_dependent(eng.loaded.config.rope, hit.stats.prompt_tokens)
    assert hit.stats.fallback == ("dynamic-rope" if past else None)
    assert (hit.stats.prefix_hit_tokens == 0) == past
    assert prepare(eng, "blend").stats.fallback == ("dynamic-rope" if past else None)
