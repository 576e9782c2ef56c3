"""Shared fixtures: tiny random Hugging Face models built in code (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model of ``arch`` (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    kw = dict(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "gemma3":
        kw.update(GEMMA3_TINY)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float().eval()
    if arch == "gemma3":
        _randomize_norms(model)
    return model


# A tiny Gemma 3: local (θ 1e4, window 8) and global (θ 1e6) layers, tied embeddings,
# head_dim 16 with query_pre_attn_scalar 32 (scores scaled by 32^-0.5, not 16^-0.5).
GEMMA3_TINY = dict(
    num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=32, sliding_window=8, tie_word_embeddings=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


def _randomize_norms(model) -> None:
    """Gemma initialises its (1 + w) norm weights w to 0: make them random so that the
    +1 offset and every norm's placement are actually tested."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.fixture
def hf_llama():
    return make_hf_model("llama")


WORDS = (
    "user assistant system the a of and to in is was for on with as by at from that this it be are city river "
    "project led doctor budget approved company headquartered works novel published year "
    "question answer passage who what where when which paris lisbon rome oslo madrid "
    "alpha beta gamma delta blue green red north south east west one two three four five "
    "six seven eight nine ten hello world model cache token layer blend reuse prefix"
).split()
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    """A word-level tokenizer with ChatML specials, built in code (no files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "\n"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + [".", ",", "?", ":"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


def make_loaded(arch: str = "llama", seed: int = 0, **overrides):
    """A LoadedModel of a tiny random model with the tiny tokenizer."""
    from pathlib import Path

    from kvblend.models.config import ModelConfig
    from kvblend.models.loader import LoadedModel, build_model

    tok = make_tokenizer()
    hf = make_hf_model(arch, seed=seed, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, **overrides)
    cfg = ModelConfig.from_hf(hf.config)
    model = build_model(cfg, {k: v.clone() for k, v in hf.state_dict().items()}, "cpu", torch.float32)
    return LoadedModel(f"tiny-{arch}", Path("."), cfg, model, tok, f"tiny-{arch}-{seed}")


@pytest.fixture
def tiny():
    return make_loaded()


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (converted into the model cache on first use)."""
    from kvblend.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_calibrated(smollm2):
    """The default model with its self-check and shift test done here once and stored under
    $KVBLEND_HOME, before a server or replica process on it starts (each would otherwise run
    the shift test, about a minute on 2 cores, at the same time as the others)."""
    from kvblend.engine import Engine

    Engine(smollm2).close()
    return smollm2
