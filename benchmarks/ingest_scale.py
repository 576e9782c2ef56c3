"""How ingest time grows with the corpus: N documents ingested fresh, then all of them changed.

    PYTHONPATH=src .venv/bin/python benchmarks/ingest_scale.py [N ...]   (default 1000 2000 4000)

BM25 only, lazy KV (no embedding model, no chunk KV computed), the default model's
tokenizer (no weights), 16-token chunks; each document ~3 sentences of its own words, so no
chunk is shared. Prints the seconds per phase and, per doubling of N, how much each grew:
about 2x is linear; 4x is quadratic (what the catalog did before its chunk index, session
14: 4000 documents took 52.7 s fresh and 111 s all changed).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from kvblend.models import load_model
from kvblend.models.registry import DEFAULT_MODEL
from kvblend.rag.chunking import ChunkerConfig
from kvblend.rag.ingest import IngestConfig, Ingestor
from kvblend.rag.readers import Document
from kvblend.rag.retriever import Retriever, RetrieverConfig


def run(loaded, n: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as folder:
        retriever = Retriever(RetrieverConfig(Path(folder), mode="bm25"))
        config = IngestConfig(ChunkerConfig("tokens", 32), dense=False, precompute="lazy")
        ingestor = Ingestor(retriever, loaded.tokenizer, loaded.tokenizer_fingerprint, config)
        try:
            timed = []
            for words in ("says the river {i} runs east of town {i} .", "now says the lake {i} lies west ."):
                docs = [Document(f"doc{i}", f"document number {i} {words.format(i=i)} " * 3) for i in range(n)]
                t = time.perf_counter()
                ingestor.ingest_documents(docs, progress=False)
                timed.append(time.perf_counter() - t)
        finally:
            retriever.close()
    return timed[0], timed[1]


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv] or [1000, 2000, 4000]
    loaded = load_model(DEFAULT_MODEL, "cpu", torch.float32, weights=False)
    last = None
    for n in sizes:
        fresh, changed = run(loaded, n)
        grew = "" if last is None else f"  (x{fresh / last[0]:.1f} / x{changed / last[1]:.1f} for x{n / last[2]:.1f} documents)"
        print(f"{n:6d} documents: fresh {fresh:6.2f} s, all changed {changed:6.2f} s{grew}", flush=True)
        last = (fresh, changed, n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
