"""Fixtures for retrieval tests: a deterministic hashing embedder (no model) and the real
all-MiniLM-L6-v2 loaded once per module."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest


class HashEmbedder:
    """Bag of words hashed into ``dim`` buckets, L2-normalised: similar texts share words."""

    name = "hash-test"

    def __init__(self, dim: int = 64, delay_s: float = 0.0) -> None:
        self.dim = dim
        self.delay_s = delay_s

    def encode(self, texts):
        import time

        time.sleep(self.delay_s)
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-9)


@pytest.fixture
def hash_embedder():
    return HashEmbedder()


@pytest.fixture(scope="module")
def minilm():
    from kvblend.rag.embed import MiniLMEmbedder

    emb = MiniLMEmbedder()
    emb.encode(["warm up"])
    return emb
