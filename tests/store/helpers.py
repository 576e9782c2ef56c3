"""Tiny chunks and key contexts shared by the store tests."""

from __future__ import annotations

import torch

from kvblend.store import ChunkKV, KeyContext, chunk_key
from kvblend.store.keys import ChunkKey

ROPE = '{"rope_theta": 100000.0, "rope_type": "default"}'


def make_ctx(tenant: str = "default", kv_dtype: str = "fp32", model: str = "model-a") -> KeyContext:
    return KeyContext(model, "tok-a", ROPE, kv_dtype, (1, 2), tenant)


def make_chunk(ids: tuple[int, ...] = (5, 6, 7, 8), layers: int = 2, heads: int = 2, head_dim: int = 4,
               seed: int = 0, base_position: int = 2) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(heads, len(ids), head_dim, generator=g) for _ in range(2 * layers)]
    return ChunkKV(tuple(ids), base_position, tuple(kv[:layers]), tuple(kv[layers:]))


def keyed(i: int, tenant: str = "default", kv_dtype: str = "fp32", n_tokens: int = 4,
          **chunk_kw: int) -> tuple[ChunkKey, ChunkKV]:
    """A distinct (key, chunk) pair per ``i``."""
    ids = tuple(range(100 * i + 10, 100 * i + 10 + n_tokens))
    return chunk_key(ids, make_ctx(tenant, kv_dtype)), make_chunk(ids, seed=i, **chunk_kw)


def assert_same_chunk(a: ChunkKV, b: ChunkKV, atol: float = 0.0) -> None:
    assert a.token_ids == b.token_ids and a.base_position == b.base_position
    assert a.n_layers == b.n_layers
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert x.shape == y.shape
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=0)
