"""Readers: PDF (pypdf), HTML visible text, JSONL records."""

from __future__ import annotations

from kvblend.rag.readers import html_text, read_documents


def _pdf(text: str) -> bytes:
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


def test_pdf_text_is_extracted(tmp_path):
    p = tmp_path / "a.pdf"
    p.write_bytes(_pdf("The lighthouse keeper is Theodora Quill"))
    [doc] = read_documents(p)
    assert "Theodora Quill" in doc.text and doc.source == str(p)


def test_html_keeps_visible_text_and_headings():
    html = ("<html><head><title>t</title><script>var x = 1;</script></head><body><h2>Rivers</h2>"
            "<p>The Tagus &amp; the Douro.</p><div>Lisbon<br>Porto</div></body></html>")
    assert html_text(html) == "## Rivers\n\nThe Tagus & the Douro.\n\nLisbon\nPorto"


def test_jsonl_gives_one_document_per_record(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"body": "one"}\n{"body": "two", "x": 1}\n')
    assert [(d.source, d.text) for d in read_documents(p, "body")] == [(f"{p}#1", "one"), (f"{p}#2", "two")]
