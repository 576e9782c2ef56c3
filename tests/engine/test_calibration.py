"""The per-model test of the blend's shift (issue #23): measured on the real default model
(where the shift helps), stored and reused, skipped where it cannot run, and a model whose
test says the shift does not help blends without it, saying so in its stats."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request
from kvblend.engine import calibration
from kvblend.engine.calibration import ShiftVerdict
from kvblend.models.loader import load_hf_folder
from tests.engine.test_selfcheck import saved_model

HURTS = ShiftVerdict("m", "torch.float32", 5, shift_ratio=0.9, plain_ratio=0.4)
HELPS = ShiftVerdict("m", "torch.float32", 5, shift_ratio=0.2, plain_ratio=0.4)


def test_the_default_model_keeps_the_shift_it_was_chosen_on(smollm2) -> None:
    verdict = Engine(smollm2).shift_verdict  # measured once per build (memo, then $KVBLEND_HOME)
    assert verdict is not None and verdict.examples == len(calibration.examples()) == 5
    assert verdict.helps and verdict.shift_ratio < verdict.plain_ratio < 1.0


def test_the_decision_rule() -> None:
    assert HELPS.helps and not HURTS.helps
    assert dataclasses.replace(HURTS, shift_ratio=0.4).helps  # a tie keeps the configured shift
    assert dataclasses.replace(HURTS, shift_ratio=float("nan")).helps
    assert ShiftVerdict.from_json(HURTS.to_json()) == HURTS


QUESTION, PASSAGES = calibration.examples()[2]


def ask(engine: Engine, **blend) -> tuple[torch.Tensor, str | None]:
    request = Request(documents=PASSAGES[:2], question=QUESTION, blend=BlendConfig(**blend))
    prepared = engine.prepare(request)
    return prepared.logits, prepared.stats.strategy


def test_a_model_the_shift_hurts_blends_without_it(smollm2, tiny) -> None:
    assert Engine(tiny).shift_verdict is None  # built in memory: not tested, the shift as configured
    engine = Engine(smollm2, calibrate=False)
    assert engine.shift_verdict is None
    engine.warm(list(PASSAGES[:2]), engine.sink_prefix)
    with_shift, strategy = ask(engine)
    assert "shift" in strategy
    without, plain = ask(engine, shift=False)
    assert "shift" not in plain and not torch.equal(with_shift, without)
    engine.shift_verdict = HURTS  # the default config, a request asking for the shift: 0.15 more instead
    got, said = ask(engine)
    doubled, _ = ask(engine, shift=False, ratio=0.35)
    assert said == plain and torch.equal(got, doubled) and not torch.equal(got, without)
    assert torch.equal(ask(engine, shift=False)[0], without)  # shift: false keeps the ratio as given
    engine.shift_verdict = HELPS
    got, said = ask(engine)
    assert said == strategy and torch.equal(got, with_shift)


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    calibration.forget()
    yield tmp_path / "home"
    calibration.forget()


def test_a_verdict_is_stored_and_read_back_without_testing_again(home: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    folder = saved_model(tmp_path / "model")
    calls: list[str] = []
    monkeypatch.setattr(calibration, "run_calibration", lambda engine, progress, stop=None: calls.append("run") or HURTS)
    assert Engine(load_hf_folder(folder)).shift_verdict == HURTS and calls == ["run"]
    stored = list((home / "calibration").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["plain_ratio"] == 0.4
    calibration.forget()  # a new process: only the file remains
    assert Engine(load_hf_folder(folder)).shift_verdict == HURTS and calls == ["run"]
    stored[0].write_text("{not json")
    calibration.forget()
    assert Engine(load_hf_folder(folder)).shift_verdict == HURTS and calls == ["run", "run"]  # unreadable: again


def test_no_verdict_where_the_questions_do_not_fit_and_none_when_not_asked(home: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_hf_folder(saved_model(tmp_path / "model"))  # 256 positions: no question fits
    assert loaded.config.context_length < 1000
    assert calibration.run_calibration(Engine(loaded, calibrate=False)) is None
    assert Engine(loaded).shift_verdict is None and not (home / "calibration").exists()
    monkeypatch.setattr(calibration, "run_calibration", lambda engine, progress, stop=None: pytest.fail("not asked"))
    calibration.forget()
    assert Engine(loaded, calibrate=False).shift_verdict is None


def test_the_setting_reaches_the_servers_engine(monkeypatch: pytest.MonkeyPatch, tiny) -> None:
    from kvblend.server import main as server_main
    from kvblend.settings import Settings

    assert Settings().blend.calibrate is True
    monkeypatch.setenv("KVBLEND_BLEND__CALIBRATE", "0")
    settings = Settings()
    assert settings.blend.calibrate is False and "calibrate" not in str(settings.blend.blend_config())
    seen: dict = {}

    class Recorder:
        def __init__(self, loaded, **kw) -> None:
            seen.update(kw)

    monkeypatch.setattr("kvblend.engine.Engine", Recorder)
    monkeypatch.setattr("kvblend.models.load_model", lambda *a, **kw: tiny)
    server_main.build_engine(settings)
    assert seen["calibrate"] is False
    monkeypatch.delenv("KVBLEND_BLEND__CALIBRATE")
    server_main.build_engine(Settings())
    assert seen["calibrate"] == "background"  # the server answers while a model's test still runs


def test_a_test_that_fails_leaves_the_shift_as_configured_and_is_not_stored(home: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture) -> None:
    folder = saved_model(tmp_path / "model")

    def boom(engine, progress, stop=None):
        raise RuntimeError("out of memory (test)")

    monkeypatch.setattr(calibration, "run_calibration", boom)
    engine = Engine(load_hf_folder(folder))  # still built: it serves, with the shift as configured
    assert engine.shift_verdict is None and engine.blend_config(BlendConfig()).shift
    assert "the shift test failed" in capsys.readouterr().err
    assert not (home / "calibration").exists()


@pytest.mark.parametrize("cfg,want", [
    (BlendConfig(), {"ratio": 0.35}),
    (BlendConfig(ratio=0.9), {"ratio": 1.0}),  # at most all
    (BlendConfig(selection="deviation", check_layers=(1, 4), schedule=(0.4, 0.1)), {"schedule": (0.55, 0.25)}),
    (BlendConfig(ratio="auto", r_min=0.15, r_max=0.25), {"r_min": 0.25}),  # auto: the floor, within r_max
], ids=["default", "capped", "schedule", "auto"])
def test_without_the_shift_a_blend_recomputes_a_fixed_share_more(cfg, want) -> None:
    got = cfg.without_shift()
    assert not got.shift and all(getattr(got, k) == pytest.approx(v) for k, v in want.items()), got


def test_a_fresh_home_reads_the_default_models_shipped_verdict_without_testing(
        smollm2, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged model's verdict ships with kvblend: a fresh $KVBLEND_HOME serves at once."""
    monkeypatch.setattr(calibration, "run_calibration", lambda engine, progress, stop=None: pytest.fail("tested again"))
    verdict = Engine(smollm2, self_check=False).shift_verdict
    assert verdict == calibration.shipped_verdict(smollm2) and verdict.helps
    assert not (home / "calibration").exists()


def test_a_shipped_verdict_is_keyed_by_weights_config_and_dtype(tmp_path: Path, tiny) -> None:
    table = tmp_path / "verdicts.json"
    table.write_text(json.dumps({calibration.shipped_key(tiny): json.loads(HURTS.to_json())}))
    assert calibration.shipped_verdict(tiny, table) == HURTS
    other = dataclasses.replace(tiny, _fingerprint="other-weights")
    assert calibration.shipped_verdict(other, table) is None
    table.write_text("{torn")
    assert calibration.shipped_verdict(tiny, table) is None


def test_in_the_background_a_model_blends_without_the_shift_until_its_verdict_is_in(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    release = threading.Event()

    def slow(engine, progress, stop=None):
        assert release.wait(60)
        return HELPS

    monkeypatch.setattr(calibration, "run_calibration", slow)
    loaded = load_hf_folder(saved_model(tmp_path / "model"))
    engine = Engine(loaded, calibrate="background")
    assert engine.shift_pending and engine.shift_verdict is None  # built at once, the test still running
    assert not engine.blend_config(BlendConfig()).shift  # meanwhile: without the shift, 0.15 more recomputed
    assert engine.blend_config(BlendConfig()).ratio == pytest.approx(0.35)
    # a second engine of the same model is not held up by the test running (it waited for it
    # while the test held the memo's lock)
    built: list[Engine] = []
    second = threading.Thread(target=lambda: built.append(Engine(loaded, self_check=False, calibrate="background")))
    second.start()
    second.join(10)
    assert built and built[0].shift_pending
    release.set()
    for t in [t for t in threading.enumerate() if t.name == "kvblend-shift-test"]:
        t.join(60)
    assert not engine.shift_pending and engine.shift_verdict == HELPS
    assert engine.blend_config(BlendConfig()).shift
