"""Vector-index backends by name: ``faiss`` built in (imported on first use), others added
with ``register_backend`` and picked through ``RetrieverConfig.vector_backend``. Sits above
both the ``VectorIndex`` protocol and its implementations, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvblend.rag.vector_index import VectorIndex

IndexBuilder = Callable[[Path, int], VectorIndex]
BACKENDS: dict[str, IndexBuilder] = {}


def register_backend(name: str, builder: IndexBuilder) -> None:
    """Make ``name`` selectable as ``RagConfig.vector_backend``."""
    BACKENDS[name] = builder


def build_vector_index(name: str, folder: Path, dim: int) -> VectorIndex:
    """The index backend ``name`` over ``folder`` for vectors of ``dim`` columns."""
    if name == "faiss" and name not in BACKENDS:
        from kvblend.rag.faiss_index import FaissIndex

        register_backend("faiss", FaissIndex)
    if name not in BACKENDS:
        raise ValueError(f"unknown vector backend {name!r}; known: {', '.join(sorted(BACKENDS)) or 'faiss'}")
    return BACKENDS[name](folder, dim)
