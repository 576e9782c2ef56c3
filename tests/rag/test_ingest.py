"""Ingest: incremental, consistent after a kill mid-batch, bad input skipped and counted."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from kvblend.rag.ask import ask, chunk_prefix
from kvblend.store.keys import chunk_key
from tests.rag.helpers import corpus_texts, pipeline, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def _consistent(engine, retriever, tenant: str = "default") -> tuple[int, int]:
    """Every committed chunk has its vector and its KV; every document's chunks exist."""
    cat = retriever.catalog
    docs = cat.documents(tenant)
    ids, _ = cat.all_texts(tenant)
    assert set(ids) <= retriever.index.ids(tenant)
    ctx = engine.key_context(chunk_prefix(engine), tenant)
    for row in cat.chunks(tenant, ids):
        assert row.kv_ready and engine.store.contains(chunk_key(row.token_ids, ctx))
    for doc in docs:
        assert len(cat.chunks(tenant, list(doc.chunk_ids))) == len(set(doc.chunk_ids))
    return len(docs), len(ids)


def test_ingest_is_incremental(tmp_path):
    paths = write_corpus(tmp_path / "docs", 6)
    engine, retriever, ingestor = pipeline(tmp_path)
    first = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert (first.files, first.documents, first.unchanged) == (6, 6, 0)
    assert first.chunks_new == first.kv_chunks > 6 and first.tokens_new == first.kv_tokens
    assert _consistent(engine, retriever) == (6, first.chunks_new)
    again = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert (again.unchanged, again.chunks_new, again.kv_chunks) == (6, 0, 0)
    paths[0].write_text(paths[0].read_text() + " rome rome rome .")  # only its last chunk changes
    (tmp_path / "docs" / "copy.txt").write_text(paths[1].read_text())  # same chunks as doc001
    third = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert third.unchanged == 5 and third.chunks_new == 1 and third.kv_chunks == 1 and third.removed_chunks == 1
    assert _consistent(engine, retriever) == (7, first.chunks_new)
    retriever.close()
    engine.close()


def test_reingest_restores_chunk_kv_that_left_the_store(tmp_path):
    """An unchanged corpus whose chunk KV was cleared (or keyed anew by another model or key
    version) gets its KV computed again, not the stale word of the catalog."""
    write_corpus(tmp_path / "docs", 3)
    engine, retriever, ingestor = pipeline(tmp_path)
    first = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert engine.store.clear("default") > 0
    again = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert (again.unchanged, again.chunks_new) == (3, 0)
    assert again.kv_chunks == first.kv_chunks and again.kv_tokens == first.kv_tokens
    assert _consistent(engine, retriever) == (3, first.chunks_new)
    retriever.close()
    engine.close()


def test_killed_mid_batch_leaves_a_consistent_index_and_a_rerun_completes(tmp_path):
    write_corpus(tmp_path / "docs", 30)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.rag.helpers", str(tmp_path), str(tmp_path / "docs"), "0.3"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from kvblend.rag.catalog import Catalog

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (tmp_path / "index" / "catalog.sqlite").exists() and Catalog(tmp_path / "index" / "catalog.sqlite").version("default") >= 2:
            break
        time.sleep(0.05)
    time.sleep(0.15)  # inside a later batch (each embed sleeps 0.3 s)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    engine, retriever, ingestor = pipeline(tmp_path)
    docs, chunks = _consistent(engine, retriever)
    assert 0 < docs < 30
    summary = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert summary.unchanged == docs and summary.chunks_new > 0
    assert _consistent(engine, retriever) == (30, chunks + summary.chunks_new)
    assert retriever.index.ids("default") == set(retriever.catalog.all_texts("default")[0])  # strays reconciled
    retriever.close()
    engine.close()


def test_bad_files_are_skipped_and_counted(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "good.md").write_text("# title\n" + corpus_texts(1)[0])
    (d / "empty.txt").write_text("   \n")
    (d / "binary.txt").write_bytes(b"abc\x00\x01\x02")
    (d / "latin1.txt").write_bytes("caf\xe9 city".encode("latin-1"))
    (d / "image.png").write_bytes(b"\x89PNG")
    (d / "bad.jsonl").write_text('{"text": "the city"}\nnot json\n')
    (d / "broken.pdf").write_bytes(b"%PDF-1.4 not really")
    (d / "page.html").write_text("<html><head><style>x{}</style></head><body><h1>the city</h1><p>paris river</p></body></html>")
    (d / "recs.jsonl").write_text('{"text": "the model"}\n\n{"text": "the cache"}\n')
    locked = d / "locked.txt"
    locked.write_text("the city")
    locked.chmod(0)
    engine, retriever, ingestor = pipeline(tmp_path)
    s = ingestor.ingest([d, tmp_path / "missing"], progress=False)
    reasons = dict(s.skipped)
    assert "empty" in reasons[str(d / "empty.txt")] and "binary" in reasons[str(d / "binary.txt")]
    assert "UTF-8" in reasons[str(d / "latin1.txt")] and "unsupported" in reasons[str(d / "image.png")]
    assert "line 2" in reasons[str(d / "bad.jsonl")] and "PDF" in reasons[str(d / "broken.pdf")]
    assert "no such" in reasons[str(tmp_path / "missing")]
    if os.geteuid() != 0:
        assert "permission" in reasons[str(locked)]
    assert s.files == len({"good.md", "page.html", "recs.jsonl"}) + (os.geteuid() == 0)
    sources = {doc.source for doc in retriever.catalog.documents("default")}
    assert f"{d / 'recs.jsonl'}#3" in sources and str(d / "page.html") in sources
    empty = ingestor.ingest([tmp_path / "nothing"], progress=False) if (tmp_path / "nothing").mkdir() is None else None
    assert empty.files == 0 and empty.skipped == [] and empty.chunks_new == 0
    retriever.close()
    engine.close()


def test_a_file_deleted_renamed_emptied_or_shortened_is_not_served_after_the_next_ingest(tmp_path):
    """Re-ingesting a folder mirrors it: a document whose file was deleted or renamed,
    now holds no text, or a JSONL record the file no longer has, is removed with its
    chunks and vectors; documents outside the folders ingested, and hidden ones when
    hidden files were not read, are left alone."""
    paths = write_corpus(tmp_path / "docs", 4)
    d = tmp_path / "docs"
    (d / "gone.txt").write_text("the madrid budget was approved . " * 4)
    (d / "recs.jsonl").write_text('{"text": "the novel was published in lisbon ."}\n'
                                  '{"text": "the river city of rome ."}\n')
    (d / ".hidden.txt").write_text("the oslo company is headquartered by the river .")
    other = write_corpus(tmp_path / "other", 1, seed=5)[0]
    engine, retriever, ingestor = pipeline(tmp_path)
    ingestor.ingest([d, other], progress=False, hidden=True)
    cat = retriever.catalog

    def sources():
        return {Path(doc.source).name for doc in cat.documents("default")}

    assert sources() == {"doc000.txt", "doc001.txt", "doc002.txt", "doc003.txt", "gone.txt", "recs.jsonl#1",
                         "recs.jsonl#2", ".hidden.txt", other.name}
    gone = set(cat.document("default", str(d / "gone.txt")).chunk_ids)
    (d / "gone.txt").unlink()
    paths[0].rename(d / "renamed.txt")
    paths[1].write_text("  \n")
    (d / "recs.jsonl").write_text('{"text": "the novel was published in lisbon ."}\n')
    s = ingestor.ingest([d], progress=False)
    assert sources() == {"renamed.txt", "doc002.txt", "doc003.txt", "recs.jsonl#1", ".hidden.txt", other.name}
    assert s.removed_documents == 4 and s.removed_chunks > len(gone)
    assert not cat.existing("default", gone) and not gone & retriever.index.ids("default")
    hits = retriever.search("default", "the madrid budget was approved", 6, "bm25")
    assert all(Path(h.source).name != "gone.txt" for h in hits)
    assert _consistent(engine, retriever)[0] == 6 and cat.unreferenced("default") == []
    retriever.close()
    engine.close()


def test_a_file_skipped_for_any_other_cause_keeps_its_documents(tmp_path, monkeypatch):
    """Only a file that is gone loses its documents. The first version of the pruning also
    dropped a folder that could not be listed, a JSONL file with a half-written line and a
    file now unreadable as text: a passing fault (a stale mount, an append in progress, a
    missing reader extra) emptied the index of them."""
    d = tmp_path / "docs"
    write_corpus(d, 2)
    write_corpus(d / "sub", 2, seed=3)
    records = '{"text": "the novel was published in lisbon ."}\n{"text": "the river city of rome ."}\n'
    (d / "recs.jsonl").write_text(records)
    (d / "later.txt").write_text("the oslo company is headquartered by the river .")
    engine, retriever, ingestor = pipeline(tmp_path)
    ingestor.ingest([d], progress=False)

    def sources():
        return {doc.source for doc in retriever.catalog.documents("default")}

    before = sources()
    assert len(before) == 7
    (d / "recs.jsonl").write_text(records + '{"text": "half wri')  # an append in progress
    (d / "later.txt").write_bytes(b"the oslo company\x00")  # not text any more, but still there
    walk = os.walk

    def unlisted_sub(top, onerror=None, **kw):  # root lists every folder: a stale mount, simulated
        for folder, dirs, names in walk(top, **kw):
            if "sub" in dirs:
                dirs.remove("sub")
                onerror(PermissionError(13, "Permission denied", str(d / "sub")))
            yield folder, dirs, names

    monkeypatch.setattr(os, "walk", unlisted_sub)
    s = ingestor.ingest([d], progress=False)
    assert sources() == before and s.removed_documents == 0
    assert (str(d / "sub"), "folder unreadable: Permission denied") in s.skipped
    retriever.close()
    engine.close()


def test_a_file_with_a_nul_byte_past_its_first_8_kib_is_skipped_as_binary_and_keeps_its_documents(tmp_path):
    """A NUL byte was looked for in the first 8 KiB only: one further in was ingested as
    text. It now skips the file as binary, which (like any skip but "no text") keeps what
    the index has of it."""
    d = tmp_path / "docs"
    d.mkdir()
    text = " ".join(corpus_texts(60)) + "\n"
    assert len(text) > 8192
    (d / "long.txt").write_text(text)
    engine, retriever, ingestor = pipeline(tmp_path, precompute="lazy", size=256)
    ingestor.ingest([d], progress=False)
    before = retriever.catalog.document("default", str(d / "long.txt"))
    (d / "long.txt").write_text(text + "tail\x00")
    s = ingestor.ingest([d], progress=False)
    assert s.skipped == [(str(d / "long.txt"), f"binary content (NUL byte at offset {len(text) + 4})")]
    assert retriever.catalog.document("default", str(d / "long.txt")) == before and s.removed_documents == 0
    retriever.close()
    engine.close()


def test_a_symlinked_folder_is_ingested_under_the_link_and_dropped_with_it(tmp_path):
    """A symlinked folder was silently left out of an ingest. Its files are now documents
    named by the link's path, which a later run drops once the link is removed."""
    d = tmp_path / "docs"
    write_corpus(d, 1)
    write_corpus(tmp_path / "shared", 2, seed=4)
    (d / "team").symlink_to(tmp_path / "shared")
    engine, retriever, ingestor = pipeline(tmp_path, precompute="lazy")
    s = ingestor.ingest([d], progress=False)

    def sources():
        return {doc.source for doc in retriever.catalog.documents("default")}

    assert s.files == 3 and s.skipped == []
    assert {str(d / "team" / "doc000.txt"), str(d / "team" / "doc001.txt")} < sources()
    (d / "team").unlink()
    s = ingestor.ingest([d], progress=False)
    assert sources() == {str(d / "doc000.txt")} and s.removed_documents == 2
    retriever.close()
    engine.close()


def test_which_sources_a_run_covers_and_which_are_gone(tmp_path):
    from kvblend.rag.ingest import _record_file, _Scope

    assert _record_file("/d/a.jsonl#3") == "/d/a.jsonl"
    assert _record_file("/d/notes#2.md") == "/d/notes#2.md"  # a file named with '#', not a record
    assert _record_file("/d/a.txt#3") == "/d/a.txt#3"
    scope = _Scope(("/d", "/d/.archive"), ("/e/notes",), hidden=False)
    assert scope.covers("/d/.archive/x.txt")  # named itself, whatever folder came first
    assert not scope.covers("/d/.other/x.txt") and not scope.covers("/e/notes#2.md")
    (tmp_path / "a.jsonl").write_text("{}")
    jsonl = str(tmp_path / "a.jsonl")
    scope = _Scope((str(tmp_path),), (), hidden=False)
    assert not scope.gone(jsonl + "#2")  # its file was not read to the end
    scope.finished.add(jsonl)
    assert scope.gone(jsonl + "#2") and not scope.gone(jsonl)
    assert scope.gone(str(tmp_path / "deleted.txt"))


def test_ask_retrieves_blends_and_lazy_precompute_waits_for_the_nth_retrieval(tmp_path):
    write_corpus(tmp_path / "docs", 8)
    engine, retriever, ingestor = pipeline(tmp_path, precompute="lazy")
    retriever.catalog.set_meta("precompute_after:default", "2")
    s = ingestor.ingest([tmp_path / "docs"], progress=False)
    assert s.kv_chunks == 0 and s.chunks_new > 0
    from kvblend.generation import SamplingParams

    streamed = []
    question = corpus_texts(8)[3][:60]
    admission = engine.store.admission
    a = ask(engine, retriever, question, top_k=3, sampling=SamplingParams(max_tokens=4), compare=True,
            on_text=streamed.append)
    assert len(a.hits) == 3 and a.hits[0].source.endswith("doc003.txt")
    assert "".join(streamed) == a.result.text and a.full.stats.method == "full"
    assert [d.tokens for d in a.result.stats.docs] == [len(h.token_ids) for h in a.hits]
    assert not any(d.hit for d in a.result.stats.docs)  # nothing precomputed
    assert engine.store.stats("default").puts == 0  # first retrieval: not stored yet
    assert engine.store.admission is admission  # the lazy swap never outlives the request
    # each time asked in other words (the same prompt again would be served the first blend
    # whole from the prefix cache, its documents not looked up): the same passages retrieved
    b = ask(engine, retriever, question + " ?", top_k=3, sampling=SamplingParams(max_tokens=4))
    assert [h.source for h in b.hits] == [h.source for h in a.hits]
    assert engine.store.stats("default").puts == 3  # second retrieval: written back
    c = ask(engine, retriever, question + " !", top_k=3, sampling=SamplingParams(max_tokens=4))
    assert all(d.hit for d in c.result.stats.docs) and b.result.stats.docs[0].source == "chunk"
    retriever.close()
    engine.close()


def test_a_document_that_changes_while_read_leaves_no_chunk_behind(tmp_path):
    """A file that changes part-way through its chunks is skipped; the chunks already
    committed for it (small batches commit early) are dropped at the end of the run, so
    retrieval never finds text no stored document has."""
    from kvblend.rag.readers import Document, SkipFile

    class Changing(Document):
        def pieces(self, max_chars: int = 4096):
            yield self.text[: len(self.text) // 2]
            raise SkipFile("changed while being read")

    engine, retriever, ingestor = pipeline(tmp_path, batch=1)
    good, bad = corpus_texts(2, words=60, seed=3)
    summary = ingestor.ingest_documents([Document("good.txt", good), Changing("bad.txt", bad)], progress=False)
    assert [s for s, _ in summary.skipped] == ["bad.txt"]
    assert summary.removed_chunks > 0  # it had committed some
    cat = retriever.catalog
    ids, _ = cat.all_texts("default")
    assert set(ids) == set(cat.document("default", "good.txt").chunk_ids)
    assert retriever.index.ids("default") == set(ids)
    assert cat.unreferenced("default") == []
    retriever.close()
    engine.close()


def test_orphans_are_found_from_the_chunk_index_not_by_reading_every_document(tmp_path, monkeypatch):
    """Re-ingesting changed documents asks, per document, which of its old chunks another
    document still uses; that read every document row each time, so ingest time grew with
    the square of the corpus (the commit that added the index has the figures). A catalog
    written before the index gets it when opened."""
    from kvblend.rag.catalog import Catalog
    from kvblend.rag.readers import Document

    engine, retriever, ingestor = pipeline(tmp_path)
    texts = corpus_texts(4, words=40, seed=5)
    ingestor.ingest_documents([Document(f"d{i}", t) for i, t in enumerate(texts)], progress=False)
    monkeypatch.setattr(Catalog, "documents", lambda *a: (_ for _ in ()).throw(AssertionError("read every row")))
    again = ingestor.ingest_documents([Document("d0", texts[1]), Document("d1", texts[1] + " more .")],
                                      progress=False)
    assert again.removed_chunks > 0
    monkeypatch.undo()
    cat = retriever.catalog
    kept = {c for d in cat.documents("default") for c in d.chunk_ids}
    assert set(cat.all_texts("default")[0]) == kept
    # a catalog from before the index: filled once when opened
    path = tmp_path / "index" / "catalog.sqlite"
    retriever.close()
    raw = sqlite3.connect(path)
    raw.execute("DELETE FROM doc_chunks")
    raw.execute("DELETE FROM meta WHERE key = 'doc_chunks'")
    raw.commit()
    raw.close()
    reopened = Catalog(path)
    d2 = reopened.document("default", "d2")
    assert reopened.orphans("default", d2.chunk_ids, exclude_source="d2") == list(dict.fromkeys(d2.chunk_ids))
    assert reopened.orphans("default", d2.chunk_ids, exclude_source="nobody") == []
    reopened.close()
    engine.close()


def test_a_second_ingest_into_one_index_is_refused_while_the_first_runs(tmp_path):
    """Two ingests into one index each write the vector index from their own copy, and the
    last to write loses the other's vectors for good (a re-run skips unchanged documents):
    the second is refused at once, naming the first's pid; the lock goes with its holder."""
    import pytest

    from kvblend.rag.ingest import IngestBusyError, writing
    from kvblend.rag.readers import Document

    engine, retriever, ingestor = pipeline(tmp_path)
    docs = [Document("a.txt", corpus_texts(1, seed=9)[0])]
    with writing(tmp_path / "index"):  # the first ingest (another process holds an flock alike)
        with pytest.raises(IngestBusyError, match=f"pid {os.getpid()}"):
            ingestor.ingest_documents(docs, progress=False)
    assert retriever.catalog.document("default", "a.txt") is None  # refused before anything was written
    assert ingestor.ingest_documents(docs, progress=False).documents == 1  # free again
    retriever.close()
    engine.close()


def test_the_chunk_index_follows_documents_written_by_a_version_that_knows_nothing_of_it(tmp_path):
    """Triggers keep ``doc_chunks``: rows an older kvblend writes into the same catalog are
    indexed too, so the end-of-run sweep never drops their chunks."""
    from kvblend.rag.catalog import Catalog, NewChunk

    cat = Catalog(tmp_path / "catalog.sqlite")
    cat.commit("default", [NewChunk("c1", "old.txt", 0, "text", (1, 2), True)])
    assert cat.unreferenced("default") == ["c1"]
    cat._db.execute("INSERT OR REPLACE INTO documents VALUES ('default', 'old.txt', 'sha', '[\"c1\"]', 2)")
    assert cat.unreferenced("default") == [] and cat.orphans("default", ["c1"], exclude_source="x") == []
    cat._db.execute("DELETE FROM documents WHERE source = 'old.txt'")
    assert cat.unreferenced("default") == ["c1"]
    cat.close()


def test_progress_moves_a_chunk_at_a_time_and_names_the_file_of_how_many(tmp_path, monkeypatch):
    """The bar moved once per 32-chunk batch (0 chunks shown for minutes while KV was
    being computed) and gave no total."""
    import kvblend.rag.ingest as ingest_module

    class Bar:
        def __init__(self, **kw) -> None:
            self.updates, self.postfixes = [], []

        def __enter__(self):
            bars.append(self)
            return self

        def __exit__(self, *exc) -> None:
            pass

        def update(self, n: int) -> None:
            self.updates.append(n)

        def set_postfix_str(self, text: str, refresh: bool = True) -> None:
            self.postfixes.append(text)

    bars: list[Bar] = []
    monkeypatch.setattr(ingest_module, "_progress", lambda enabled: Bar)
    write_corpus(tmp_path / "docs", 3)
    engine, retriever, ingestor = pipeline(tmp_path)
    summary = ingestor.ingest([tmp_path / "docs"], progress=True)
    assert bars[0].updates == [1] * summary.chunks_new and summary.chunks_new > 3
    assert bars[0].postfixes == ["file 1/3", "file 2/3", "file 3/3"]
    retriever.close()
    engine.close()
