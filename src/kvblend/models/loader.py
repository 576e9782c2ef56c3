"""Loading a model: from a Hugging Face folder, a GGUF file, or a packaged short name.

A GGUF is converted once into the local model cache (``models.gguf``); later starts
read that folder and take seconds. Every identity a chunk key needs (weights
fingerprint, tokenizer fingerprint, config digest) is computed when the model is
loaded, never lazily on a request thread.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvblend.errors import KvblendError, ModelNotFoundError, UnsupportedModelError
from kvblend.models.config import ModelConfig, kv_config_digest
from kvblend.models.gguf import META_FILE, cache_home, convert_gguf
from kvblend.models.packed import resolve_decode_weights
from kvblend.models.registry import resolve_packaged
from kvblend.models.transformer import Transformer
from kvblend.models.weights import fingerprint_files, load_into, read_safetensors, safetensors_files

__all__ = ["LoadedModel", "META_FILE", "build_model", "cache_home", "convert_gguf", "load_hf_folder", "load_model",
           "load_tokenizer", "read_model_config"]


@dataclass
class LoadedModel:
    """A ready model: our weights, the HF tokenizer, and the identities cache keys need.

    The identities are computed on construction (at load time): ``fingerprint`` (sha256
    of the weight files, stored at conversion, else hashed now), ``tokenizer_fingerprint``
    and ``config_digest`` (``models.config.kv_config_digest``)."""

    name: str
    folder: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Any
    _fingerprint: str | None = field(default=None, repr=False)
    tokenizer_fingerprint: str = field(init=False)
    config_digest: str = field(init=False)

    def __post_init__(self) -> None:
        if self._fingerprint is None:
            self._fingerprint = fingerprint_files(safetensors_files(self.folder))
        self.tokenizer_fingerprint = _tokenizer_fingerprint(self.tokenizer)
        self.config_digest = kv_config_digest(self.config)

    @property
    def fingerprint(self) -> str:
        """sha256 of the weight files."""
        assert self._fingerprint is not None  # set in __post_init__
        return self._fingerprint

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


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


def load_hf_folder(folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, *,
                   weights: bool = True, decode_weights: str = "auto") -> LoadedModel:
    """Load a Hugging Face folder (config.json + safetensors + tokenizer files).

    ``decode_weights`` (``models.packed``): the packed copy decode passes read; ``auto``
    is int8 for fp32 on the CPU, none elsewhere; ``fp32`` is the exact reference.

    ``weights=False``: the module is built on torch's ``meta`` device (shapes, no storage,
    nothing to run): config, tokenizer and fingerprints only, for a process that shapes
    requests and keys chunks but never runs the model (the Ray Serve ingress)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    config = read_model_config(folder)
    if weights:
        kind = resolve_decode_weights(decode_weights, device, dtype)  # a bad kind fails before the read
        model = build_model(config, read_safetensors(safetensors_files(folder), dtype), device, dtype)
        model.pack_decode_weights(kind)
    else:
        with torch.device("meta"):
            model = Transformer(config).to(dtype).eval().requires_grad_(False)
    tokenizer = load_tokenizer(folder)
    meta = json.loads((folder / META_FILE).read_text()) if (folder / META_FILE).exists() else {}
    return LoadedModel(meta.get("name", folder.name), folder, config, model, tokenizer, meta.get("fingerprint"))


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32, *,
               weights: bool = True, decode_weights: str = "auto") -> LoadedModel:
    """Load by packaged short name, Hugging Face folder, or GGUF file path
    (``weights``, ``decode_weights``: see ``load_hf_folder``). An unknown ``device`` is a KvblendError before
    anything is read."""
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvblendError(f"unknown torch device {device!r} (e.g. cpu, cuda, cuda:1): {first[:200]}") from None
    path = Path(spec)
    if path.suffix == ".gguf":
        folder = convert_gguf(path)
    elif path.is_dir():
        folder = path
    else:
        folder = resolve_packaged(spec)
    return load_hf_folder(folder, device, dtype, weights=weights, decode_weights=decode_weights)
