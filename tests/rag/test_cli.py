"""`kvblend ingest` then `kvblend ask` (no --doc) on the real SmolLM2; defaults under KVBLEND_HOME."""

from __future__ import annotations

import logging

from kvblend.cli import main
from kvblend.commands.ingest import default_store_dir
from kvblend.rag.retriever import default_index_dir

DOCS = {
    "lighthouse.md": "# Vormsi\n\nThe lighthouse keeper of Vormsi island is Theodora Quill. She has kept the lamp "
                     "since 1987 and lives in the white house beside the tower.\n",
    "bakery.txt": "The bakery on Harbour Street sells rye bread every morning. It was opened in 1952 by two brothers.\n",
}


def test_defaults_live_under_kvblend_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    assert default_index_dir("ab" * 32) == tmp_path / "rag" / ("ab" * 8)
    assert default_store_dir() == tmp_path / "kv"


def test_empty_folder_says_so_and_loads_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["ingest", str(tmp_path / "empty"), "--index", str(tmp_path / "idx")]) == 1
    assert "the folder is empty" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.bin").write_bytes(b"\x00")
    assert main(["ingest", str(tmp_path / "bad"), "--index", str(tmp_path / "idx")]) == 1
    assert "unsupported type .bin" in capsys.readouterr().err
    assert not (tmp_path / "idx").exists()  # nothing half-written


def test_ingest_then_ask_by_retrieval_on_smollm2(tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    flags = ["--index", str(tmp_path / "idx"), "--store-dir", str(tmp_path / "kv")]
    assert main(["ingest", str(folder), "--quiet", "--chunk-tokens", "64", *flags]) == 0
    out = capsys.readouterr().out
    assert "ingested 2 file(s), 2 document(s) (0 unchanged)" in out and "2 computed" in out
    assert "economics:" in out and ("pays for itself" in out or "saves nothing" in out)
    assert main(["ask", "Who keeps the lighthouse on Vormsi?", "--chunks", "1", "--max-tokens", "6", "--compare",
                 *flags]) == 0
    captured = capsys.readouterr()
    assert "lighthouse.md (chunk 0" in captured.err and "KV: disk" in captured.err
    assert "[compare] full prefill TTFT" in captured.err and captured.out.strip()
    assert main(["ingest", str(folder), "--quiet", *flags[:2], *flags[2:], "--chunk-tokens", "64"]) == 0
    assert "(2 unchanged)" in capsys.readouterr().out


def test_ask_without_an_index_says_so_and_creates_no_folder(tmp_path, monkeypatch, capsys):
    """``kvblend ask`` without ``--index`` opened the default index folder
    ($KVBLEND_HOME/rag/<tokenizer>), which created it (and an empty catalog) before saying
    "nothing retrieved"; a folder with no catalog named by ``--index`` got one too."""
    from tests.conftest import make_loaded

    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("kvblend.cliargs.load_from_args", lambda args: make_loaded())
    assert main(["ask", "why?", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "no index at" in err and "kvblend ingest" in err
    assert not (tmp_path / "home" / "rag").exists()
    (tmp_path / "not-an-index").mkdir()
    assert main(["ask", "why?", "--index", str(tmp_path / "not-an-index")]) == 2
    assert "no index at" in capsys.readouterr().err and not any((tmp_path / "not-an-index").iterdir())


def test_chunks_is_a_positive_integer_with_a_bound_before_anything_loads(capsys):
    """``--chunks 0`` (or 101) passed the parser and failed only after the model loaded,
    naming ``top_k``, a name the command line does not have."""
    import pytest

    for command in (["ask", "why?"], ["demo"]):
        for bad in ("0", "-2", "101", "1.5", "true"):
            with pytest.raises(SystemExit):
                main([*command, "--chunks", bad])
            assert "argument --chunks: must be an integer in [1, 100]" in capsys.readouterr().err


def test_quiet_ingest_keeps_pypdfs_notes_off_the_terminal_and_still_lists_a_broken_pdf(tmp_path, monkeypatch,
                                                                                       capsys, caplog):
    """pypdf logs a warning for each fault it repairs while reading ("incorrect startxref
    pointer", with no file named), which printed under ``--quiet``; a PDF it cannot read at
    all is still skipped and listed with its reason."""
    from tests.conftest import make_loaded
    from tests.rag.helpers import pdf_bytes

    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("kvblend.cliargs.load_from_args", lambda args: make_loaded())
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "repaired.pdf").write_bytes(pdf_bytes("The keeper is Theodora Quill").replace(b"startxref\n", b"startxref\n9"))
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4\nnot a pdf at all\n")
    argv = ["ingest", str(folder), "--quiet", "--retriever", "bm25", "--precompute", "lazy", "--index",
            str(tmp_path / "idx"), "--store-dir", str(tmp_path / "kv")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert not [r for r in caplog.records if r.name.startswith("pypdf")]  # the terminal's handler gets none either
    assert "startxref" not in captured.err and "ingested 1 file(s)" in captured.out
    assert "skipped 1 file(s):" in captured.out and "broken.pdf: unreadable PDF" in captured.out
    assert logging.getLogger("pypdf").level == logging.NOTSET  # as it was: the switch is the ingest's only
