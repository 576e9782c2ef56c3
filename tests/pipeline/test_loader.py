"""Layer-pipelined loading: the same logits as loading every chunk first (memory, disk,
Redis), and a document whose layer cannot be read is recomputed exactly as a miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.store import StoreConfig, build_store
from kvblend.store.disk import DiskStore
from kvblend.store.keys import chunk_key
from kvblend.store.localredis import LocalRedis
from kvblend.store.throttle import ThrottledDisk
from kvblend.store.tiered import TieredStore
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

REQUEST = Request(documents=DOCS, question=QUESTION, system="answer the question .", blend=BlendConfig(ratio=0.3))
# the reference for a fallback: the same request with its misses computed in the prompt,
# as a document whose load failed is
IN_PROMPT = Request(documents=DOCS, question=QUESTION, system="answer the question .",
                    blend=BlendConfig(ratio=0.3, recompute_misses=True))


@pytest.fixture(scope="module")
def loaded():
    return make_loaded(num_hidden_layers=3)


@pytest.fixture(scope="module")
def redis_url():
    with LocalRedis() as server:
        yield server.url


def store_for(kind: str, tmp_path: Path, redis_url: str | None = None):
    if kind == "memory":
        return build_store(StoreConfig(tiers=("memory",)))
    if kind == "disk":
        return build_store(StoreConfig(tiers=("disk",), disk_dir=str(tmp_path / "disk"), disk_fsync=False))
    return build_store(StoreConfig(tiers=("redis",), redis_url=redis_url, redis_prefix=f"p{tmp_path.name[-20:]}"))


def warm(eng: Engine, request: Request = REQUEST, docs=DOCS) -> None:
    layout = eng.layout(request)
    eng.warm(list(docs), eng.chunk_prefix(request, layout))


@pytest.mark.parametrize("kind", ["memory", "disk", "redis"])
def test_pipelined_logits_equal_loading_everything_first(kind: str, loaded, tmp_path: Path, redis_url: str) -> None:
    store = store_for(kind, tmp_path, redis_url)
    serial, pipelined = Engine(loaded, store, pipeline=False), Engine(loaded, store, pipeline=True)
    warm(serial)
    for method in ("blend", "reuse"):
        req = Request(documents=DOCS, question=QUESTION, method=method, blend=REQUEST.blend)
        a, b = serial.prepare(req), pipelined.prepare(req)
        assert torch.equal(a.logits, b.logits)
        assert [d.source for d in b.stats.docs] == [kind] * 3
        assert b.stats.loading.pipelined and b.stats.loading.failures == ()
        assert not a.stats.loading.pipelined and a.stats.loading.documents == 0
        assert b.stats.loading.documents == (0 if kind == "memory" else 3)  # memory is lent, never loaded
        assert len(b.stats.loading.wait_s) == (0 if kind == "memory" else 3)  # one wait per layer


def test_disk_hit_is_promoted_to_memory_after_a_pipelined_read(loaded, tmp_path: Path) -> None:
    store = build_store(StoreConfig(tiers=("memory", "disk"), disk_dir=str(tmp_path), disk_fsync=False))
    eng = Engine(loaded, store)
    warm(eng)
    store.tier("memory").clear("default")
    first = eng.prepare(REQUEST)
    assert [d.source for d in first.stats.docs] == ["disk"] * 3
    second = eng.prepare(REQUEST)
    assert [d.source for d in second.stats.docs] == ["memory"] * 3
    assert torch.allclose(first.logits, second.logits, atol=1e-5)  # the prefix cache hits now


def _flip_tensor_byte(path: Path, name: str) -> None:
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + n])[name]["data_offsets"][0]
    raw[8 + n + begin] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_layer_corrupt_mid_request_falls_back_to_the_document_missed(loaded, tmp_path: Path) -> None:
    disk = DiskStore(tmp_path / "a", 1 << 30, fsync=False)
    eng = Engine(loaded, TieredStore([disk]))
    warm(eng)
    layout = eng.layout(REQUEST)
    key = chunk_key(layout.docs[2], eng.key_context(eng.chunk_prefix(REQUEST, layout), "default"))
    _flip_tensor_byte(disk.path(key), "v.1")  # layers 0 load, layer 1 of document 2 is corrupt
    got = eng.prepare(REQUEST)

    other = Engine(loaded, TieredStore([DiskStore(tmp_path / "b", 1 << 30, fsync=False)]))
    warm(other, docs=DOCS[:2])  # the same request with document 2 never stored
    missed = other.prepare(IN_PROMPT)
    assert [d.source for d in missed.stats.docs] == ["disk", "disk", "computed"]
    assert torch.equal(got.logits, missed.logits)
    assert got.stats.recomputed_per_layer == missed.stats.recomputed_per_layer
    assert [d.source for d in got.stats.docs] == ["disk", "disk", "fallback"]
    (failure,) = got.stats.loading.failures
    assert (failure.slot, failure.layer, failure.tier) == (2, 1, "disk")
    assert disk.stats().errors == 1  # the corrupt entry was removed ...
    eng.flush()
    assert disk.get(key) is not None  # ... and written back whole from the recomputation


def test_a_tier_too_slow_for_the_timeout_falls_back_to_recompute(loaded, tmp_path: Path) -> None:
    slow = ThrottledDisk(tmp_path, 1 << 30, bytes_per_s=1e3, fsync=False)  # seconds per layer
    eng = Engine(loaded, TieredStore([slow]), load_timeout_s=0.2)
    warm(eng)
    got = eng.prepare(REQUEST)
    assert [d.source for d in got.stats.docs] == ["fallback"] * 3
    assert {f.reason for f in got.stats.loading.failures} == {"timeout"}
    nothing = Engine(loaded, build_store(StoreConfig(tiers=("memory",)))).prepare(IN_PROMPT)
    assert torch.equal(got.logits, nothing.logits)


def test_a_redis_layer_corrupt_mid_request_falls_back_to_the_document_missed(loaded, tmp_path: Path,
                                                                              redis_url: str) -> None:
    import redis

    store = store_for("redis", tmp_path, redis_url)
    eng = Engine(loaded, store)
    warm(eng)
    layout = eng.layout(REQUEST)
    key = chunk_key(layout.docs[0], eng.key_context(eng.chunk_prefix(REQUEST, layout), "default"))
    tier = store.tier("redis")
    redis.Redis.from_url(redis_url).hset(tier.entry_name(key), "k.2", b"\0" * 16)  # layer 2 of document 0
    got = eng.prepare(REQUEST)
    assert [d.source for d in got.stats.docs] == ["fallback", "redis", "redis"]
    assert got.stats.loading.failures[0].layer == 2

    other = Engine(loaded, build_store(StoreConfig(tiers=("memory",))))
    warm(other, docs=DOCS[1:])
    assert torch.equal(got.logits, other.prepare(IN_PROMPT).logits)
