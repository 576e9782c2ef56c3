"""``kvblend ingest PATH...`` and ``kvblend ask "question"`` without ``--doc`` (retrieval).

Both find the index and the chunk KV store under ``KVBLEND_HOME`` by default
(``rag/<tokenizer>`` and ``kv``), so an ingest and a later ask need no flags.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


DEFAULT_CHUNKS = 6  # passages ``kvblend ask`` retrieves without --doc


def default_store_dir() -> Path:
    """``$KVBLEND_HOME/kv``: the disk tier ``kvblend ingest`` fills and ``kvblend serve`` reads."""
    from kvblend.settings import StoreSettings

    return Path(StoreSettings().disk_folder)


def add_retrieval_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ingest and ask (retrieval)."""
    from kvblend.rag.retriever import MODES

    p.add_argument("--index", default=None, help="index folder (default: $KVBLEND_HOME/rag/<tokenizer>)")
    p.add_argument("--retriever", default="hybrid", choices=MODES, help="dense, bm25 or hybrid (default)")
    p.add_argument("--tenant", default="default")


def store_config(args: argparse.Namespace, compute_dtype: str, memory: bool = True):
    """The store ``kvblend serve`` uses (settings ``store.*``: ``KVBLEND_STORE__*``, the
    ``KVBLEND_CONFIG`` file, defaults), with ``--store-dir``/``--redis-url`` over it (their
    tier added when ``store.tiers`` leaves it out: a flag is never dropped), so that
    ingest, ask and the server key and find the same chunk KV. ``memory=False`` drops
    the memory tier (ingest only writes: a memory tier would only hold RAM)."""
    import dataclasses

    from kvblend.settings import Settings
    from kvblend.store.config import TIER_NAMES

    flags = {"disk_dir": getattr(args, "store_dir", None), "redis_url": getattr(args, "redis_url", None)}
    settings = Settings.load().store
    named = {"disk": flags["disk_dir"], "redis": flags["redis_url"]}  # a tier a flag names is used
    wanted = set(settings.tiers) | {t for t, v in named.items() if v is not None}
    tiers = tuple(t for t in TIER_NAMES if t in wanted)  # lookup order: memory, disk, redis
    settings = settings.model_copy(update={**{k: v for k, v in flags.items() if v is not None}, "tiers": tiers})
    config = settings.store_config(compute_dtype)
    rest = tuple(t for t in config.enabled_tiers if t != "memory")
    return config if memory or not rest else dataclasses.replace(config, tiers=rest)


def _store(args: argparse.Namespace, loaded, memory: bool = True):
    from kvblend.store.codec import compute_dtype_name
    from kvblend.store.config import build_store

    return build_store(store_config(args, compute_dtype_name(loaded.model.dtype), memory))


def index_folder(args: argparse.Namespace, tokenizer_id: str) -> Path:
    """``--index``, else the default index folder of the tokenizer."""
    from kvblend.rag.retriever import default_index_dir

    return Path(args.index) if args.index else default_index_dir(tokenizer_id)


def open_retriever(args: argparse.Namespace, tokenizer_id: str):
    from kvblend.rag.retriever import Retriever, RetrieverConfig

    return Retriever(RetrieverConfig(index_folder(args, tokenizer_id), mode=args.retriever or "hybrid"))


def require_index(folder: Path, index_flag: str | None) -> None:
    """KvblendError when ``folder`` holds no index (a mistyped ``--index``, or nothing
    ingested yet for this model): said before the folder is opened, which would create it."""
    from kvblend.errors import KvblendError
    from kvblend.rag.retriever import index_exists

    if not index_exists(folder):
        flag = f" --index {index_flag}" if index_flag else ""
        raise KvblendError(f"no index at {folder}: run `kvblend ingest PATH{flag}` first"
                           + ("" if index_flag else " (with the same --model)"))


# ----- ingest ---------------------------------------------------------------------------
def add_ingest_command(sub) -> None:
    from kvblend.rag.chunking import CHUNKERS
    from kvblend.rag.ingest import PRECOMPUTE

    p = sub.add_parser("ingest", help="chunk, embed, index and precompute the KV of documents")
    p.add_argument("paths", nargs="+", help="files or folders (.txt .md .jsonl .html .pdf); a rerun reads only what changed and drops the documents of files gone from them")
    p.add_argument("--chunker", default="tokens", choices=CHUNKERS)
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="tokens per chunk (default: documents.chunk_tokens, the server's cut)")
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="chunks per atomic commit")
    p.add_argument("--precompute", default="all", choices=PRECOMPUTE,
                   help="all: compute every chunk's KV now; lazy: on its N-th retrieval")
    p.add_argument("--precompute-after", type=int, default=2, help="N for --precompute lazy")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl records")
    p.add_argument("--store-dir", default=None, help="chunk KV disk tier (default: store.disk_dir, else $KVBLEND_HOME/kv: the server's)")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--hidden", action="store_true", help="also read hidden files and folders (names starting with '.')")
    p.add_argument("--quiet", action="store_true", help="no progress bars, nor pypdf's notes on PDFs it repaired")
    add_retrieval_args(p)
    from kvblend.cliargs import add_model_args as _add_model_args

    _add_model_args(p)
    p.set_defaults(func=cmd_ingest)


def cmd_ingest(args: argparse.Namespace) -> int:
    from kvblend.cliargs import load_from_args as _load
    from kvblend.engine import Engine
    from kvblend.rag.chunking import ChunkerConfig
    from kvblend.rag.ingest import IngestConfig, Ingestor, KvWarmer
    from kvblend.rag.readers import discover
    from kvblend.settings import Settings

    size = Settings.load().documents.chunk_tokens if args.chunk_tokens is None else args.chunk_tokens
    config = IngestConfig(ChunkerConfig(args.chunker, size, args.overlap), args.tenant, args.batch,
                          args.precompute, args.precompute_after, args.text_field, dense=args.retriever != "bm25")
    files, skipped = discover([Path(p) for p in args.paths], args.hidden)
    if not files:
        print("nothing to ingest: " + ("no files found (the folder is empty)" if not skipped else
                                       f"none of the {len(skipped)} file(s) can be read:"), file=sys.stderr)
        for path, reason in skipped:
            print(f"  {path}: {reason}", file=sys.stderr)
        return 1
    if args.quiet:  # transformers' own bars too (loading the weights, the embedder)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    loaded = _load(args)
    engine = Engine(loaded, store=_store(args, loaded, memory=False), calibrate=False)  # computes chunks only
    retriever = open_retriever(args, loaded.tokenizer_fingerprint)
    try:
        ingestor = Ingestor(retriever, loaded.tokenizer, loaded.tokenizer_fingerprint, config, KvWarmer(engine))
        lazy_after = config.precompute_after if config.precompute == "lazy" else 0
        retriever.catalog.set_meta(f"precompute_after:{config.tenant}", str(lazy_after))
        with _pdf_notes_off(args.quiet):
            summary = ingestor.ingest([Path(p) for p in args.paths], progress=not args.quiet, hidden=args.hidden)
        _print_summary(summary, retriever, config)
        if summary.chunks:
            print(_economics(ingestor, engine, loaded).describe())
    finally:
        retriever.close()
        engine.close()
    return 0 if summary.files else 1


@contextlib.contextmanager
def _pdf_notes_off(quiet: bool) -> Iterator[None]:
    """Under ``--quiet``, pypdf's log records (a warning, or an error it recovers from, for
    each fault it works around while reading; logging's last resort prints them to stderr,
    naming no file) are dropped for the ingest; a PDF it cannot read raises, and is still
    skipped with its reason in the summary."""
    pypdf_log = logging.getLogger("pypdf")
    level = pypdf_log.level
    if quiet:
        pypdf_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        pypdf_log.setLevel(level)


def _print_summary(s, retriever, config) -> None:
    docs, chunks, tokens = retriever.catalog.count(config.tenant)
    tiers = ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in s.store_bytes.items()) or "-"
    print(f"ingested {s.files} file(s), {s.documents} document(s) ({s.unchanged} unchanged) in {s.total_s:.1f}s: "
          f"{s.chunks_new} new chunk(s), {s.tokens_new} new tokens; {s.removed_chunks} stale chunk(s) removed"
          + (f", {s.removed_documents} document(s) no longer there removed" if s.removed_documents else ""))
    print(f"chunk KV: {s.kv_chunks} computed ({s.kv_tokens} tokens, {s.kv_s:.1f}s); embedding {s.embed_s:.1f}s; "
          f"store bytes per tier: {tiers}")
    print(f"index now holds {docs} document(s), {chunks} chunk(s), {tokens} tokens (tenant {config.tenant})")
    if s.skipped:
        print(f"skipped {len(s.skipped)} file(s):")
        for path, reason in s.skipped:
            print(f"  {path}: {reason}")


def _economics(ingestor, engine, loaded):
    """Measure on the first committed chunk: its KV compute time and its load time."""
    import time

    from kvblend.blend.chunks import compute_chunk_kv
    from kvblend.rag.economics import estimate, measure_load
    from kvblend.store.keys import chunk_key

    tenant = ingestor.config.tenant
    row = ingestor.catalog.chunks(tenant, ingestor.catalog.first_ids(tenant, 1))[0]
    warmer = ingestor.warmer
    t = time.perf_counter()
    chunk = compute_chunk_kv(engine.model, warmer.chunk_prefix, row.token_ids)
    prefill = time.perf_counter() - t
    key = chunk_key(row.token_ids, engine.key_context(warmer.chunk_prefix, tenant))
    if not engine.store.contains(key):
        engine.store.put(key, chunk)
    load = measure_load(engine.store, key, row.token_ids)
    return estimate(prefill, load, len(row.token_ids), 0.15, loaded.config.num_layers)


# ----- ask by retrieval -----------------------------------------------------------------
def top_k_arg(text: str) -> int:
    """``--chunks``: an integer in [1, MAX_TOP_K] (argparse names the flag when it is not)."""
    from kvblend.rag.retriever import MAX_TOP_K

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_TOP_K:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_TOP_K}], not {text!r}")
    return value


def add_ask_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=top_k_arg, default=None,
                   help=f"chunks to retrieve when no --doc is given (top-k; default {DEFAULT_CHUNKS})")
    p.add_argument("--compare", action="store_true", help="also run a full prefill and compare")
    p.add_argument("--index", default=None, help="index folder (default: $KVBLEND_HOME/rag/<tokenizer>)")
    p.add_argument("--retriever", default=None, choices=("dense", "bm25", "hybrid"), help="default: hybrid")
    p.add_argument("--tenant", default="default")


def run_retrieval_ask(args: argparse.Namespace, question: str, request_kw: dict[str, Any], sampling) -> int:
    """Retrieve the top-k chunks, blend them, stream the answer, show sources and stats."""
    from kvblend.cliargs import load_from_args as _load
    from kvblend.cliargs import print_stats as _print_stats
    from kvblend.engine import Engine
    from kvblend.rag.ask import ask

    if args.index:  # a mistyped folder: said before the model loads
        require_index(Path(args.index), args.index)
    loaded = _load(args)
    require_index(index_folder(args, loaded.tokenizer_fingerprint), args.index)  # opening it would create it
    retriever = open_retriever(args, loaded.tokenizer_fingerprint)
    engine = Engine(loaded, store=_store(args, loaded), calibrate=args.calibrate)
    show = None if args.json else (lambda text: print(text, end="", flush=True))
    try:
        top_k = DEFAULT_CHUNKS if args.chunks is None else args.chunks
        answer = ask(engine, retriever, question, tenant=args.tenant, top_k=top_k, request_kw=request_kw,
                     sampling=sampling, compare=args.compare, on_text=show)
    finally:
        engine.close()
        retriever.close()
    if show is not None:
        print()
    _report(args, answer.hits, answer.result, answer.full, _print_stats)
    return 0


def _report(args, hits, result, full, print_stats) -> None:
    import json

    from kvblend.metrics import first_line, token_f1

    if args.json:
        out = result.to_dict()
        out["sources"] = [{"source": h.source, "chunk": h.ordinal, "score": h.score, "chunk_id": h.chunk_id}
                          for h in hits]
        if full is not None:
            out["full"] = full.to_dict()
        print(json.dumps(out, indent=2))
        return
    print("\nsources:", file=sys.stderr)
    for i, (h, d) in enumerate(zip(hits, result.stats.docs), start=1):
        print(f"  [{i}] {h.source} (chunk {h.ordinal}, {d.tokens} tokens, score {h.score:.4f}, KV: {d.source})",
              file=sys.stderr)
    print_stats(result.stats)
    if full is not None:
        speed = full.stats.ttft_s / max(result.stats.ttft_s, 1e-9)
        agree = token_f1(first_line(result.text), first_line(full.text))
        print(f"[compare] full prefill TTFT {full.stats.ttft_s:.3f}s vs {result.stats.method} "
              f"{result.stats.ttft_s:.3f}s ({speed:.1f}x); answer agreement F1 {agree:.2f}", file=sys.stderr)
        print(f"[compare] full prefill answered: {full.text.strip()}", file=sys.stderr)
