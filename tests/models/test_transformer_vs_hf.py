"""Our transformer against transformers' on the same weights: logits and greedy text."""

from __future__ import annotations

import pytest
import torch

from kvblend.models.config import ModelConfig
from kvblend.models.loader import build_model
from tests.conftest import make_hf_model

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "qwen2": ("qwen2", {"rope_theta": 1e6}),
    "mistral-window": ("mistral", {"sliding_window": 16}),
    "rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    "rope-dynamic": ("llama", {"max_position_embeddings": 32,
                               "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
    "rope-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 5e5}}),
    "rope-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}}),
    # Gemma 3 (tests.conftest.GEMMA3_TINY): local/global layers, window 8 < 64 tokens, q/k
    # and sandwich norms with random (1 + w) weights, query_pre_attn_scalar != head_dim.
    "gemma3": ("gemma3", {}),
    "gemma3-linear-mqa-softcap": ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                             "num_key_value_heads": 1, "final_logit_softcapping": 3.0}),
}


def ours_from_hf(hf_model):
    cfg = ModelConfig.from_hf(hf_model.config)
    return build_model(cfg, hf_model.state_dict(), "cpu", torch.float32)


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0])
    return model(ids, cache, logits_for="all")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(name: str) -> None:
    arch, overrides = VARIANTS[name]
    hf = make_hf_model(arch, **overrides)
    ours = ours_from_hf(hf)
    ids = torch.randint(3, hf.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = our_logits(ours, ids)
    assert (got - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "rope-yarn", "mistral-window", "gemma3"])
def test_greedy_continuation_matches_transformers(name: str) -> None:
    from kvblend.generation import SamplingParams, generate_ids

    arch, overrides = VARIANTS[name]
    hf = make_hf_model(arch, eos_token_id=None, **overrides)  # no EOS: both run all 32 steps
    ours = ours_from_hf(hf)
    prompt = torch.randint(3, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, 12:]
    got = generate_ids(ours, prompt.tolist(), SamplingParams(max_tokens=32, ignore_eos=True))
    assert got == ref.tolist()


def test_decode_matches_fresh_forward_each_step() -> None:
    hf = make_hf_model("llama", num_key_value_heads=1)
    ours = ours_from_hf(hf)
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(3))
    cache = ours.new_cache(4)  # forces the cache to grow during decode
    ours(ids[:8], cache)
    for t in range(8, 20):
        step = ours(ids[t : t + 1], cache)[0]
        fresh = our_logits(ours, ids[: t + 1])[-1]
        assert torch.allclose(step, fresh, atol=1e-4), t
    assert cache.length == 20


def test_unknown_architecture_is_a_clear_error() -> None:
    from transformers import GPT2Config

    from kvblend.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf(GPT2Config())


def test_prompt_longer_than_context_is_a_clear_error() -> None:
    from kvblend.errors import ContextLengthError

    ours = ours_from_hf(make_hf_model("llama", max_position_embeddings=16))
    with pytest.raises(ContextLengthError, match="16"):
        our_logits(ours, torch.arange(3, 23))
