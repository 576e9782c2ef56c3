"""Ingest: files -> documents -> chunks -> vectors + chunk KV + catalog rows, batch by batch.

Files stream through read -> chunk -> embed -> store: a document is read in pieces
(``readers.TextFile``), each piece tokenized and chunked alone (``chunking.chunk_pieces``),
and chunks are stored as soon as a batch is full, so memory holds one piece and one batch
whatever the size of the file. Each batch is made durable in this order, and the catalog
commit comes last:

    1. chunk KV into the store (content-keyed, atomic files)  -- skipped if already stored
    2. vectors into the vector index (durable on return)
    3. one catalog transaction: the batch's chunk rows, the rows of documents whose chunks
       are now all committed, and the removal of chunks a changed document no longer uses

A crash before 3 leaves only KV entries and vectors nobody refers to: a search ignores
them, a rerun re-uses the KV (its key is found) and overwrites the vectors. Documents
whose text, chunker and tokenizer are unchanged are skipped (their hash is computed in a
streamed pass before any chunking); chunks already committed (from any document) are
re-used, not recomputed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvblend.errors import KvblendError
from kvblend.rag.catalog import DocumentRow, NewChunk
from kvblend.rag.chunking import Chunk, ChunkerConfig, chunk_pieces, chunk_text
from kvblend.rag.readers import Document, NoText, SkipFile, TextFile, discover, read_documents
from kvblend.rag.retriever import Retriever
from kvblend.store.keys import validate_tenant

PRECOMPUTE = ("all", "lazy")


@dataclass(frozen=True)
class IngestConfig:
    """``precompute``: ``all`` computes every new chunk's KV now; ``lazy`` leaves it to the
    ``precompute_after``-th retrieval (``kvblend ask`` counts them). ``dense``: embed and
    index vectors (off: BM25 only, no embedding model)."""

    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    tenant: str = "default"
    batch_size: int = 32
    precompute: str = "all"
    precompute_after: int = 2
    text_field: str = "text"
    dense: bool = True

    def __post_init__(self) -> None:
        validate_tenant(self.tenant)
        if not 1 <= self.batch_size <= 4096:
            raise ValueError("batch_size must be in [1, 4096]")
        if self.precompute not in PRECOMPUTE:
            raise ValueError(f"precompute must be one of {', '.join(PRECOMPUTE)}; got {self.precompute!r}")
        if self.precompute_after < 1:
            raise ValueError("precompute_after must be >= 1")


@dataclass
class IngestSummary:
    """What one ingest did; ``skipped`` holds ``(path, reason)``."""

    files: int = 0
    documents: int = 0
    unchanged: int = 0
    chunks: int = 0
    chunks_new: int = 0
    tokens_new: int = 0
    removed_chunks: int = 0
    removed_documents: int = 0
    kv_chunks: int = 0
    kv_tokens: int = 0
    kv_s: float = 0.0
    embed_s: float = 0.0
    total_s: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    store_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class _Doc:
    """A document being ingested: committed once ``sealed`` (all its chunks seen) and none
    of its new chunks is still ``waiting`` to be stored."""

    source: str
    sha256: str
    old: DocumentRow | None
    chunk_ids: list[str] = field(default_factory=list)
    n_tokens: int = 0
    waiting: set[str] = field(default_factory=set)
    sealed: bool = False

    def row(self) -> DocumentRow:
        return DocumentRow(self.source, self.sha256, tuple(self.chunk_ids), self.n_tokens)

    def dropped(self) -> list[str]:
        """Chunks of the document's previous version it no longer uses."""
        if self.old is None:
            return []
        now = set(self.chunk_ids)
        return [c for c in self.old.chunk_ids if c not in now]


@dataclass
class _Run:
    """One ingest's pending work: new chunks not stored yet (less than a batch), their ids,
    and the documents not committed yet."""

    summary: IngestSummary
    bar: Any
    files: int | None = None  # files to read, when known (the progress line shows i/N)
    todo: list[tuple[Chunk, str]] = field(default_factory=list)
    queued: set[str] = field(default_factory=set)
    waiting: list[_Doc] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)  # sources read this run (changed or not)


@dataclass(frozen=True)
class _Scope:
    """What a run of ``Ingestor.ingest`` covers: the folders named (resolved, existing),
    the files named (resolved), whether hidden files were read; and what it learnt of the
    files it did not ingest whole: those skipped as holding no text (``emptied``) and those
    whose records it read to the end (``finished``)."""

    folders: tuple[str, ...]
    files: tuple[str, ...]
    hidden: bool
    emptied: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)

    def covers(self, source: str) -> bool:
        """Whether ``source`` (a path, or a JSONL record's ``path#n``) names a file this run
        would have read: a file named, or one under a folder named (not hidden below it
        unless hidden files were read)."""
        path = _record_file(source)
        if path in self.files:
            return True
        for top in self.folders:
            folder = os.path.join(top, "")
            if path.startswith(folder) and (
                    self.hidden or not any(part.startswith(".") for part in path[len(folder):].split(os.sep))):
                return True
        return False

    def gone(self, source: str) -> bool:
        """Whether a covered document the run did not read is certainly gone: its file no
        longer exists or now holds no text, or (a record) its JSONL file was read to the end
        without it. Any other cause (a file or folder unreadable now, a missing reader extra,
        a bad line, a change while it was read) keeps what the index has."""
        path = _record_file(source)
        if path in self.emptied or (path != source and path in self.finished):
            return True
        try:
            os.lstat(path)
        except FileNotFoundError:
            return True
        except OSError:  # unreadable, not absent
            return False
        return False


def _record_file(source: str) -> str:
    """The file of a document source: ``a.jsonl#3`` -> ``a.jsonl``; any other source is its file."""
    path, sep, record = source.rpartition("#")
    return path if sep and record.isdigit() and path.lower().endswith(".jsonl") else source


def _hash_parts(tokenizer_id: str, chunker: ChunkerConfig) -> Any:
    h = hashlib.sha256()
    for part in (tokenizer_id, chunker.to_json()):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h


def streamed_hash(doc: Document | TextFile, chunker: ChunkerConfig, tokenizer_id: str) -> str:
    """``document_hash`` of a document read block by block (never whole); SkipFile if the
    file's size changed since it was opened."""
    h, seen = _hash_parts(tokenizer_id, chunker), 0
    h.update(doc.nbytes.to_bytes(8, "little"))
    for block in doc.blocks():
        data = block.encode("utf-8", "surrogatepass")
        seen += len(data)
        h.update(data)
    if seen != doc.nbytes:
        raise SkipFile("changed while being read")
    return h.hexdigest()


def document_hash(text: str, chunker: ChunkerConfig, tokenizer_id: str) -> str:
    """Identity of a document's chunking: its text, the chunker's parameters, the tokenizer."""
    return streamed_hash(Document("", text), chunker, tokenizer_id)


class KvWarmer:
    """Computes and stores chunk KV through an ``Engine`` (after the model's sink token)."""

    def __init__(self, engine: Any) -> None:
        from kvblend.rag.ask import chunk_prefix

        self.engine = engine
        self.chunk_prefix = chunk_prefix(engine)

    def warm(self, token_ids: tuple[int, ...], tenant: str) -> bool:
        """Store the chunk's KV; False if it was already there (nothing computed)."""
        key = self.engine.key_context(self.chunk_prefix, tenant)
        from kvblend.store.keys import chunk_key

        if self.engine.store.contains(chunk_key(token_ids, key)):
            return False
        self.engine.warm([token_ids], self.chunk_prefix, tenant)
        return True


def _read(files: list[Path], text_field: str, summary: IngestSummary,
          scope: _Scope | None = None) -> Iterator[Document | TextFile]:
    """The documents of ``files``, one file at a time (a text or JSONL file is checked, not
    loaded; a JSONL file that changes while its records are read is skipped from there);
    ``scope`` learns which files hold no text and which were read to the end."""
    for path in files:
        try:
            docs = read_documents(path, text_field)
        except SkipFile as exc:
            summary.skipped.append((str(path), str(exc)))
            if scope is not None and isinstance(exc, NoText):
                scope.emptied.add(str(path))
            continue
        summary.files += 1
        try:
            yield from docs
        except SkipFile as exc:
            summary.skipped.append((str(path), str(exc)))
        else:
            if scope is not None:
                scope.finished.add(str(path))


class Ingestor:
    """Ingests into ``retriever``'s folder with ``tokenizer`` (and ``warmer`` for chunk KV)."""

    def __init__(self, retriever: Retriever, tokenizer: Any, tokenizer_id: str, config: IngestConfig,
                 warmer: KvWarmer | None = None) -> None:
        self.retriever = retriever
        self.catalog = retriever.catalog
        self.tokenizer = tokenizer
        self.tokenizer_id = tokenizer_id
        self.config = config
        self.warmer = warmer
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        known = self.catalog.get_meta("tokenizer")
        if known is None:
            self.catalog.set_meta("tokenizer", self.tokenizer_id)
        elif known != self.tokenizer_id:
            from kvblend.errors import KvblendError

            raise KvblendError("this index was built with another tokenizer (another model): use another --index folder")

    def chunk(self, text: str) -> list[Chunk]:
        """The chunks of one text (the entry point ``POST /v1/documents`` shares)."""
        return chunk_text(self.tokenizer, text, self.config.chunker, self.tokenizer_id)

    # ----- one document ---------------------------------------------------------------
    def _document(self, doc: Document | TextFile, run: _Run) -> None:
        """Hash the document, skip it if unchanged, else queue its new chunks (storing a
        batch whenever one is full) and seal it once all its chunks are seen."""
        tenant, summary = self.config.tenant, run.summary
        try:
            sha = streamed_hash(doc, self.config.chunker, self.tokenizer_id)
        except SkipFile as exc:
            summary.skipped.append((doc.source, str(exc)))
            return
        run.seen.add(doc.source)
        summary.documents += 1
        if run.files:  # files opened of those found (a JSONL file holds many documents)
            run.bar.set_postfix_str(f"file {summary.files}/{run.files}", refresh=False)
        old = self.catalog.document(tenant, doc.source)
        if old is not None and old.sha256 == sha:
            summary.unchanged += 1
            self._restore_kv(old.chunk_ids, summary)
            return
        entry = _Doc(doc.source, sha, old)
        run.waiting.append(entry)
        try:
            for chunk in chunk_pieces(self.tokenizer, doc.pieces(), self.config.chunker, self.tokenizer_id):
                self._add(chunk, entry, run)
        except SkipFile as exc:  # the file changed or vanished mid-way: like a kill, for this document
            run.waiting.remove(entry)
            summary.skipped.append((doc.source, str(exc)))
            return
        entry.sealed = True
        summary.chunks += len(entry.chunk_ids)

    def _add(self, chunk: Chunk, doc: _Doc, run: _Run) -> None:
        """Count ``chunk`` in ``doc``; queue it unless queued or committed already."""
        doc.chunk_ids.append(chunk.chunk_id)
        doc.n_tokens += chunk.n_tokens
        if chunk.chunk_id not in run.queued:
            if self.catalog.existing(self.config.tenant, [chunk.chunk_id]):
                return
            run.queued.add(chunk.chunk_id)
            run.todo.append((chunk, doc.source))
        doc.waiting.add(chunk.chunk_id)
        if len(run.todo) >= self.config.batch_size:
            self._flush(run)

    def _restore_kv(self, chunk_ids: tuple[str, ...], summary: IngestSummary) -> None:
        """An unchanged document's chunk KV may have left the store since (evicted, cleared,
        or keyed anew by another model, dtype or key version): compute what is missing."""
        if self.warmer is None or self.config.precompute == "lazy":
            return
        size = self.config.batch_size
        for i in range(0, len(chunk_ids), size):
            for row in self.catalog.chunks(self.config.tenant, list(chunk_ids[i : i + size])):
                t = time.perf_counter()
                if self.warmer.warm(row.token_ids, self.config.tenant):
                    summary.kv_s += time.perf_counter() - t
                    summary.kv_chunks += 1
                    summary.kv_tokens += len(row.token_ids)

    # ----- one batch ------------------------------------------------------------------
    def _store_batch(self, batch: list[tuple[Chunk, str]], summary: IngestSummary, bar: Any) -> list[NewChunk]:
        tenant, lazy = self.config.tenant, self.config.precompute == "lazy"
        ready = []
        for chunk, _ in batch:
            bar.update(1)  # a chunk at a time: computing one chunk's KV is what takes the time
            done = False
            if self.warmer is not None and not lazy:
                t = time.perf_counter()
                if self.warmer.warm(chunk.token_ids, tenant):
                    summary.kv_s += time.perf_counter() - t
                    summary.kv_chunks += 1
                    summary.kv_tokens += chunk.n_tokens
                done = True
            ready.append(done)
        if self.config.dense:
            t = time.perf_counter()
            vectors = self.retriever.embed([c.text for c, _ in batch])  # (n, dim)
            summary.embed_s += time.perf_counter() - t
            self.retriever.index.upsert(tenant, [c.chunk_id for c, _ in batch], vectors)
        return [NewChunk(c.chunk_id, src, c.ordinal, c.text, c.token_ids, r) for (c, src), r in zip(batch, ready)]

    def _flush(self, run: _Run) -> None:
        """Store the queued chunks (KV, vectors) and commit them with every document now complete."""
        batch, run.todo = run.todo, []
        new = self._store_batch(batch, run.summary, run.bar) if batch else []
        self._commit(new, run)
        run.queued.difference_update(c.chunk_id for c in new)

    def _commit(self, new: list[NewChunk], run: _Run) -> None:
        """Commit ``new`` chunks and every sealed document no longer waiting on a chunk."""
        done_ids = {c.chunk_id for c in new}
        complete, still = [], []
        for doc in run.waiting:
            doc.waiting -= done_ids
            (complete if doc.sealed and not doc.waiting else still).append(doc)
        run.waiting = still
        orphans = self._orphans(complete, run)
        self.catalog.commit(self.config.tenant, new, [d.row() for d in complete], orphans)
        if orphans and self.config.dense:
            self.retriever.index.delete(self.config.tenant, orphans)
        summary = run.summary
        summary.removed_chunks += len(orphans)
        summary.chunks_new += len(new)
        summary.tokens_new += sum(len(c.token_ids) for c in new)

    def _orphans(self, complete: list[_Doc], run: _Run) -> list[str]:
        """Chunks the ``complete`` documents dropped that no other document uses, committed
        or still being ingested."""
        dropped = []
        for doc in complete:
            dropped += self.catalog.orphans(self.config.tenant, doc.dropped(), exclude_source=doc.source)
        if not dropped:
            return []
        in_use = {c for doc in complete + run.waiting for c in doc.chunk_ids}
        return [c for c in dict.fromkeys(dropped) if c not in in_use]

    def _sweep(self, summary: IngestSummary) -> None:
        """Drop committed chunks no document refers to (and their vectors): a document
        skipped part-way (it changed or vanished while read) or a killed run leaves them,
        and retrieval would otherwise still find text no stored document has. Every
        document of this run is committed by now, so none of its chunks is dropped."""
        swept = self.catalog.unreferenced(self.config.tenant)
        if not swept:
            return
        self.catalog.commit(self.config.tenant, [], [], swept)
        if self.config.dense:
            self.retriever.index.delete(self.config.tenant, swept)
        summary.removed_chunks += len(swept)

    def _prune(self, scope: _Scope, run: _Run) -> None:
        """Remove the documents of the folders and files ingested that this run did not
        read and that are gone (their file was deleted or renamed, now holds no text, or a
        JSONL file no longer has that record: `_Scope.gone`), with the chunks only they
        used, so that retrieval never serves a file that is gone."""
        tenant, summary = self.config.tenant, run.summary
        for source in self.catalog.sources(tenant):
            if source in run.seen or not scope.covers(source) or not scope.gone(source):
                continue
            orphans = self.catalog.delete_document(tenant, source)
            if orphans and self.config.dense:
                self.retriever.index.delete(tenant, orphans)
            summary.removed_documents += 1
            summary.removed_chunks += len(orphans)

    # ----- entry points ---------------------------------------------------------------
    def ingest(self, paths: Sequence[Path], progress: bool = True, hidden: bool = False) -> IngestSummary:
        """Ingest files and folders (paths resolved; hidden files and folders skipped unless
        ``hidden``); bad files are skipped and listed in the summary. Documents of these
        folders and files that the run did not read and that are gone (deleted, renamed, now
        empty, a JSONL record no longer there) are removed from the index (`_Scope.gone`)."""
        start, summary = time.perf_counter(), IngestSummary()
        roots = [Path(p).expanduser().resolve() for p in paths]
        folders = tuple(str(r) for r in roots if r.is_dir())  # before the walk: a folder made since is not pruned
        files, summary.skipped = discover(roots, hidden)
        scope = _Scope(folders, tuple(str(r) for r in roots if str(r) not in folders), hidden)
        return self._run(_read(files, self.config.text_field, summary, scope), progress, summary, start,
                         len(files), scope)

    def ingest_documents(self, docs: Iterable[Document], progress: bool = True, summary: IngestSummary | None = None,
                         start: float | None = None) -> IngestSummary:
        """Ingest documents given as ``(source, text)`` (re-ingesting a source replaces it)."""
        start = time.perf_counter() if start is None else start
        return self._run(iter(docs), progress, summary or IngestSummary(), start)

    def _run(self, docs: Iterator[Document | TextFile], progress: bool, summary: IngestSummary,
             start: float, files: int | None = None, scope: _Scope | None = None) -> IngestSummary:
        """Every document through chunk -> store -> commit, a batch at a time, holding the
        index folder's ingest lock (``writing``); then the documents of ``scope`` not read
        are removed."""
        with writing(Path(self.retriever.config.folder)):
            return self._locked_run(docs, progress, summary, start, files, scope)

    def _locked_run(self, docs: Iterator[Document | TextFile], progress: bool, summary: IngestSummary,
                    start: float, files: int | None, scope: _Scope | None) -> IngestSummary:
        if self.config.dense:
            self.retriever.reconcile(self.config.tenant)
        with _progress(progress)(desc="chunks", unit="chunk") as bar:
            run = _Run(summary, bar, files)
            for doc in docs:
                self._document(doc, run)
            self._flush(run)
        if scope is not None:
            self._prune(scope, run)
        self._sweep(summary)
        if self.config.dense:
            self.retriever.index.flush()
        summary.total_s = time.perf_counter() - start
        if self.warmer is not None:
            summary.store_bytes = {n: s.bytes for n, s in self.warmer.engine.store.tier_stats(self.config.tenant).items()}
        return summary


class IngestBusyError(KvblendError):
    """Another ingest is writing the same index folder."""


LOCK_NAME = "ingest.lock"


@contextlib.contextmanager
def writing(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s ingest lock (an ``flock``, released with the process if it dies);
    ``IngestBusyError`` at once if another ingest holds it. Two ingests into one index
    would each write the vector index from their own copy and lose the other's vectors."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise IngestBusyError(f"another kvblend ingest (pid {holder}) is writing {folder}; "
                                  "run one ingest per index at a time") from None
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _progress(enabled: bool) -> Callable[..., Any]:
    """tqdm on stderr (chunks stored, one at a time, and their rate; files opened of those
    found), or a silent stand-in with the same calls."""
    from tqdm.auto import tqdm

    def bar(iterable=None, **kw):
        return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kw)

    return bar
