"""GGUF files converted once into the local model cache.

A GGUF is read once through transformers (slow: it dequantises every tensor) and
converted into the local model cache (safetensors + tokenizer files, keyed by the
GGUF's sha256). Later starts read that folder. One process converts a GGUF at a time (a
lock beside the folder): another waits, then reads what it wrote. Below the loader and the
packaged-model registry, which both use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from kvblend.errors import KvblendError, ModelNotFoundError, UnsupportedModelError
from kvblend.models.weights import fingerprint_files

META_FILE = "kvblend.json"
_BARS = threading.Lock()  # the switch below swaps a module global: one conversion at a time holds it


def cache_home() -> Path:
    """Root of kvblend's local caches: ``$KVBLEND_HOME`` or ``~/.cache/kvblend``."""
    return Path(os.environ.get("KVBLEND_HOME") or Path.home() / ".cache" / "kvblend")


def _progress(message: str) -> None:
    print(f"kvblend: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _bars_as_configured() -> Iterator[None]:
    """transformers' GGUF reader draws its tensor bar with tqdm directly, past
    ``transformers.utils.logging.disable_progress_bar()`` (`kvblend ingest --quiet`): for
    the conversion, its bar follows that switch. Conversions in one process take turns
    here: two at once would each save the other's stand-in, and the last to leave would put
    one back for good."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    with _BARS:
        bar = reader.tqdm
        if not hf_logging.is_progress_bar_enabled():
            reader.tqdm = functools.partial(bar, disable=True)
        try:
            yield
        finally:
            reader.tqdm = bar


def _write_converted(gguf: Path, out: Path, name: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _progress(f"reading tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _progress("dequantising weights (one time)")
    with _bars_as_configured():
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
        known[stamp] = fingerprint_files([gguf])
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
    with _converting(folder):
        if not (folder / META_FILE).exists():  # else the process this one waited for wrote it
            _convert_into(gguf, folder, name or gguf.stem)
    return folder


@contextlib.contextmanager
def _converting(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s conversion lock (an ``flock``, dropped if its holder dies),
    waiting for a process converting the same GGUF."""
    with open(folder.parent / f".{folder.name}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _progress(f"another process is converting this GGUF into {folder}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_into(gguf: Path, folder: Path, name: str) -> None:
    """Convert into a temp folder beside ``folder``, then rename it; first remove the temp
    folders of conversions of this GGUF that were killed (only the lock's holder converts)."""
    for stale in folder.parent.glob(f".convert-{folder.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{folder.name}-", dir=folder.parent))
    try:
        _write_converted(gguf, tmp, name)
        tmp.rename(folder)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, KvblendError):
            raise
        raise UnsupportedModelError(f"cannot convert {gguf}: {exc}") from exc
    _progress(f"converted model cached in {folder}")
