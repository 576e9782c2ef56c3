"""Ingest in bounded memory (issue #21, point 6): a file streams through read -> chunk ->
store a piece and a batch at a time; paths are resolved, hidden folders skipped unless
asked for, and an edited file replaces its chunks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvblend.rag.chunking import ChunkerConfig, chunk_pieces, chunk_text, tokenize_with_offsets
from kvblend.rag.readers import Document, split_pieces
from tests.conftest import WORDS, make_tokenizer
from tests.rag.helpers import corpus_texts, pipeline

ROOT = Path(__file__).resolve().parents[2]
VOCAB = [w for w in WORDS if w.isalpha()]
TOKENS_PER_LINE = 17  # 16 words and "." (the tiny word-level tokenizer drops whitespace)
# A measured run over 16 MiB before streaming: +1.8 GiB peak RSS over 1 MiB. Now a fixed
# allowance covers one piece's tokenization, one batch and SQLite's page cache.
RSS_BUDGET_MIB = 128


def _write_lines(path: Path, mib: float, seed: int = 0) -> int:
    """A text file of random 16-word lines, about ``mib`` MiB; returns its line count."""
    rng, lines, size = np.random.default_rng(seed), 0, 0
    with open(path, "w") as f:
        while size < mib * 2**20:
            rows = rng.integers(0, len(VOCAB), size=(4096, 16)).tolist()
            block = "".join(" ".join(VOCAB[i] for i in row) + " .\n" for row in rows)
            f.write(block)
            size, lines = size + len(block), lines + len(rows)
    return lines


def test_pieces_cut_at_line_ends_and_chunk_like_the_whole_text() -> None:
    tok = make_tokenizer()
    text = "\n".join(corpus_texts(60, words=30))
    pieces = list(split_pieces([text[:700], text[700:]], 1000))
    assert "".join(pieces) == text and len(pieces) > 3
    assert all(len(p) <= 1000 and p.endswith("\n") for p in pieces[:-1])
    config = ChunkerConfig("tokens", 64)
    streamed = list(chunk_pieces(tok, pieces, config, "tok"))
    ids, _ = tokenize_with_offsets(tok, text)
    assert [t for c in streamed for t in c.token_ids] == ids  # word-level: pieces tokenize as the whole
    assert [c.ordinal for c in streamed] == list(range(len(streamed)))
    assert [c.start for c in streamed] == [0] + [c.end for c in streamed[:-1]]
    one = Document("d", text[:900])
    assert list(chunk_pieces(tok, one.pieces(), config, "tok")) == chunk_text(tok, one.text, config, "tok")


def test_paths_are_resolved_hidden_folders_skipped_and_an_edit_replaces_chunks(tmp_path, monkeypatch) -> None:
    docs = tmp_path / "docs"
    (docs / ".git").mkdir(parents=True)
    texts = corpus_texts(3)
    for i, text in enumerate(texts):
        (docs / f"d{i}.txt").write_text(text)
    (docs / ".git" / "notes.txt").write_text(texts[0] + " rome")
    (docs / ".draft.md").write_text(texts[1] + " oslo")
    engine, retriever, ingestor = pipeline(tmp_path)
    monkeypatch.chdir(tmp_path)
    first = ingestor.ingest([Path("docs")], progress=False)
    assert (first.files, first.documents) == (3, 3) and not first.skipped
    sources = {d.source for d in retriever.catalog.documents("default")}
    assert sources == {str(docs / f"d{i}.txt") for i in range(3)}  # absolute, hidden ones left out
    again = ingestor.ingest([docs], progress=False)  # the same documents by another name
    assert (again.unchanged, again.chunks_new) == (3, 0)
    before = retriever.catalog.document("default", str(docs / "d0.txt")).chunk_ids
    (docs / "d0.txt").write_text("the doctor works in oslo . " * 8)
    edited = ingestor.ingest([Path("docs")], progress=False)
    after = retriever.catalog.document("default", str(docs / "d0.txt")).chunk_ids
    assert edited.unchanged == 2 and edited.removed_chunks == len(set(before) - set(after)) > 0
    assert not retriever.catalog.existing("default", set(before) - set(after))
    everything = ingestor.ingest([docs], progress=False, hidden=True)
    assert everything.files == 5 and everything.unchanged == 3
    retriever.close()
    engine.close()


def _peak_rss_mib(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run ``cmd`` from a wrapper process that reports its children's peak RSS
    (``getrusage(RUSAGE_CHILDREN)``), so that nothing else this test run started counts."""
    wrapper = ("import resource, subprocess, sys\n"
               "out = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "assert out.returncode == 0, out.stdout + out.stderr\n"
               "print(out.stdout)\n"
               "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return int(re.search(r"PEAK (\d+)", done.stdout)[1]) / 1024, done.stdout  # ru_maxrss is in KiB


def test_a_large_file_ingests_within_a_fixed_memory_budget(tmp_path) -> None:
    """``kvblend ingest`` (bm25, lazy precompute: no embedding model, no chunk KV) of a
    16 MiB file peaks within ``RSS_BUDGET_MIB`` of the same ingest of a 1 MiB file."""
    from tests.server.helpers import save_tiny_model

    model = str(save_tiny_model(tmp_path / "model"))
    env = {**os.environ, "KVBLEND_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT / "src")}
    peaks = {}
    for mib in (1, 16):
        path = tmp_path / f"big{mib}.txt"
        lines = _write_lines(path, mib)
        cmd = [sys.executable, "-m", "kvblend", "ingest", str(path), "--model", model, "--retriever", "bm25",
               "--precompute", "lazy", "--quiet", "--index", str(tmp_path / f"index{mib}")]
        peaks[mib], out = _peak_rss_mib(cmd, env)
        assert "1 document(s), " in out and f"{lines * TOKENS_PER_LINE} tokens" in out, out  # all of it
    assert peaks[16] - peaks[1] < RSS_BUDGET_MIB, peaks
