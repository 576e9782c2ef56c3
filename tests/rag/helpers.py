"""An ingest pipeline on the tiny model and the hashing embedder; run as a script it ingests
a folder slowly (for the interruption test, which kills it mid-way)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tests.conftest import WORDS, make_loaded
from tests.rag.conftest import HashEmbedder


def pdf_bytes(text: str) -> bytes:
    """A one-page PDF showing ``text`` in Helvetica, with a correct xref table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def corpus_texts(n: int, words: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = [w for w in WORDS if w.isalpha()]
    return [" ".join(rng.choice(vocab, words)) + " ." for _ in range(n)]


def write_corpus(folder: Path, n: int, seed: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(corpus_texts(n, seed=seed)):
        p = folder / f"doc{i:03d}.txt"
        p.write_text(text)
        paths.append(p)
    return paths


def pipeline(home: Path, delay_s: float = 0.0, batch: int = 4, precompute: str = "all", size: int = 16):
    """(engine, retriever, ingestor) over ``home``/kv and ``home``/index."""
    from kvblend.engine import Engine
    from kvblend.rag.chunking import ChunkerConfig
    from kvblend.rag.ingest import IngestConfig, Ingestor, KvWarmer
    from kvblend.rag.retriever import Retriever, RetrieverConfig
    from kvblend.store.config import StoreConfig, build_store

    loaded = make_loaded()
    engine = Engine(loaded, store=build_store(StoreConfig(disk_dir=str(home / "kv"), disk_fsync=False)))
    retriever = Retriever(RetrieverConfig(home / "index"), embedder=HashEmbedder(delay_s=delay_s))
    config = IngestConfig(ChunkerConfig("tokens", size), batch_size=batch, precompute=precompute)
    ingestor = Ingestor(retriever, loaded.tokenizer, loaded.tokenizer_fingerprint, config, KvWarmer(engine))
    return engine, retriever, ingestor


if __name__ == "__main__":
    home, folder = Path(sys.argv[1]), Path(sys.argv[2])
    engine, retriever, ingestor = pipeline(home, delay_s=float(sys.argv[3]))
    print("started", flush=True)
    ingestor.ingest([folder], progress=False)
    print("finished", flush=True)
