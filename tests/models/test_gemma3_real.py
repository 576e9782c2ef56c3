"""Gemma 3 270M (packaged `gemma3-270m`, `make gemma`): our runtime against transformers
on the same converted weights, and the blend invariants on prompts longer than its
512-token sliding window. Marked ``gemma`` (run by `make test-gemma` / `make test-slow`).

Measured against transformers fp32 (2-core CPU): ~6e-5 max |Δlogit| on 64 tokens,
up to ~3e-4 at positions 600-700 (logits up to ~30). The gap is transformers' side:
it computes RoPE angles in float32 (ours are float64) and its Gemma norms in float32;
in float64 with its float32 angles substituted, the gap falls to ~3e-5."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch

from kvblend import rope as rope_lib
from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.eval.datasets import format_musique_passage, musique_query
from kvblend.generation import SamplingParams, generate_ids

pytestmark = pytest.mark.gemma

SAMPLE = json.loads(files("kvblend.data").joinpath("musique_sample.json").read_text())[0]
DOCS = [format_musique_passage(c["title"], c["text"]) for c in SAMPLE["ctxs"][:2]]  # ~550 tokens each
QUESTION = musique_query(SAMPLE["question"])


@pytest.fixture(scope="module")
def gemma3():
    from kvblend.models import load_model

    return load_model("gemma3-270m", decode_weights="fp32")  # the reference path: its greedy text against transformers


@pytest.fixture(scope="module")
def hf(gemma3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma3.folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(gemma3):
    from kvblend.store.config import StoreConfig, build_store

    eng = Engine(gemma3, store=build_store(StoreConfig(kv_dtype="fp32")))  # the exact invariants: lossless storage
    for prefix_mode in ("bos", "prompt"):
        eng.prepare(Request(documents=DOCS, question=QUESTION, blend=BlendConfig(chunk_prefix=prefix_mode)))
    eng.flush()
    return eng


def long_ids(gemma3, n: int = 704) -> list[int]:
    return gemma3.tokenizer("".join(DOCS) + QUESTION)["input_ids"][:n]


def test_structure_is_gemma3_with_local_and_global_layers(gemma3) -> None:
    cfg = gemma3.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert [i for i in range(18) if cfg.layer_window(i) is None] == [5, 11, 17]
    assert {cfg.layer_rope(i).theta for i in range(18)} == {1e4, 1e6} and cfg.sliding_window == 512
    assert not getattr(gemma3.tokenizer, "chat_template", None)  # a base model: plain prompts


def test_logits_and_greedy_text_match_transformers(gemma3, hf) -> None:
    ids = long_ids(gemma3)[:64]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ref_gen = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    ours = gemma3.model(torch.tensor(ids), gemma3.model.new_cache(len(ids)), logits_for="all")
    assert (ours - ref).abs().max().item() <= 2e-4
    assert generate_ids(gemma3.model, ids, SamplingParams(max_tokens=24, ignore_eos=True)) == ref_gen


def test_logits_past_the_sliding_window_match_transformers(gemma3, hf) -> None:
    ids = long_ids(gemma3)
    assert len(ids) > 512 + 64
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), logits_to_keep=64).logits[0]
    cache = gemma3.model.new_cache(len(ids))
    gemma3.model(torch.tensor(ids[:-64]), cache, logits_for="none")
    ours = gemma3.model(torch.tensor(ids[-64:]), cache, logits_for="all")  # continues the cache
    assert (ours - ref).abs().max().item() <= 1e-3


def test_rerotated_keys_equal_keys_at_the_target_position_per_layer(gemma3) -> None:
    model = gemma3.model
    h = torch.randn(8, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    src, dst = torch.arange(10, 18), torch.arange(700, 708)
    for layer in model.layers:
        k_src, _ = layer.project_kv(h, *rope_lib.cos_sin(layer.rope, src))
        k_dst, _ = layer.project_kv(h, *rope_lib.cos_sin(layer.rope, dst))
        assert (rope_lib.rotate(k_src, 690, layer.rope) - k_dst).abs().max().item() <= 1e-4


def logits(engine: Engine, method: str, docs=DOCS, **blend):
    return engine.prepare(Request(documents=docs, question=QUESTION, method=method, blend=BlendConfig(**blend)))


def test_ratio_one_is_full_prefill_past_the_window(engine: Engine) -> None:
    full = logits(engine, "full")
    assert len(full.layout) > 512
    blended = logits(engine, "blend", ratio=1.0)
    assert all(d.hit for d in blended.stats.docs)
    assert (blended.logits - full.logits).abs().max().item() <= 1e-3


def test_ratio_zero_is_full_reuse(engine: Engine) -> None:
    reuse = logits(engine, "reuse").logits
    assert (logits(engine, "blend", ratio=0.0).logits - reuse).abs().max().item() <= 1e-3
    assert (reuse - logits(engine, "full").logits).abs().max().item() > 1e-3  # documents moved


def test_first_document_after_its_own_prefix_needs_no_correction(engine: Engine) -> None:
    full = logits(engine, "full", docs=DOCS[:1]).logits
    reused = logits(engine, "blend", docs=DOCS[:1], ratio=0.0, chunk_prefix="prompt")
    assert reused.stats.docs[0].hit
    assert (reused.logits - full).abs().max().item() <= 1e-3
