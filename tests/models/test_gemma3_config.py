"""Gemma 3's config adapter: per-layer RoPE and windows from v5 and v4 config.json forms,
and the variants kvblend refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvblend.errors import UnsupportedModelError
from kvblend.models.config import ModelConfig
from tests.conftest import make_hf_model

V4_JSON = dict(  # a gemma-3 config.json as transformers 4.x wrote it (no layer_types)
    model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
    rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
    sliding_window=8, sliding_window_pattern=6, query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
)


def test_v5_config_gives_each_layer_its_rope_and_window() -> None:
    cfg = ModelConfig.from_hf(make_hf_model("gemma3").config)
    assert cfg.arch == "gemma3" and cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norm
    assert [cfg.layer_window(i) for i in range(3)] == [8, None, 8]
    assert [cfg.layer_rope(i).theta for i in range(3)] == [1e4, 1e6, 1e4]
    assert cfg.query_scale == pytest.approx(32 ** -0.5) and cfg.embed_scale == pytest.approx(8.0)


def test_v4_config_json_reads_the_local_base_and_the_window_pattern() -> None:
    cfg = ModelConfig.from_hf(SimpleNamespace(**V4_JSON))
    assert [cfg.layer_window(i) for i in range(7)] == [8, 8, 8, 8, 8, None, 8]
    glob, local = cfg.layer_rope(5), cfg.layer_rope(0)
    assert (glob.theta, glob.rope_type, glob.factor) == (1e6, "linear", 8.0)
    assert (local.theta, local.rope_type, local.factor) == (1e4, "default", 1.0)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0}, "softcapping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"model_type": "gemma3"}, "gemma3_text"),
])
def test_unsupported_gemma_variants_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(SimpleNamespace(**{**V4_JSON, **change}))
