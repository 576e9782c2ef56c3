"""Shared fixtures: tiny random Hugging Face models built in code (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model of ``arch`` (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    kw = dict(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float().eval()
    return model


@pytest.fixture
def hf_llama():
    return make_hf_model("llama")
