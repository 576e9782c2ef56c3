"""Reading files into documents: .txt, .md, .jsonl (one document per record), .html, .pdf.

A file that cannot become text raises ``SkipFile`` with a reason a user can act on; the
ingest pipeline counts it and goes on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import NamedTuple

SUFFIXES = (".txt", ".md", ".markdown", ".jsonl", ".html", ".htm", ".pdf")
MAX_FILE_BYTES = 256 * 1024 * 1024


class SkipFile(Exception):
    """This file is skipped; the message says why."""


class Document(NamedTuple):
    """One document: ``source`` names it (a path, or ``path#line`` for a JSONL record)."""

    source: str
    text: str


def discover(paths: list[Path]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Files to read under ``paths`` (folders walked, sorted) and ``(path, reason)`` of those skipped."""
    files, skipped = [], []
    for p in paths:
        if p.is_dir():
            for f in sorted(x for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")):
                (files.append(f) if f.suffix.lower() in SUFFIXES
                 else skipped.append((str(f), f"unsupported type {f.suffix or '(none)'}")))
        elif p.is_file():
            (files.append(p) if p.suffix.lower() in SUFFIXES
             else skipped.append((str(p), f"unsupported type {p.suffix or '(none)'}")))
        else:
            skipped.append((str(p), "no such file or folder"))
    return files, skipped


def _read_bytes(path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise SkipFile(f"larger than {MAX_FILE_BYTES >> 20} MiB")
        return path.read_bytes()
    except PermissionError as exc:
        raise SkipFile("unreadable: permission denied") from exc
    except OSError as exc:
        raise SkipFile(f"unreadable: {exc.strerror or exc}") from exc


def _decode(data: bytes) -> str:
    if b"\x00" in data[:8192]:
        raise SkipFile("binary content (NUL bytes)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SkipFile(f"not UTF-8 (invalid byte at offset {exc.start})") from exc


class _TextOfHtml(HTMLParser):
    _SKIP = {"script", "style", "noscript", "template", "head"}
    _BLOCK = {"p", "div", "br", "li", "tr", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self._SKIP:
            self._skipping += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")
        if tag in ("h1", "h2", "h3", "h4", "h5", "h6") and not self._skipping:
            self.parts.append("#" * int(tag[1]) + " ")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP and self._skipping:
            self._skipping -= 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)


def html_text(html: str) -> str:
    """Visible text of an HTML page; headings become markdown headings, blocks new lines."""
    parser = _TextOfHtml()
    parser.feed(html)
    parser.close()
    lines = [" ".join(line.split()) for line in "".join(parser.parts).splitlines()]
    out, blank = [], False
    for line in lines:
        if line or not blank:
            out.append(line)
        blank = not line
    return "\n".join(out).strip()


def pdf_text(path: Path) -> str:
    """Text of every page (pypdf), pages separated by blank lines."""
    try:
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError
    except ImportError as exc:
        raise SkipFile("reading PDF needs pypdf: pip install pypdf") from exc
    try:
        reader = PdfReader(str(path))
        return "\n\n".join((page.extract_text() or "").strip() for page in reader.pages)
    except (PdfReadError, ValueError, KeyError, OSError) as exc:
        raise SkipFile(f"unreadable PDF: {exc}") from exc


def _jsonl(path: Path, text: str, field: str) -> Iterator[Document]:
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SkipFile(f"line {n} is not JSON: {exc.msg}") from exc
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise SkipFile(f"line {n} has no text field {field!r}")
        yield Document(f"{path}#{n}", value)


def read_documents(path: Path, text_field: str = "text") -> list[Document]:
    """The documents of one file (one, or one per JSONL record); raises SkipFile."""
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        _read_bytes(path)
        text = pdf_text(path)
        docs = [Document(str(path), text)]
    else:
        text = _decode(_read_bytes(path))
        if suffix == ".jsonl":
            docs = list(_jsonl(path, text, text_field))
        elif suffix in (".html", ".htm"):
            docs = [Document(str(path), html_text(text))]
        else:
            docs = [Document(str(path), text)]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise SkipFile("empty (no text)")
    return docs
