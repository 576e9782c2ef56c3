"""The per-layer steps agree with each other: a check layer's K/V-only projection equals
the K/V of the full projection, with and without q/k/v bias; so does layer 0's
queries-for-all projection."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_loaded


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("keys", [True, False])
def test_project_kv_equals_project(arch: str, keys: bool) -> None:
    model = make_loaded(arch).model
    layer = model.layers[1]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, model.cfg.hidden_size, generator=g)
    cos, sin = model.rope_tables(torch.arange(20, 31))
    _, k, v = layer.project(h, cos, sin)
    k_only, v_only = layer.project_kv(h, cos, sin, keys=keys)
    assert torch.allclose(v_only, v, atol=1e-6)
    if keys:
        assert torch.allclose(k_only, k, atol=1e-6)
    else:
        assert k_only is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_project_known_kv_gives_every_query_and_only_the_asked_kv(arch: str) -> None:
    model = make_loaded(arch).model
    layer = model.layers[0]
    g = torch.Generator().manual_seed(1)
    h = torch.randn(11, model.cfg.hidden_size, generator=g)
    cos, sin = model.rope_tables(torch.arange(5, 16))
    q, k, v = layer.project(h, cos, sin)
    rows = torch.tensor([0, 4, 10])
    q2, k2, v2 = layer.project_known_kv(h, cos, sin, rows)
    assert torch.allclose(q2, q, atol=1e-6)
    assert k2.shape[1] == v2.shape[1] == 3
    assert torch.allclose(k2, k[:, rows], atol=1e-6) and torch.allclose(v2, v[:, rows], atol=1e-6)
