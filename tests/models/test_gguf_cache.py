"""A GGUF converted once into the model cache, whoever else converts it at the same time."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvblend.models import gguf as gguf_module
from kvblend.models.gguf import META_FILE, convert_gguf, gguf_digest


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF not a real one")
    gguf_digest(path)  # remembered before the threads start
    return path


def _fake_writer(calls: list[str], both_writing: threading.Barrier):
    """``_write_converted`` without transformers: waits (2 s at most) for the other
    conversion to be writing too, then writes a converted folder's files."""

    def write(gguf: Path, out: Path, name: str) -> None:
        calls.append(name)
        try:
            both_writing.wait(2)
        except threading.BrokenBarrierError:
            pass
        (out / "model.safetensors").write_bytes(b"weights")
        (out / META_FILE).write_text(json.dumps({"name": name}))

    return write


def test_two_conversions_of_one_gguf_at_once_share_one_result(fake_gguf, monkeypatch):
    """Two at once (two processes starting on a fresh cache: `serve` and `ingest`, or
    replicas) both converted, and the second's rename onto the first's folder failed
    ("Directory not empty"), refusing the model. One converts now; the other waits for
    it and uses its folder."""
    calls: list[str] = []
    monkeypatch.setattr(gguf_module, "_write_converted", _fake_writer(calls, threading.Barrier(2)))
    results: list[Path] = []
    errors: list[Exception] = []

    def convert() -> None:
        try:
            results.append(convert_gguf(fake_gguf))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert calls == ["tiny"] and (results[0] / META_FILE).is_file()
    assert not list(results[0].parent.glob(".convert-*"))


def test_a_killed_conversions_temp_folder_is_removed_by_the_next(fake_gguf, monkeypatch):
    """A conversion killed mid-way leaves its temp folder (the size of the dequantised
    model); the next conversion of the same GGUF removes it."""
    monkeypatch.setattr(gguf_module, "_write_converted", _fake_writer([], threading.Barrier(1)))
    models = Path(gguf_module.cache_home()) / "models"
    stale = models / f".convert-{gguf_digest(fake_gguf)[:24]}-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    folder = convert_gguf(fake_gguf)
    assert (folder / META_FILE).is_file() and not stale.exists()
