"""Loading a model: from a Hugging Face folder, a GGUF file, or a packaged short name.

A GGUF is read once through transformers (slow: it dequantises every tensor) and
converted into the local model cache (safetensors + tokenizer files, keyed by the
GGUF's sha256). Later starts read that folder and take seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvblend.errors import KvblendError, ModelNotFoundError, UnsupportedModelError
from kvblend.models.config import ModelConfig
from kvblend.models.transformer import Transformer
from kvblend.models.weights import fingerprint_files, load_into, read_safetensors, safetensors_files

META_FILE = "kvblend.json"


def cache_home() -> Path:
    """Root of kvblend's local caches: ``$KVBLEND_HOME`` or ``~/.cache/kvblend``."""
    return Path(os.environ.get("KVBLEND_HOME") or Path.home() / ".cache" / "kvblend")


@dataclass
class LoadedModel:
    """A ready model: our weights, the HF tokenizer, and the identities cache keys need."""

    name: str
    folder: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Any
    _fingerprint: str | None = field(default=None, repr=False)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the weight files (stored at conversion; computed once otherwise)."""
        return self._fingerprint or fingerprint_files(safetensors_files(self.folder))

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(self.tokenizer.get_vocab(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def read_model_config(folder: Path) -> ModelConfig:
    """Our config from ``config.json``, read directly (AutoConfig costs ~1 s of imports)."""
    path = folder / "config.json"
    if not path.exists():
        raise ModelNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text())
        return ModelConfig.from_hf(SimpleNamespace(**raw))
    except (AttributeError, TypeError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"cannot read the config in {folder}: {exc}") from exc


def build_model(config: ModelConfig, hf_state: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> Transformer:
    """Our module with these weights, built without a wasted random initialisation."""
    model = Transformer(config)  # uninitialised storage, replaced by the checkpoint's tensors
    load_into(model, {k: v.to(device=device, dtype=dtype) for k, v in hf_state.items()})
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer. A ``tokenizer.json`` loads straight into the fast class,
    skipping AutoTokenizer's config resolution (~1.3 s of imports at every start)."""
    if (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def load_hf_folder(folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a Hugging Face folder (config.json + safetensors + tokenizer files)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    config = read_model_config(folder)
    state = read_safetensors(safetensors_files(folder), dtype)
    model = build_model(config, state, device, dtype)
    tokenizer = load_tokenizer(folder)
    meta = json.loads((folder / META_FILE).read_text()) if (folder / META_FILE).exists() else {}
    return LoadedModel(meta.get("name", folder.name), folder, config, model, tokenizer, meta.get("fingerprint"))


def _progress(message: str) -> None:
    print(f"kvblend: {message}", file=sys.stderr, flush=True)


def _write_converted(gguf: Path, out: Path, name: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _progress(f"reading tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _progress("dequantising weights (one time)")
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))
    meta = {"name": name, "source": str(gguf), "fingerprint": fingerprint_files([out / "model.safetensors"])}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))


def gguf_digest(gguf: Path) -> str:
    """sha256 of a GGUF, remembered per (path, size, mtime) so warm starts skip re-hashing."""
    st = gguf.stat()
    memo = cache_home() / "gguf-digests.json"
    stamp = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    known = json.loads(memo.read_text()) if memo.exists() else {}
    if stamp not in known:
        known[stamp] = sha256_file(gguf)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    return known[stamp]


def convert_gguf(gguf: str | Path, name: str | None = None) -> Path:
    """Convert a GGUF file into the model cache once; return the cached folder."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    folder = cache_home() / "models" / gguf_digest(gguf)[:24]
    if (folder / META_FILE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        _write_converted(gguf, tmp, name or gguf.stem)
        tmp.rename(folder)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, KvblendError):
            raise
        raise UnsupportedModelError(f"cannot convert {gguf}: {exc}") from exc
    _progress(f"converted model cached in {folder}")
    return folder


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load by packaged short name, Hugging Face folder, or GGUF file path."""
    from kvblend.models.registry import resolve_packaged

    path = Path(spec)
    if path.suffix == ".gguf":
        return load_hf_folder(convert_gguf(path), device, dtype)
    if path.is_dir():
        return load_hf_folder(path, device, dtype)
    return load_hf_folder(resolve_packaged(spec), device, dtype)
