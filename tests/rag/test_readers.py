"""Readers: PDF (pypdf), HTML visible text, JSONL records."""

from __future__ import annotations

from kvblend.rag.readers import discover, html_text, read_documents
from tests.rag.helpers import pdf_bytes


def test_pdf_text_is_extracted(tmp_path):
    p = tmp_path / "a.pdf"
    p.write_bytes(pdf_bytes("The lighthouse keeper is Theodora Quill"))
    [doc] = read_documents(p)
    assert "Theodora Quill" in doc.text and doc.source == str(p)


def test_html_keeps_visible_text_and_headings():
    html = ("<html><head><title>t</title><script>var x = 1;</script></head><body><h2>Rivers</h2>"
            "<p>The Tagus &amp; the Douro.</p><div>Lisbon<br>Porto</div></body></html>")
    assert html_text(html) == "## Rivers\n\nThe Tagus & the Douro.\n\nLisbon\nPorto"


def test_html_whose_head_is_never_closed_keeps_its_body():
    """``</head>`` (and ``<body>``) may be left out (HTML's optional tags): the head ends
    where the body's first element starts, so the page is not read as empty."""
    assert html_text("<html><head><title>t</title><body><h1>Rivers</h1><p>The Tagus.</p></body></html>") == \
        "# Rivers\n\nThe Tagus."
    assert html_text("<!doctype html><head><meta charset=utf-8><title>t</title><style>p{}</style>"
                     "<p>Lisbon<p>Porto") == "Lisbon\nPorto"
    # text itself, outside the title, starts the body too (it was dropped as head)
    assert html_text("<head><title>t</title>Meeting at 3.") == "Meeting at 3."
    assert html_text("<head><title>Only a title</title></head>") == ""


def test_jsonl_gives_one_document_per_record(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"body": "one"}\n{"body": "two", "x": 1}\n')
    assert [(d.source, d.text) for d in read_documents(p, "body")] == [(f"{p}#1", "one"), (f"{p}#2", "two")]


def test_jsonl_is_read_a_line_at_a_time_so_no_file_size_cap_applies(tmp_path, monkeypatch):
    """JSONL was read whole (and refused over 256 MiB); now a line at a time: a file over the
    whole-file cap is read, only one line over it is refused, and nothing reads it whole."""
    from pathlib import Path

    import pytest

    from kvblend.rag import readers

    monkeypatch.setattr(readers, "MAX_FILE_BYTES", 1024)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} read whole"))
    p = tmp_path / "big.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b"".join(b'{"text": "record %d of the export"}\n' % i for i in range(200)))
    docs = list(read_documents(p))
    assert len(docs) == 200 and p.stat().st_size > 4 * 1024
    assert (docs[0].source, docs[0].text, docs[-1].source) == (f"{p}#1", "record 0 of the export", f"{p}#200")
    long = tmp_path / "long.jsonl"
    long.write_text('{"text": "ok"}\n{"text": "%s"}\n' % ("x" * 2000))
    with pytest.raises(readers.SkipFile, match="line 2 is longer"):
        read_documents(long)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(readers.SkipFile, match="not UTF-8 \\(invalid byte at offset 28\\)"):
        read_documents(bad)


def test_a_jsonl_file_that_changes_after_its_check_is_skipped_from_there(tmp_path):
    import os

    import pytest

    from kvblend.rag.ingest import IngestSummary, _read
    from kvblend.rag.readers import SkipFile

    p = tmp_path / "r.jsonl"
    p.write_text('{"text": "one"}\n{"text": "two"}\n')
    checked = read_documents(p)
    p.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n')
    with pytest.raises(SkipFile, match="changed since it was checked"):
        list(checked)
    summary = IngestSummary()
    stream = _read([p], "text", summary)
    first = next(stream)  # checked and opened; the file changes while its records are read
    with open(p, "a") as f:
        f.write('{"text": "four"}\n')
    os.utime(p, ns=(1, 1))
    rest = list(stream)
    assert first.text == "one" and [d.text for d in rest] == ["two", "three", "four"]
    assert summary.files == 1 and summary.skipped == [(str(p), "changed while being read")]


def test_a_file_named_twice_or_under_two_paths_given_is_read_once(tmp_path, monkeypatch):
    """``ingest docs docs/a.txt ./docs`` reads a.txt once: the summary counts files that
    exist, not mentions of them, and no file is hashed and chunked twice."""
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("one")
    (d / "b.md").write_text("two")
    (d / "c.bin").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    files, skipped = discover([d, d / "a.txt", tmp_path / "." / "docs", d / "c.bin"])
    assert files == [d / "a.txt", d / "b.md"]
    assert skipped == [(str(d / "c.bin"), "unsupported type .bin")]


def test_a_nul_byte_anywhere_skips_a_file_as_binary_without_reading_it_whole(tmp_path, monkeypatch):
    """Only the first 8 KiB were looked at: a text, JSONL or HTML file with a NUL byte
    later was ingested, NUL bytes and all. The offset of the first one is named, and the
    streamed files are still never read whole."""
    from pathlib import Path

    import pytest

    from kvblend.rag import readers

    monkeypatch.setattr(readers, "BLOCK_BYTES", 4096)  # the NUL lies several blocks in
    head = b"the lighthouse keeper of vormsi island keeps the lamp lit every night\n" * 300  # 21 KiB
    (tmp_path / "a.txt").write_bytes(head + b"more text\x00and more\n")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "one"}\n' * 2000 + b'{"text": "tw\x00o"}\n')
    (tmp_path / "c.html").write_bytes(b"<p>" + head + b"</p>\x00")
    with pytest.raises(readers.SkipFile, match=f"binary content \\(NUL byte at offset {len(head) + 4 + 3}\\)"):
        read_documents(tmp_path / "c.html")
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} read whole"))
    for name, offset in (("a.txt", len(head) + 9), ("b.jsonl", 2000 * 16 + 12)):
        with pytest.raises(readers.SkipFile, match=f"binary content \\(NUL byte at offset {offset}\\)"):
            read_documents(tmp_path / name)


def test_jsonl_lines_may_end_in_cr_lf_or_crlf(tmp_path, monkeypatch):
    """Lines were split at "\\n" only: a file saved with classic Mac line ends ("\\r") was
    one line (a JSON error, or one huge line refused). "\\r\\n" is one line end, also when
    a block boundary falls between its two bytes."""
    import pytest

    from kvblend.rag import readers

    records = [b'{"text": "record %d"}' % i for i in range(60)]
    ends = [b"\r", b"\n", b"\r\n", b"\r\n\r\n"]  # the last one leaves a blank line (counted, skipped)
    data = b"".join(r + ends[i % 4] for i, r in enumerate(records))
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(data)
    expected, n = [], 0
    for i in range(60):
        n += 1
        expected.append((f"{p}#{n}", f"record {i}"))
        n += i % 4 == 3
    for block in (7, 16, 4096):  # boundaries inside "\r\n", and after a trailing "\r"
        monkeypatch.setattr(readers, "BLOCK_BYTES", block)
        assert [(d.source, d.text) for d in read_documents(p)] == expected
    monkeypatch.setattr(readers, "MAX_FILE_BYTES", 64)  # a line is bounded, not a CR-only file
    cr = tmp_path / "cr.jsonl"
    cr.write_bytes(b"\r".join(records[:10]) + b'\r{"text": "caf\xe9"}')
    with pytest.raises(readers.SkipFile, match=f"not UTF-8 \\(invalid byte at offset {cr.stat().st_size - 3}\\)"):
        read_documents(cr)
    cr.write_bytes(b"\r".join(records[:10]) + b"\r" + b"x" * 100)
    with pytest.raises(readers.SkipFile, match="line 11 is longer"):
        read_documents(cr)


def test_a_file_of_line_ends_only_is_read_in_bounded_blocks(tmp_path, monkeypatch):
    """Holding back a block's last CR (a LF may follow) must not grow a block over a run of CRs."""
    import io

    from kvblend.rag import readers

    monkeypatch.setattr(readers, "BLOCK_BYTES", 8)
    data = b"\r" * 100 + b"\r\n" + b"{}\r\n\r"
    blocks = list(readers._whole_line_end_blocks(io.BytesIO(data)))
    assert b"".join(blocks) == data and max(map(len, blocks)) <= 9
    lines = list(readers._raw_lines(io.BytesIO(data), 64))
    assert lines == [b"\r"] * 100 + [b"\r\n", b"{}\r\n", b"\r"]


def test_symlinked_folders_are_followed_once_and_loops_are_skipped_with_a_reason(tmp_path):
    """os.walk did not enter a symlinked folder, and said nothing: its files were lost. Now
    a link is followed and its files are named by the link's path; a folder is read once
    (by device and inode), so a link back up the tree, or to a folder read already, is
    skipped with the reason, and so is a link to nothing."""
    d, shared = tmp_path / "docs", tmp_path / "shared"
    (d / "real" / "deep").mkdir(parents=True)
    shared.mkdir()
    (d / "real" / "a.txt").write_text("a")
    (d / "real" / "deep" / "b.txt").write_text("b")
    (shared / "s.md").write_text("s")
    (d / "elsewhere").symlink_to(shared)  # outside the folder named
    (d / "copy").symlink_to(d / "real")  # a second way to the same folder: read as docs/real
    (d / "real" / "deep" / "up").symlink_to(d)  # a loop
    (d / "gone").symlink_to(tmp_path / "nowhere")
    files, skipped = discover([d])
    assert files == [d / "elsewhere" / "s.md", d / "real" / "a.txt", d / "real" / "deep" / "b.txt"]
    assert sorted(skipped) == [(str(d / "copy"), f"folder already read as {d / 'real'}"),
                               (str(d / "gone"), "broken symbolic link"),
                               (str(d / "real" / "deep" / "up"), f"symbolic link loop (to {d})")]
