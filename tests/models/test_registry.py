"""Packaged models split over several packages: assembled in order, sha256-checked."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvblend.errors import ModelNotFoundError
from kvblend.models import registry
from kvblend.models.registry import GEMMA3_PARTS, PACKAGED, SplitGguf


def fake_split(tmp_path: Path, monkeypatch, sha: str) -> SplitGguf:
    parts = {f"dist{i}": tmp_path / f"p{i}" for i in range(3)}
    for i, path in enumerate(parts.values()):
        path.write_bytes(bytes([i]) * (5 + i))
    monkeypatch.setattr(registry, "_package_file", lambda dist, suffix, install: parts[dist])
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    return SplitGguf("m.gguf", tuple((d, "x") for d in parts), sha, "make it")


def test_parts_are_concatenated_in_order_and_checked(tmp_path: Path, monkeypatch) -> None:
    whole = b"\x00" * 5 + b"\x01" * 6 + b"\x02" * 7
    path = registry._assembled_gguf(fake_split(tmp_path, monkeypatch, hashlib.sha256(whole).hexdigest()))
    assert path.read_bytes() == whole and path.parent == tmp_path / "home" / "gguf"


def test_a_wrong_sha256_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ModelNotFoundError, match="wrong sha256.*make it"):
        registry._assembled_gguf(fake_split(tmp_path, monkeypatch, "0" * 64))
    assert not list((tmp_path / "home" / "gguf").iterdir())


def test_gemma3_is_packaged_from_its_four_parts_in_order() -> None:
    assert "gemma3-270m" in PACKAGED and PACKAGED["gemma3-270m"].install == "make gemma"
    assert [suffix[-7:] for _, suffix in GEMMA3_PARTS.parts] == [".part00", ".part01", ".part02", ".part03"]
    assert GEMMA3_PARTS.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
