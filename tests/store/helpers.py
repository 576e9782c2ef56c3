"""Tiny chunks and key contexts shared by the store tests."""

from __future__ import annotations

from typing import Callable

import torch

from kvblend.store import ChunkKV, KeyContext, chunk_key
from kvblend.store.keys import ChunkKey
from kvblend.store.tier import Tier

ROPE = '{"rope_theta": 100000.0, "rope_type": "default"}'


def make_ctx(tenant: str = "default", kv_dtype: str = "fp32", model: str = "model-a") -> KeyContext:
    return KeyContext(model, "tok-a", ROPE, kv_dtype, (1, 2), tenant, compute_dtype="fp32", model_config="cfg-a")


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


def entry_bytes(make_tier: Callable[..., Tier], index: int = 0, **shape: int) -> int:
    """What a tier counts for the entry ``keyed(index, **shape)`` (measured on a scratch tier)."""
    probe = make_tier()
    key, chunk = keyed(index, **shape)
    probe.put(key, chunk)
    unit = probe.stats().bytes
    probe.delete(key)
    return unit


def assert_same_chunk(a: ChunkKV, b: ChunkKV, atol: float = 0.0) -> None:
    assert a.token_ids == b.token_ids and a.base_position == b.base_position
    assert a.n_layers == b.n_layers
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert x.shape == y.shape
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=0)


def hammer(store, seed: int, read_layers: bool = False) -> tuple[int, int, int]:
    """Randomly overwrite one entry with constant-valued chunks and read it back.

    Returns (torn reads, successful reads, store errors); a read is torn when its
    tensors mix values from two writes. Run from several processes at once.
    """
    import random

    from kvblend.store.chunk import ChunkKV

    key, base = keyed(1, layers=3, heads=2, head_dim=16, n_tokens=32)
    rng, torn, hits = random.Random(seed), 0, 0
    for i in range(60):
        if rng.random() < 0.5:
            v = float(rng.randrange(1, 100))
            store.put(key, ChunkKV(base.token_ids, 0, tuple(torch.full_like(k, v) for k in base.keys),
                                   tuple(torch.full_like(k, v) for k in base.values)))
            continue
        got = store.get(key, base.token_ids) if not read_layers or i % 2 else None
        layer = store.get_layer(key, 1) if read_layers and not i % 2 else None
        for parts in ([*got.keys, *got.values] if got else [], list(layer) if layer else []):
            if parts:
                hits += 1
                torn += torch.cat([t.reshape(-1) for t in parts]).unique().numel() != 1
    return torn, hits, store.stats().errors


def hammer_in_processes(store_expr: str, read_layers: bool, n: int = 2) -> list[tuple[int, int, int]]:
    """Run ``hammer`` in ``n`` fresh processes, each building its store from ``store_expr``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = (f"import sys\nfrom kvblend.store import DiskStore, RedisStore\nfrom tests.store.helpers import hammer\n"
              f"print(*hammer({store_expr}, int(sys.argv[1]), {read_layers}))")
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(seed)], env=env, cwd=repo,
                              stdout=subprocess.PIPE, text=True) for seed in range(n)]
    return [tuple(map(int, p.communicate(timeout=120)[0].split())) for p in procs]
