"""RoPE: frequencies against transformers, and the exact position-shift identity."""

from __future__ import annotations

import math

import pytest
import torch

from kvblend.rope import (RopeConfig, apply_rope, attention_scaling, cos_sin, inv_freq, length_dependent,
                          reposition_tables, rotate)

CONFIGS = {
    "default": RopeConfig(head_dim=64, theta=1e5, max_position_embeddings=8192),
    "linear": RopeConfig(head_dim=64, rope_type="linear", factor=4.0, max_position_embeddings=8192),
    "dynamic": RopeConfig(head_dim=64, rope_type="dynamic", factor=2.0, max_position_embeddings=8192),
    "llama3": RopeConfig(head_dim=64, theta=5e5, rope_type="llama3", factor=8.0,
                         original_max_position_embeddings=1024, max_position_embeddings=8192),
    "yarn": RopeConfig(head_dim=64, rope_type="yarn", factor=4.0,
                       original_max_position_embeddings=2048, max_position_embeddings=8192),
    "partial": RopeConfig(head_dim=64, partial_rotary_factor=0.5, max_position_embeddings=8192),
    "interleaved": RopeConfig(head_dim=64, interleaved=True, max_position_embeddings=8192),
    "partial-interleaved-yarn": RopeConfig(head_dim=64, partial_rotary_factor=0.25, interleaved=True,
                                           rope_type="yarn", factor=2.0, original_max_position_embeddings=1024,
                                           max_position_embeddings=8192),
}


def rope_at(k: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    cos, sin = cos_sin(cfg, positions, k.dtype, seq_len=cfg.max_position_embeddings)
    return apply_rope(k, cos, sin, cfg.interleaved)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rotate_moves_keys_exactly(name: str) -> None:
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 50, 64, generator=g)
    start = torch.randint(0, 4000, (), generator=g).item()
    positions = torch.arange(start, start + 50)
    for delta in (0, 1, 517, cfg.max_position_embeddings - start - 60, -start):
        moved = rotate(rope_at(k, positions, cfg), delta, cfg, seq_len=cfg.max_position_embeddings)
        direct = rope_at(k, positions + delta, cfg)
        assert (moved - direct).abs().max().item() < 2e-5, (name, delta)


def test_rotate_accepts_per_token_offsets() -> None:
    cfg = CONFIGS["default"]
    k = torch.randn(2, 10, 64)
    pos = torch.arange(10)
    deltas = torch.arange(10) * 7
    moved = rotate(rope_at(k, pos, cfg), deltas, cfg)
    assert torch.allclose(moved, rope_at(k, pos + deltas, cfg), atol=2e-5)


def rope_in(k: torch.Tensor, start: int, seq_len: int, cfg: RopeConfig) -> torch.Tensor:
    """k rotated at positions start.. inside a sequence of seq_len tokens."""
    cos, sin = cos_sin(cfg, torch.arange(start, start + k.shape[-2]), k.dtype, seq_len=seq_len)
    return apply_rope(k, cos, sin, cfg.interleaved)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reposition_moves_keys_between_sequence_lengths(name: str) -> None:
    cfg = CONFIGS[name]
    k = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    long = cfg.max_position_embeddings * 3 // 2  # past the window: dynamic NTK rescales
    for old, new in (((1, 41), (5000, long)), ((3, 43), (3, long)), ((7, 100), (900, 2000))):
        made, want = rope_in(k, *old, cfg), rope_in(k, *new, cfg)
        tables = reposition_tables(cfg, 40, old, new)  # None: the keys are already there
        moved = made if tables is None else apply_rope(made, *tables, cfg.interleaved)
        assert (moved - want).abs().max().item() < 2e-5, (name, old, new)
    assert reposition_tables(cfg, 40, (3, 43), (3, 50)) is None
    assert (reposition_tables(cfg, 40, (3, 43), (3, long)) is None) == (cfg.rope_type != "dynamic")


def test_dynamic_keys_from_a_short_sequence_need_more_than_a_shift() -> None:
    cfg = CONFIGS["dynamic"]
    long = cfg.max_position_embeddings + 4000
    assert length_dependent(cfg, long) and not length_dependent(cfg, cfg.max_position_embeddings)
    k = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(2))
    shifted = rotate(rope_in(k, 1, 31, cfg), 6000, cfg)
    assert (shifted - rope_in(k, 6001, long, cfg)).abs().max().item() > 0.1
    for other in ("default", "linear", "llama3", "yarn"):
        assert not length_dependent(CONFIGS[other], long)


def test_partial_rotary_leaves_tail_untouched() -> None:
    cfg = CONFIGS["partial"]
    k = torch.randn(1, 5, 64)
    out = rope_at(k, torch.arange(100, 105), cfg)
    assert torch.equal(out[..., 32:], k[..., 32:])
    assert not torch.allclose(out[..., :32], k[..., :32])


def test_interleaved_matches_complex_rotation() -> None:
    cfg = CONFIGS["interleaved"]
    k = torch.randn(1, 4, 64, dtype=torch.float64)
    pos = torch.tensor([0, 3, 99, 2000])
    out = rope_at(k, pos, cfg)
    pairs = torch.view_as_complex(k.reshape(1, 4, 32, 2).contiguous())
    angle = pos[:, None].double() * inv_freq(cfg)[None, :]
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).reshape(1, 4, 64)
    assert torch.allclose(out, expected, atol=1e-10)


def test_half_split_matches_rotate_half_reference() -> None:
    cfg = CONFIGS["default"]
    k = torch.randn(2, 6, 64, dtype=torch.float64)
    pos = torch.arange(6) * 11
    ang = pos[:, None].double() * inv_freq(cfg)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rotate_half = torch.cat((-k[..., 32:], k[..., :32]), -1)
    assert torch.allclose(rope_at(k, pos, cfg), k * cos + rotate_half * sin, atol=1e-10)


HF_PARAMS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
}


@pytest.mark.parametrize("name", sorted(HF_PARAMS))
def test_frequencies_match_transformers(name: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvblend.models.config import ModelConfig

    params = {"rope_theta": 1e4, **HF_PARAMS[name]}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, rope_parameters=params)
    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu", seq_len=10000)
    ours = ModelConfig.from_hf(hf).rope
    assert torch.allclose(inv_freq(ours, seq_len=10000).float(), ref, rtol=1e-5)
    assert math.isclose(attention_scaling(ours), ref_scale, rel_tol=1e-6)


def test_unsupported_rope_type_is_a_clear_error() -> None:
    from kvblend.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="longrope"):
        RopeConfig(head_dim=64, rope_type="longrope")


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_into_a_cache_slice_equals_a_new_tensor(interleaved: bool) -> None:
    g = torch.Generator().manual_seed(3)
    cfg = RopeConfig(head_dim=16, partial_rotary_factor=0.75, interleaved=interleaved)
    x = torch.randn(2, 7, 16, generator=g)
    cos, sin = cos_sin(cfg, torch.arange(40, 47))
    buf = torch.full((2, 20, 16), float("nan"))
    returned = apply_rope(x, cos, sin, interleaved, out=buf[:, 5:12])
    assert returned.data_ptr() == buf[:, 5:12].data_ptr()
    assert torch.equal(buf[:, 5:12], apply_rope(x, cos, sin, interleaved))
    assert buf[:, :5].isnan().all() and buf[:, 12:].isnan().all()
