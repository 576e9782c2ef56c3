"""The per-model self-check: a good model passes, a broken re-rotation is refused by
name, full prefill still works, and a stored result is reused (issue #15, point 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvblend import rope
from kvblend.engine import Engine, Request
from kvblend.errors import ModelCheckError
from kvblend.engine import selfcheck
from kvblend.models.loader import load_hf_folder
from tests.conftest import make_hf_model, make_loaded, make_tokenizer
from tests.engine.test_blend_invariants import DOCS, QUESTION


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Each test: its own KVBLEND_HOME and an empty memo (results are keyed by model)."""
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    selfcheck.forget()
    yield
    selfcheck.forget()


def unique(seed: int = 0, **overrides):
    loaded = make_loaded(seed=seed, **overrides)
    loaded._fingerprint = f"selfcheck-test-{seed}-{sorted(overrides.items())}"
    loaded.__dict__.pop("fingerprint", None)
    return loaded


def wrong_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached keys re-rotated with the wrong base: the defect the check must catch."""
    real = rope.reposition_tables

    def broken(cfg, n, old, new, dtype=torch.float32, device="cpu"):
        wrong = dataclasses.replace(cfg, theta=cfg.theta * 7)
        return real(wrong, n, old, (new[0] + 1, new[1]), dtype, device)

    monkeypatch.setattr(rope, "reposition_tables", broken)


def ask(eng: Engine, method: str, docs=DOCS):
    return eng.prepare(Request(documents=docs, question=QUESTION, method=method))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_good_model_passes_every_check(dtype: torch.dtype) -> None:
    loaded = unique()
    loaded.model.to(dtype)
    eng = Engine(loaded)
    assert eng.self_check.passed and {o.name for o in eng.self_check.outcomes} == set(selfcheck.CHECKS)
    assert all(0 <= o.gap <= o.tolerance for o in eng.self_check.outcomes)
    ask(eng, "blend")  # served


def test_a_broken_rerotation_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong_rotation(monkeypatch)
    eng = Engine(unique(seed=1))
    assert not eng.self_check.passed and "rerotation" in eng.self_check.failed
    assert "blend-ratio-1" in eng.self_check.failed  # layer-0 cached keys feed ratio 1 too
    for method in ("blend", "reuse", "prefix"):
        with pytest.raises(ModelCheckError, match="rerotation"):
            ask(eng, method)
    assert ask(eng, "full").stats.method == "full"
    assert ask(eng, "prefix", docs=[]).stats.method == "prefix"  # no documents: nothing is placed


def test_the_check_can_be_skipped_and_costs_nothing_then(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "run_checks", lambda loaded: pytest.fail("the check ran"))
    eng = Engine(unique(seed=2), self_check=False)
    assert eng.self_check is None
    ask(eng, "blend")


def saved_model(folder: Path) -> Path:
    hf = make_hf_model("llama", vocab_size=len(make_tokenizer()))
    hf.save_pretrained(str(folder))
    make_tokenizer().save_pretrained(str(folder))
    return folder


def test_the_result_is_stored_once_per_model_and_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = saved_model(tmp_path / "model")
    calls: list[str] = []
    real = selfcheck.run_checks
    monkeypatch.setattr(selfcheck, "run_checks", lambda loaded: calls.append(loaded.name) or real(loaded))
    Engine(load_hf_folder(folder))
    stored = list((tmp_path / "home" / "selfcheck").glob("*.json"))
    assert len(calls) == 1 and len(stored) == 1
    selfcheck.forget()  # a new process: only the file remains
    assert Engine(load_hf_folder(folder)).self_check.passed and len(calls) == 1
    Engine(load_hf_folder(folder, dtype=torch.bfloat16))  # another dtype is checked on its own
    assert len(calls) == 2 and len(list(stored[0].parent.glob("*.json"))) == 2


def test_a_stored_failure_refuses_without_running_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = saved_model(tmp_path / "model")
    with monkeypatch.context() as m:
        wrong_rotation(m)
        assert not Engine(load_hf_folder(folder)).self_check.passed
    selfcheck.forget()
    monkeypatch.setattr(selfcheck, "run_checks", lambda loaded: pytest.fail("the stored result was not used"))
    with pytest.raises(ModelCheckError, match="rerotation"):
        ask(Engine(load_hf_folder(folder)), "blend")


def test_an_unreadable_stored_result_is_checked_again(tmp_path: Path) -> None:
    folder = saved_model(tmp_path / "model")
    loaded = load_hf_folder(folder)
    path = tmp_path / "home" / "selfcheck" / f"{selfcheck.check_key(loaded)}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert Engine(loaded).self_check.passed
    assert selfcheck.SelfCheckResult.from_json(path.read_text()).passed


def test_the_far_check_catches_shift_only_rerotation_under_dynamic_ntk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #10's defect (keys moved by a shift at base frequencies) is invisible inside
    the window, where the built-in prompt sits, and caught at the far end."""

    def shift_only(cfg, n, old, new, dtype=torch.float32, device="cpu"):
        return rope.rotation_tables(new[0] - old[0], n, cfg, dtype, device) if new[0] != old[0] else None

    monkeypatch.setattr(rope, "reposition_tables", shift_only)
    dynamic = {"max_position_embeddings": 32, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    result = selfcheck.run_checks(unique(seed=3, **dynamic))
    assert result.failed == ("rerotation-far",)
    assert selfcheck.run_checks(unique(seed=3)).passed  # default RoPE: a shift is exact
