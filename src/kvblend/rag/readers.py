"""Reading files into documents: .txt, .md, .jsonl (one document per record), .html, .pdf.

Plain text and markdown are never held whole: a ``TextFile`` is checked once when it is
opened (UTF-8, no NUL byte anywhere, not blank) and then read again in blocks, as often as the
ingest needs (its hash, then its chunks), so that a file of any size is ingested in a
fixed amount of memory; ``split_pieces`` cuts the text into pieces of at most
``PIECE_CHARS`` characters at line ends, which the chunker tokenizes one at a time.
JSONL records, HTML pages and PDFs are read whole (bounded by ``MAX_FILE_BYTES``).

A file that cannot become text raises ``SkipFile`` with a reason a user can act on; the
ingest pipeline counts it and goes on.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO, NamedTuple

SUFFIXES = (".txt", ".md", ".markdown", ".jsonl", ".html", ".htm", ".pdf")
STREAMED = (".txt", ".md", ".markdown")  # read in blocks, never whole (JSONL: a line at a time)
MAX_FILE_BYTES = 256 * 1024 * 1024  # for the files read whole (HTML, PDF), and a JSONL line
BLOCK_BYTES = 1 << 20
PIECE_CHARS = 1 << 20  # characters tokenized at once


class SkipFile(Exception):
    """This file is skipped; the message says why."""


class NoText(SkipFile):
    """This file is skipped because it holds no text (the one skip that says what the
    file holds: an ingest drops what the index had of it)."""

    def __init__(self) -> None:
        super().__init__("empty (no text)")


def split_pieces(blocks: Iterable[str], max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """The text of ``blocks`` (in order) cut into pieces of at most ``max_chars``
    characters, each ending at a line end where one lies in its second half, else before
    a space, else anywhere. The pieces concatenate back to the text."""
    buf = ""
    for block in blocks:
        buf = buf + block if buf else block
        start = 0
        while len(buf) - start > max_chars:
            cut = _piece_end(buf, start, start + max_chars)
            yield buf[start:cut]
            start = cut
        buf = buf[start:]
    if buf:
        yield buf


def _piece_end(text: str, lo: int, hi: int) -> int:
    """Where a piece of ``text[lo:hi]`` ends: after its last newline in the second half,
    else before its last space there (the space starts the next word's token), else ``hi``."""
    mid = lo + (hi - lo) // 2
    newline = text.rfind("\n", mid, hi)
    if newline >= 0:
        return newline + 1
    space = text.rfind(" ", mid + 1, hi)
    return space if space > lo else hi


class Document(NamedTuple):
    """One document held whole: ``source`` names it (a path, or ``path#line`` for a JSONL record)."""

    source: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8", "surrogatepass"))

    def blocks(self) -> Iterator[str]:
        yield self.text

    def pieces(self, max_chars: int = PIECE_CHARS) -> Iterator[str]:
        return split_pieces(self.blocks(), max_chars)


class TextFile(NamedTuple):
    """A plain-text or markdown file read in blocks, never whole (``open_text_file``):
    ``nbytes`` is the UTF-8 size of its text (a leading BOM excluded)."""

    source: str
    path: Path
    nbytes: int

    def blocks(self) -> Iterator[str]:
        """The decoded text, a block at a time; SkipFile if the file became unreadable."""
        try:
            yield from _decoded_blocks(self.path)
        except OSError as exc:
            raise SkipFile(f"unreadable: {exc.strerror or exc}") from exc

    def pieces(self, max_chars: int = PIECE_CHARS) -> Iterator[str]:
        return split_pieces(self.blocks(), max_chars)


def _refuse_nul(data: bytes, offset: int) -> None:
    """SkipFile naming the file offset of the first NUL byte in ``data`` (which starts at
    ``offset``), if it holds one: NUL is valid UTF-8, but no text file holds it."""
    at = data.find(b"\x00")
    if at >= 0:
        raise SkipFile(f"binary content (NUL byte at offset {offset + at})")


def _decoded_blocks(path: Path) -> Iterator[str]:
    """``path`` decoded as UTF-8 (a BOM dropped) in blocks of ``BLOCK_BYTES``; SkipFile on
    a NUL byte anywhere or on invalid UTF-8 (its byte offset named)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8-sig")(), 0
    with open(path, "rb") as f:
        while True:
            data = f.read(BLOCK_BYTES)
            _refuse_nul(data, offset)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                raise SkipFile(f"not UTF-8 (invalid byte at offset {offset + exc.start})") from exc
            offset += len(data)
            if text:
                yield text
            if not data:
                return


def open_text_file(path: Path) -> TextFile:
    """Check a text file in one streamed pass (readable, UTF-8, not blank) without holding it."""
    nbytes, blank = 0, True
    try:
        for text in _decoded_blocks(path):
            nbytes += len(text.encode("utf-8"))
            blank = blank and text.isspace()
    except PermissionError as exc:
        raise SkipFile("unreadable: permission denied") from exc
    except OSError as exc:
        raise SkipFile(f"unreadable: {exc.strerror or exc}") from exc
    if blank:
        raise NoText()
    return TextFile(str(path), path, nbytes)


def _visible(path: Path, root: Path, hidden: bool) -> bool:
    """False for a file under ``root`` whose name or folder starts with "." (unless ``hidden``)."""
    return hidden or not any(part.startswith(".") for part in path.relative_to(root).parts)


def _walk(root: Path, hidden: bool, skipped: list[tuple[str, str]]) -> Iterator[Path]:
    """The files under ``root`` in sorted order, hidden folders pruned unless ``hidden``;
    symbolic links to folders are followed, and each folder is read once (`_unread`). A
    folder that cannot be listed, or reached again, and a broken link go into ``skipped``."""

    def unlisted(exc: OSError) -> None:
        skipped.append((str(exc.filename or root), f"folder unreadable: {exc.strerror or exc}"))

    read = {_folder_id(root): str(root)}
    for folder, dirs, names in os.walk(root, onerror=unlisted, followlinks=True):
        dirs[:] = _unread(folder, sorted(d for d in dirs if hidden or not d.startswith(".")), read, skipped)
        for name in sorted(names):
            path = Path(folder) / name
            if not _visible(path, root, hidden):
                continue
            if path.is_file():
                yield path
            elif path.is_symlink() and not path.exists():
                skipped.append((str(path), "broken symbolic link"))


def _folder_id(path: str | Path) -> tuple[int, int]:
    """What names a folder however it is reached (links followed): its device and inode."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _unread(folder: str, dirs: list[str], read: dict[tuple[int, int], str],
            skipped: list[tuple[str, str]]) -> list[str]:
    """Those of ``dirs`` (in ``folder``) not read yet, each now in ``read``; one read already
    (a symbolic link back up the tree, or a second way to a folder) goes into ``skipped``
    with the path it is read by. Real folders are claimed before links to them."""
    ids = {}
    for d in dirs:
        try:
            ids[d] = _folder_id(os.path.join(folder, d))
        except OSError as exc:
            skipped.append((os.path.join(folder, d), f"folder unreadable: {exc.strerror or exc}"))
    for d in sorted(ids, key=lambda d: os.path.islink(os.path.join(folder, d))):
        path = os.path.join(folder, d)
        first = read.setdefault(ids[d], path)
        if first != path:
            loop = path.startswith(os.path.join(first, ""))
            skipped.append((path, f"symbolic link loop (to {first})" if loop else f"folder already read as {first}"))
            del ids[d]
    return [d for d in dirs if d in ids]


def discover(paths: list[Path], hidden: bool = False) -> tuple[list[Path], list[tuple[str, str]]]:
    """Files to read under ``paths``, resolved (``docs`` and ``/abs/docs`` name the same
    files; folders walked, sorted, symlinked folders followed once each; hidden files and
    folders skipped unless ``hidden``), and ``(path, reason)`` of those skipped. A path named explicitly is read even if hidden; a
    file named twice, or under two of ``paths``, is listed once."""
    files, skipped, listed = [], [], set()
    for p in paths:
        p = Path(p).expanduser().resolve()
        candidates = list(_walk(p, hidden, skipped)) if p.is_dir() else [p] if p.is_file() else None
        if candidates is None:
            if str(p) not in listed:
                listed.add(str(p))
                skipped.append((str(p), "no such file or folder"))
            continue
        for f in candidates:
            if str(f) in listed:
                continue
            listed.add(str(f))
            (files.append(f) if f.suffix.lower() in SUFFIXES
             else skipped.append((str(f), f"unsupported type {f.suffix or '(none)'}")))
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
    _refuse_nul(data, 0)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SkipFile(f"not UTF-8 (invalid byte at offset {exc.start})") from exc


class _TextOfHtml(HTMLParser):
    _SKIP = {"script", "style", "noscript", "template"}
    # what a head holds: any other element (or <body>) ends a head whose </head> was left out
    _HEAD = {"head", "title", "meta", "link", "base", "script", "style", "noscript", "template"}
    _BLOCK = {"p", "div", "br", "li", "tr", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "table"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0
        self._head = False
        self._title = False

    def handle_starttag(self, tag: str, attrs) -> None:
        self._title = self._title or tag == "title"
        if tag == "head":
            self._head = True
        elif tag not in self._HEAD:
            self._head = False
        if tag in self._SKIP:
            self._skipping += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")
        if tag in ("h1", "h2", "h3", "h4", "h5", "h6") and not self._skipping:
            self.parts.append("#" * int(tag[1]) + " ")

    def handle_endtag(self, tag: str) -> None:
        self._title = self._title and tag != "title"
        if tag == "head":
            self._head = False
        if tag in self._SKIP and self._skipping:
            self._skipping -= 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._head and not self._title and not self._skipping and data.strip():
            self._head = False  # text outside the title starts the body (as a head left open ends)
        if not self._skipping and not self._head:
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


_LINE_END = re.compile(rb"\r\n?|\n")


def _whole_line_end_blocks(f: BinaryIO) -> Iterator[bytes]:
    """``f`` in blocks of at most ``BLOCK_BYTES`` + 1 bytes, none ending in CR but the
    file's last (a block's last CR moves to the next block), so no CRLF is split in two."""
    carry = b""
    while data := f.read(BLOCK_BYTES):
        data, carry = (carry + data if carry else data), b""
        if data.endswith(b"\r"):
            data, carry = data[:-1], b"\r"
        if data:
            yield data
    if carry:
        yield carry


def _raw_lines(f: BinaryIO, limit: int) -> Iterator[bytes]:
    """The lines of ``f``, each with its end (LF, CRLF or CR; the last line may have none),
    read a block at a time. A line longer than ``limit`` bytes comes back as its
    first ``limit + 1`` bytes and ends the reading (the caller refuses it)."""
    head: list[bytes] = []  # the start of a line that runs past the blocks read so far
    held = 0
    for block in _whole_line_end_blocks(f):
        start = 0
        for m in _LINE_END.finditer(block):
            yield b"".join((*head, block[start:m.end()])) if head else block[start:m.end()]
            head, held, start = [], 0, m.end()
        if start < len(block):
            head.append(block[start:])
            held += len(block) - start
        if held > limit:
            yield b"".join(head)[: limit + 1]
            return
    if head:
        yield b"".join(head)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a JSONL file read a line at a time (never whole; a line
    ends at LF, CRLF or CR), decoded as UTF-8 (a leading BOM dropped); SkipFile on a NUL
    byte anywhere or invalid UTF-8 (their byte offset named), or a line longer than
    ``MAX_FILE_BYTES``."""
    try:
        with open(path, "rb") as f:
            n, offset = 0, 0
            for raw in _raw_lines(f, MAX_FILE_BYTES):
                n += 1
                if len(raw) > MAX_FILE_BYTES:
                    raise SkipFile(f"line {n} is longer than {MAX_FILE_BYTES >> 20} MiB")
                _refuse_nul(raw, offset)
                start = len(codecs.BOM_UTF8) if offset == 0 and raw.startswith(codecs.BOM_UTF8) else 0
                try:
                    line = raw[start:].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise SkipFile(f"not UTF-8 (invalid byte at offset {offset + start + exc.start})") from exc
                offset += len(raw)
                yield n, line
    except PermissionError as exc:
        raise SkipFile("unreadable: permission denied") from exc
    except OSError as exc:
        raise SkipFile(f"unreadable: {exc.strerror or exc}") from exc


def _jsonl_records(path: Path, field: str) -> Iterator[Document]:
    """One document per non-blank line's ``field``; SkipFile naming the first bad line."""
    for n, line in _jsonl_lines(path):
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


@dataclass(frozen=True)
class JsonlFile:
    """A JSONL file's records as documents, read a line at a time on each pass, never
    whole (``open_jsonl_file`` checked every line first, so a bad line skips the whole
    file before any record is ingested). Iterating raises SkipFile if the file changed
    since it was checked (the records already yielded stand: each is its own document)."""

    path: Path
    field: str
    nbytes: int
    mtime_ns: int

    def __iter__(self) -> Iterator[Document]:
        if _stamp(self.path) != (self.nbytes, self.mtime_ns):
            raise SkipFile("changed since it was checked")
        for doc in _jsonl_records(self.path, self.field):
            if doc.text.strip():
                yield doc
        if _stamp(self.path) != (self.nbytes, self.mtime_ns):
            raise SkipFile("changed while being read")


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise SkipFile(f"unreadable: {exc.strerror or exc}") from exc
    return st.st_size, st.st_mtime_ns


def open_jsonl_file(path: Path, field: str = "text") -> JsonlFile:
    """Check a JSONL file in one streamed pass (every line a JSON object with a string
    ``field``, some of them not blank) without holding it."""
    stamp = _stamp(path)
    texts = 0
    for doc in _jsonl_records(path, field):  # every line, not only until the first text
        texts += bool(doc.text.strip())
    if not texts:
        raise NoText()
    return JsonlFile(path, field, *stamp)


def read_documents(path: Path, text_field: str = "text") -> Iterable[Document | TextFile]:
    """The documents of one file (one, or one per JSONL record); raises SkipFile. Plain
    text and markdown come back as a ``TextFile`` and JSONL as a ``JsonlFile`` (checked,
    not read into memory; iterating a ``JsonlFile`` may raise SkipFile too)."""
    suffix = path.suffix.lower()
    if suffix in STREAMED:
        return [open_text_file(path)]
    if suffix == ".jsonl":
        return open_jsonl_file(path, text_field)
    if suffix == ".pdf":
        _read_bytes(path)
        text = pdf_text(path)
        docs = [Document(str(path), text)]
    else:
        text = _decode(_read_bytes(path))
        if suffix in (".html", ".htm"):
            docs = [Document(str(path), html_text(text))]
        else:
            docs = [Document(str(path), text)]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise NoText()
    return docs
