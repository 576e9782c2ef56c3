"""Profiles: fits that predict what they measured, JSON round trip, `kvblend profile` on a
model folder, and KL per storage dtype."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvblend.cli import main
from kvblend.commands.profile import dtype_quality
from kvblend.pipeline.profile import Profile, TierSpeed, _fit, load_profile, profile_path
from tests.conftest import make_hf_model, make_loaded, make_tokenizer
from tests.engine.test_blend_invariants import DOCS, QUESTION


def test_fit_recovers_coefficients_and_never_goes_negative() -> None:
    rows = [(1.0, n, n * n) for n in (100.0, 200.0, 400.0, 800.0)]
    assert _fit(rows, [0.5 + 2e-3 * r[1] + 1e-6 * r[2] for r in rows]) == pytest.approx((0.5, 2e-3, 1e-6))
    noisy = _fit(rows, [0.1 + 1e-3 * r[1] - 1e-9 * r[2] for r in rows])  # a slightly negative term
    assert all(c >= 0 for c in noisy) and noisy[2] == 0.0


def test_profile_json_round_trip_keeps_immediate_tiers() -> None:
    p = Profile("fp", "cpu", "float32", (0.1, 1e-3, 1e-7), (1e-3, 1e-5, 1e-9),
                {"memory": TierSpeed(immediate=True), "disk": TierSpeed(1e-4, 2e9)}, {"int8": 1e-4})
    q = Profile.from_json(p.to_json())
    assert q == p and math.isinf(q.tiers["memory"].bytes_per_s)
    assert q.layer_s(q.active_for(0.01, 1000), 1000) == pytest.approx(0.01)


@pytest.fixture
def one_thread(monkeypatch):
    """Profiling times many tiny runs: one thread (on a busy 2-core machine two threads wait
    on each other) and short grids of sizes."""
    from kvblend.pipeline import profile

    monkeypatch.setattr(profile, "PREFILL_LENGTHS", (32, 64))
    monkeypatch.setattr(profile, "LAYER_ACTIVE", (8, 32))
    monkeypatch.setattr(profile, "LAYER_CONTEXT", (64, 128))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_kvblend_profile_measures_a_model_folder_and_stores_the_profile(tmp_path: Path, monkeypatch, capsys,
                                                                         one_thread) -> None:
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    folder = tmp_path / "tiny"
    tok = make_tokenizer()
    make_hf_model(vocab_size=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert main(["profile", "--model", str(folder), "--store-dir", str(tmp_path / "kv"), "--no-quality",
                 "--json"]) == 0
    printed = Profile.from_json(capsys.readouterr().out)
    assert set(printed.tiers) == {"memory", "disk"} and printed.tiers["disk"].bytes_per_s > 0
    assert all(c >= 0 for c in printed.prefill + printed.layer)
    saved = list((tmp_path / "home" / "profiles").glob("*.json"))
    assert len(saved) == 1 and load_profile(saved[0]) == printed
    assert not list((tmp_path / "kv").rglob("*.safetensors"))  # the test chunks were removed
    assert json.loads(saved[0].read_text())["device"] == "cpu"
    assert profile_path(printed.model_fingerprint, "cpu", "float32") == saved[0]


def test_quality_per_storage_dtype_is_a_kl_against_fp32() -> None:
    kl = dtype_quality(make_loaded(), DOCS, QUESTION)
    assert set(kl) == {"fp16", "bf16", "int8"}
    assert all(v >= 0 for v in kl.values()) and kl["int8"] > 0 and kl["bf16"] > kl["fp16"]


def test_kvblend_profile_reaches_redis_as_the_server_does(monkeypatch) -> None:
    """A Redis Cluster in the settings is measured as a cluster (it was always one server)."""
    import argparse

    from kvblend.commands.profile import profiled_store

    monkeypatch.setenv("KVBLEND_STORE__REDIS_CLUSTER", "true")
    monkeypatch.setenv("KVBLEND_STORE__REDIS_GROUPS", "4")
    args = argparse.Namespace(store_dir=None, redis_url="redis://10.0.1.1:7000", kv_dtype="fp16")
    config = profiled_store(args)
    assert (config.redis_cluster, config.redis_groups, config.redis_url, config.kv_dtype) == (
        True, 4, "redis://10.0.1.1:7000", "fp16")
    assert config.disk_dir is None and "redis" in config.enabled_tiers and "disk" not in config.enabled_tiers
