"""The per-layer steps agree with each other: a check layer's K/V-only projection equals
the K/V of the full projection, with and without q/k/v bias; so does layer 0's
queries-for-all projection."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_loaded


def layer_inputs(arch: str, layer: int, first_position: int):
    """A tiny model's layer, 11 random residual rows and the RoPE tables of their positions."""
    model = make_loaded(arch).model
    h = torch.randn(11, model.cfg.hidden_size, generator=torch.Generator().manual_seed(first_position))
    cos, sin = model.rope_tables(torch.arange(first_position, first_position + 11))
    return model.layers[layer], h, cos, sin


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("keys", [True, False])
def test_project_kv_equals_project(arch: str, keys: bool) -> None:
    layer, h, cos, sin = layer_inputs(arch, 1, 20)
    _, k, v = layer.project(h, cos, sin)
    k_only, v_only = layer.project_kv(h, cos, sin, keys=keys)
    assert torch.allclose(v_only, v, atol=1e-6)
    if keys:
        assert torch.allclose(k_only, k, atol=1e-6)
    else:
        assert k_only is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_project_known_kv_gives_every_query_and_only_the_asked_kv(arch: str) -> None:
    layer, h, cos, sin = layer_inputs(arch, 0, 5)
    q, k, v = layer.project(h, cos, sin)
    rows = torch.tensor([0, 4, 10])
    q2, k2, v2 = layer.project_known_kv(h, cos, sin, rows)
    assert torch.allclose(q2, q, atol=1e-6)
    assert k2.shape[1] == v2.shape[1] == 3
    assert torch.allclose(k2, k[:, rows], atol=1e-6) and torch.allclose(v2, v[:, rows], atol=1e-6)
