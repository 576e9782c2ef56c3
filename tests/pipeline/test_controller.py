"""The loading controller: the ratio follows r = min(r_max, max(r_min, r_hide)) on
synthetic profiles, a slow tier raises it in a real request, placement follows costs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.errors import InvalidRequestError
from kvblend.models.config import ModelConfig
from kvblend.pipeline.controller import DocLoad, choose_ratio, choose_tier
from kvblend.pipeline.profile import Profile, TierSpeed, layer_bytes, synthetic_chunk
from kvblend.store import StoreConfig, build_store
from kvblend.store.disk import DiskStore
from kvblend.store.entry import encode_chunk
from kvblend.store.memory import MemoryStore
from kvblend.store.throttle import ThrottledDisk
from kvblend.store.tiered import TieredStore
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION
from tests.pipeline.test_profile import one_thread  # noqa: F401 (fixture)

TIERS = {"memory": TierSpeed(immediate=True), "disk": TierSpeed(1e-4, 1e9), "redis": TierSpeed(5e-4, 1e8)}


def profile(layer=(1e-3, 1e-5, 1e-9), tiers=TIERS) -> Profile:
    return Profile("fp", "cpu", "float32", (0.0, 1e-3, 0.0), layer, dict(tiers))


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return make_loaded().config


def test_ratio_is_the_floor_when_loading_is_fast(cfg: ModelConfig) -> None:
    docs = [DocLoad(0, "memory", 500), DocLoad(1, "disk", 500)]
    choice = choose_ratio(profile(), cfg, docs, forced=40, context=1100, kv_dtype="fp32", r_min=0.15, r_max=1.0)
    assert choice.ratio == 0.15 and choice.r_hide < 0.15
    assert choice.load_layer_s == pytest.approx(1e-4 + layer_bytes(cfg, 500, "fp32") / 1e9)


def test_ratio_follows_the_formula_when_loading_is_slow(cfg: ModelConfig) -> None:
    slow = {**TIERS, "redis": TierSpeed(2e-3, 5e7)}
    docs = [DocLoad(0, "redis", 400), DocLoad(1, "redis", 600), DocLoad(2, "memory", 300)]
    p = profile(tiers=slow)
    choice = choose_ratio(p, cfg, docs, forced=50, context=1400, kv_dtype="fp32", r_min=0.15, r_max=1.0)
    load = 2 * 2e-3 + (layer_bytes(cfg, 400, "fp32") + layer_bytes(cfg, 600, "fp32")) / 5e7
    a, b, c = p.layer
    r_hide = ((load - a) / (b + c * 1400) - 50) / 1300
    assert 0.15 < r_hide < 1
    assert choice.ratio == pytest.approx(r_hide) and choice.load_layer_s == pytest.approx(load)
    assert choice.recompute_layer_s == pytest.approx(load)  # recompute exactly fills the wait
    capped = choose_ratio(p, cfg, docs, forced=50, context=1400, kv_dtype="fp32", r_min=0.15, r_max=0.2)
    assert capped.ratio == 0.2 and capped.r_hide == pytest.approx(r_hide)


def test_smaller_storage_dtypes_need_less_recompute_to_hide(cfg: ModelConfig) -> None:
    slow = {"redis": TierSpeed(0.0, 1e6)}
    docs = [DocLoad(0, "redis", 800)]
    r = {dt: choose_ratio(profile(tiers=slow), cfg, docs, 20, 900, dt, 0.0, 1.0).r_hide for dt in ("fp32", "fp16", "int8")}
    assert r["fp32"] > r["fp16"] > r["int8"] > 0
    for dt in ("fp32", "fp16", "int8"):  # what an encoded entry's layer really holds, int8 scales included
        key, chunk = synthetic_chunk(cfg, 800, dt)
        entry = encode_chunk(key, chunk, dt)
        assert layer_bytes(cfg, 800, dt) == sum(entry.tensors[n].nbytes for n in entry.header.tensor_names(0))
    assert layer_bytes(cfg, 800, "int8") == layer_bytes(cfg, 800, "fp32") // 4 + 2 * cfg.num_kv_heads * 800 * 4


def test_placement_picks_the_cheapest_tier_that_hides(cfg: ModelConfig) -> None:
    costs = {"memory": 10.0, "disk": 1.0, "redis": 0.5}
    names = ["memory", "disk", "redis"]
    p = profile(layer=(0.0, 1e-4, 0.0))  # 512 tokens at r_min 0.15: 7.7 ms per layer to hide behind
    assert choose_tier(p, cfg, 512, "fp32", 0.15, costs, names) == "redis"
    slow_redis = profile(layer=(0.0, 1e-4, 0.0), tiers={**TIERS, "redis": TierSpeed(0.05, 1e6)})
    assert choose_tier(slow_redis, cfg, 512, "fp32", 0.15, costs, names) == "disk"
    assert choose_tier(slow_redis, cfg, 512, "fp32", 0.15, {"disk": 1.0, "redis": 0.5}, names) == "disk"
    all_slow = profile(layer=(0.0, 1e-9, 0.0), tiers={"disk": TierSpeed(0.01, 1e6), "redis": TierSpeed(0.05, 1e6)})
    assert choose_tier(all_slow, cfg, 512, "fp32", 0.15, {"disk": 1.0, "redis": 0.5}, names) == "disk"  # fastest
    assert choose_tier(p, cfg, 512, "fp32", 0.15, {}, names) is None


def test_auto_cannot_take_a_schedule_and_needs_ordered_bounds() -> None:
    with pytest.raises(InvalidRequestError):
        BlendConfig(ratio="auto", check_layers=(1, 2), schedule=(0.5, 0.2))
    with pytest.raises(InvalidRequestError):
        BlendConfig(ratio="auto", r_min=0.5, r_max=0.2)
    with pytest.raises(InvalidRequestError):
        BlendConfig(ratio="half")
    assert BlendConfig(ratio="auto").with_ratio(0.3).ratios == (0.3,)


def _auto(r_min: float = 0.1) -> Request:
    return Request(documents=DOCS, question=QUESTION, blend=BlendConfig(ratio="auto", r_min=r_min, r_max=0.9))


def test_a_slow_tier_raises_the_chosen_ratio_and_the_stats_say_so(tmp_path: Path) -> None:
    loaded = make_loaded(num_hidden_layers=3)
    tiers = {"disk": TierSpeed(1e-4, 1e9)}
    prof = Profile("fp", "cpu", "float32", (0.0, 1e-3, 0.0), (0.0, 1e-4, 0.0), tiers)
    fast = Engine(loaded, TieredStore([DiskStore(tmp_path / "a", 1 << 30, fsync=False)]), profile=prof)
    slow_bw = 2e5  # bytes/s: one tiny layer (≈4 KB per document) takes ~20 ms
    slow_prof = prof.with_tiers({"disk": TierSpeed(0.0, slow_bw)})
    slow = Engine(loaded, TieredStore([ThrottledDisk(tmp_path / "b", 1 << 30, bytes_per_s=slow_bw, fsync=False)]),
                  profile=slow_prof)
    out = {}
    for name, eng in (("fast", fast), ("slow", slow)):
        eng.warm(list(DOCS), eng.chunk_prefix(_auto(), eng.layout(_auto())))
        out[name] = eng.prepare(_auto()).stats
    assert out["fast"].controller.ratio == 0.1  # the floor
    assert 0.1 < out["slow"].controller.ratio <= 0.9
    assert out["slow"].controller.load_layer_s > 100 * out["fast"].controller.load_layer_s
    assert [d.tier for d in out["slow"].controller.docs] == ["disk"] * 3
    assert out["slow"].recomputed_per_layer[1] > out["fast"].recomputed_per_layer[1]  # more tokens recomputed
    assert out["slow"].to_dict()["controller"]["ratio"] == out["slow"].controller.ratio


def test_engine_profiles_lazily_once_and_loads_the_profile_at_start(tmp_path: Path, monkeypatch, one_thread) -> None:
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    loaded = make_loaded()
    eng = Engine(loaded, build_store(StoreConfig(tiers=("memory",))))
    assert eng._profile is None
    stats = eng.prepare(_auto()).stats  # nothing cached: every document computed alone, nothing to load
    assert stats.controller.ratio == 0.1 and {d.tier for d in stats.controller.docs} == {"chunk"}
    assert stats.controller.load_layer_s == 0.0
    saved = list((tmp_path / "profiles").glob("*.json"))
    assert len(saved) == 1 and "memory" in Profile.from_json(saved[0].read_text()).tiers
    again = Engine(loaded, build_store(StoreConfig(tiers=("memory",))))
    assert again._profile == eng.profile()


def test_placement_writes_new_chunks_to_the_tier_the_cost_table_picks(tmp_path: Path) -> None:
    loaded = make_loaded()
    memory, disk = MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False)
    store = TieredStore([memory, disk], costs={"memory": 10.0, "disk": 1.0})
    hides = Profile("fp", "cpu", "float32", (0.0, 1e-3, 0.0), (0.0, 1e-3, 0.0),
                    {"memory": TierSpeed(immediate=True), "disk": TierSpeed(1e-5, 1e9)})
    eng = Engine(loaded, store, profile=hides)
    keys = eng.warm(list(DOCS), (1,))
    assert all(disk.contains(k) and not memory.contains(k) for k in keys)
    first = eng.prepare(Request(documents=DOCS, question=QUESTION)).stats
    assert [d.source for d in first.docs] == ["disk"] * 3
    eng.flush()
    assert not any(memory.contains(k) for k in keys)  # placement, not promotion, decides
    too_slow = hides.with_tiers({"disk": TierSpeed(1.0, 1e3)})
    other = Engine(loaded, TieredStore([MemoryStore(1 << 30), DiskStore(tmp_path / "b", 1 << 30, fsync=False)],
                                       costs={"memory": 10.0, "disk": 1.0}), profile=too_slow)
    keys = other.warm(list(DOCS), (1,))
    assert all(other.store.tier("memory").contains(k) and not other.store.tier("disk").contains(k) for k in keys)
    assert math.isinf(TierSpeed(immediate=True).bytes_per_s)


@pytest.mark.parametrize("recompute_misses", [True, False])
def test_write_back_of_missed_chunks_goes_to_the_tier_placement_picks(tmp_path: Path, recompute_misses: bool) -> None:
    """A request's misses reach the store through the engine's one write-back, which puts
    them only where placement says (before the merge with main, write-back put them everywhere)."""
    memory, disk = MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False)
    hides = Profile("fp", "cpu", "float32", (0.0, 1e-3, 0.0), (0.0, 1e-3, 0.0),
                    {"memory": TierSpeed(immediate=True), "disk": TierSpeed(1e-5, 1e9)})
    eng = Engine(make_loaded(), TieredStore([memory, disk], costs={"memory": 10.0, "disk": 1.0}), profile=hides)
    req = Request(documents=DOCS, question=QUESTION, blend=BlendConfig(recompute_misses=recompute_misses))
    got = eng.prepare(req).stats
    assert [d.source for d in got.docs] == ["computed" if recompute_misses else "chunk"] * 3
    eng.flush()
    assert eng.writeback_stats().written == 3
    assert len(disk.keys("default")) == 3 and memory.keys("default") == []


def test_loading_slower_than_full_recompute_is_skipped(tmp_path: Path) -> None:
    loaded = make_loaded()
    crawl = Profile("fp", "cpu", "float32", (0.0, 1e-3, 0.0), (0.0, 1e-6, 0.0), {"disk": TierSpeed(1.0, 1e3)})
    eng = Engine(loaded, TieredStore([DiskStore(tmp_path, 1 << 30, fsync=False)]), profile=crawl)
    req = Request(documents=DOCS, question=QUESTION, blend=BlendConfig(ratio="auto"))
    eng.warm(list(DOCS), eng.chunk_prefix(req, eng.layout(req)))
    got = eng.prepare(req)
    assert got.stats.controller.ratio == 1.0 and got.stats.controller.r_hide > 1
    assert [d.source for d in got.stats.docs] == ["skipped"] * 3 and got.stats.loading.documents == 0
    full = eng.prepare(Request(documents=DOCS, question=QUESTION, method="full"))
    assert (got.logits - full.logits).abs().max().item() <= 1e-3
