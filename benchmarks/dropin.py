"""Any app's chunking over an ingested corpus: what an unchanged app gets on its first question.

    .venv/bin/python benchmarks/dropin.py [--ingest-questions 20] [--questions 10] [--passages 6]
        [--chunks 500,1000,2000] [--overlap 0.1] [--index-documents 100000]
        [--data ../shared/data/musique_dev.json] [--seed 0]

As a new user meets it, in one process on a fresh ``KVBLEND_HOME`` (empty tiers):

1. ``kvblend ingest`` (the ``Ingestor``, KV precomputed into serve's store: memory, then the
   disk tier; kvblend's own 512-token chunks, BM25) of the passages of the first ``--ingest-questions`` MuSiQue dev questions, one file each;
2. ``kvblend serve`` over it (``create_app`` under uvicorn on loopback; matching on, its
   defaults otherwise), started after the ingest: the ingested texts are its matching index;
3. an app-style client for each ``--chunks`` size: every one of the first ``--questions``
   questions is asked once, its first ``--passages`` passages cut by the app's own splitter
   (LangChain's ``RecursiveCharacterTextSplitter``, ``size`` characters, ``--overlap`` of it
   overlapping, at paragraph, line, sentence and word ends) and pasted, chunk after chunk,
   into the user message (``Context:``, the chunks, the question) after a system message.
   Nothing of the app's is registered. Each prompt is sent twice, side by side: the server's
   default method, then ``kvblend.method: full`` (full prefill) for its TTFT.

Reported per chunk size: ``first_ask_cached_share`` (mean over questions of
``cached_tokens / prompt_tokens`` on the first ask; goal >= 0.6), the share of the context's
own tokens served from cache, and median TTFT over full prefill's. Then the matching index
at scale: the ingested texts plus ``--index-documents`` synthetic passages (40-160 words of
the model's vocabulary, as ``benchmarks/matching.py`` makes them) in one tenant's
``DocumentIndex`` with the model's tokenizer, timing ``match`` over the prompts the app sent
(``match_p95_ms``; goal <= 5) and its size per stored token (``index_bytes_per_stored_token``,
as the index counts it, and the process's resident growth per token while it was built).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matching import paragraph, vocabulary  # noqa: E402  (benchmarks/matching.py)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_dev.json"
SYSTEM = "Answer the question from the context. Give only the answer, in a few words."
KEY, TENANT = "dropin-bench-key", "app"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def app_splitter(size: int, overlap: int):
    """The app's own splitter: LangChain's, as a LangChain app configures it."""
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    return RecursiveCharacterTextSplitter(chunk_size=size, chunk_overlap=overlap,
                                          separators=["\n\n", "\n", ". ", " ", ""])


def ingest(engine, folder: Path, files: Path) -> float:
    from kvblend.rag.ingest import IngestConfig, Ingestor, KvWarmer
    from kvblend.rag.retriever import Retriever, RetrieverConfig

    t = time.perf_counter()
    retriever = Retriever(RetrieverConfig(folder, mode="bm25"))
    try:
        config = IngestConfig(tenant=TENANT, dense=False)
        Ingestor(retriever, engine.tokenizer, engine.loaded.tokenizer_fingerprint, config, KvWarmer(engine)).ingest(
            [files], progress=False)
    finally:
        retriever.close()
    return time.perf_counter() - t


def ask(client: httpx.Client, model: str, chunks: list[str], question: str, method: str | None) -> dict:
    body = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Context:\n\n" + "\n\n".join(chunks) + f"\n\nQuestion: {question}"}]}
    if method is not None:
        body["kvblend"] = {"method": method}
    t = time.perf_counter()
    resp = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t
    resp.raise_for_status()
    data = resp.json()
    usage = data["usage"]
    return {"s": elapsed, "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "matches": data.get("kvblend", {}).get("matches") or []}


def run_app(url: str, model: str, examples: list, sizes: list[int], overlap: float, passages: int,
            tokenizer) -> tuple[dict, list[str]]:
    out, prompts = {}, []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as client:
        for size in sizes:
            splitter = app_splitter(size, int(size * overlap))
            shares, context_shares, ratios = [], [], []
            for ex in examples:
                chunks = [c for p in ex.documents[:passages] for c in splitter.split_text(p)]
                blended = ask(client, model, chunks, ex.question, None)
                full = ask(client, model, chunks, ex.question, "full")
                context = len(tokenizer("\n\n".join(chunks), add_special_tokens=False)["input_ids"])
                shares.append(blended["cached"] / blended["prompt"])
                context_shares.append(min(1.0, blended["cached"] / context))
                ratios.append(blended["s"] / full["s"])
                prompts.append("Context:\n\n" + "\n\n".join(chunks) + f"\n\nQuestion: {ex.question}")
            out[size] = {"first_ask_cached_share": round(statistics.mean(shares), 3),
                         "context_cached_share": round(statistics.mean(context_shares), 3),
                         "min_cached_share": round(min(shares), 3),
                         "ttft_over_full_p50": round(statistics.median(ratios), 3), "questions": len(examples)}
            print(f"app chunks of {size} characters ({int(size * overlap)} overlap): first ask cached "
                  f"{out[size]['first_ask_cached_share']:.3f} of the prompt (min {out[size]['min_cached_share']:.3f}), "
                  f"{out[size]['context_cached_share']:.3f} of the context; TTFT / full prefill p50 "
                  f"{out[size]['ttft_over_full_p50']:.3f}", flush=True)
    return out, prompts


def index_at_scale(tokenizer, ingested: list[str], prompts: list[str], n: int, seed: int) -> dict:
    """The matching index with the ingested texts and ``n`` synthetic passages; match timing."""
    from kvblend.engine.matching import DocumentIndex, IndexedText

    rng = random.Random(seed)
    words = vocabulary(tokenizer)
    before = rss_bytes()
    index = DocumentIndex(max_bytes=1 << 40, tokenizer=tokenizer)
    t = time.perf_counter()
    texts = ingested + [paragraph(rng, words, 40, 160) for _ in range(n)]
    for i in range(0, len(texts), 2000):
        batch = texts[i : i + 2000]
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        index.add(TENANT, [IndexedText(x, tuple(d), f"c{i + j}", f"d{i + j}") for j, (x, d) in enumerate(zip(batch, ids))])
    build_s = time.perf_counter() - t
    grown = rss_bytes() - before
    tokens = index.tokens()
    times = []
    for _ in range(5):
        for p in prompts:
            t = time.perf_counter()
            found = index.match(TENANT, [SYSTEM, p])
            times.append((time.perf_counter() - t) * 1e3)
            assert found, "the ingested passages were not found at scale"
    q = statistics.quantiles(times, n=100)
    out = {"stored_documents": len(texts), "stored_tokens": tokens, "match_p50_ms": round(q[49], 3),
           "match_p95_ms": round(q[94], 3), "index_bytes_per_stored_token": round(index.nbytes / tokens, 1),
           "index_rss_bytes_per_stored_token": round(grown / tokens, 1), "index_build_s": round(build_s, 1)}
    print(f"matching index: {len(texts)} stored texts, {tokens} tokens, {index.nbytes / 2**20:.0f} MiB counted "
          f"({out['index_bytes_per_stored_token']} B/token; the process grew {out['index_rss_bytes_per_stored_token']} "
          f"B/token), built in {build_s:.0f} s; match over the app's prompts p50 {out['match_p50_ms']} ms, "
          f"p95 {out['match_p95_ms']} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--ingest-questions", type=int, default=20)
    ap.add_argument("--questions", type=int, default=10, help="questions the app asks (of those ingested)")
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--chunks", default="500,1000,2000", help="the app's chunk sizes, in characters")
    ap.add_argument("--overlap", type=float, default=0.1, help="the app's overlap, a share of its chunk size")
    ap.add_argument("--index-documents", type=int, default=100_000, help="synthetic passages in the scale test (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.questions > args.ingest_questions:
        ap.error("--questions must be at most --ingest-questions")

    with tempfile.TemporaryDirectory(prefix="kvblend-dropin-") as tmp:
        work = Path(tmp)
        home = os.environ.get("KVBLEND_HOME", str(Path.home() / ".cache" / "kvblend"))
        (work / "home").mkdir()
        os.symlink(Path(home) / "models", work / "home" / "models")  # the converted weights only
        os.environ["KVBLEND_HOME"] = str(work / "home")

        from kvblend.eval.datasets import load_musique
        from kvblend.models import DEFAULT_MODEL
        from kvblend.server.app import create_app
        from kvblend.server.main import build_engine
        from kvblend.settings import Settings
        from kvblend.store.localredis import free_port

        examples = load_musique(args.data, limit=args.ingest_questions, n_docs=args.passages)
        files = work / "corpus"
        files.mkdir()
        texts = list(dict.fromkeys(d for ex in examples for d in ex.documents))
        for i, text in enumerate(texts):
            (files / f"passage-{i:04d}.txt").write_text(text)
        settings = Settings(model=DEFAULT_MODEL, api_keys={KEY: TENANT}, state_dir=str(work / "state"),
                            port=free_port(), retrieval={"index_dir": str(work / "index")},
                            store={"tiers": ["memory", "disk"]})
        engine = build_engine(settings)  # serve's: memory, then the disk tier ingest writes (fresh home)
        ingest_s = ingest(engine, work / "index", files)
        print(f"ingested {len(texts)} passages of {len(examples)} questions in {ingest_s:.0f} s", flush=True)
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(create_app(engine, settings), host="127.0.0.1", port=settings.port,
                                               log_level="warning"))
        import threading

        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{settings.port}"
        sizes = [int(s) for s in args.chunks.split(",")]
        try:
            per_size, prompts = run_app(url, DEFAULT_MODEL, examples[: args.questions], sizes, args.overlap,
                                        args.passages, engine.tokenizer)
        finally:
            server.should_exit = True
            thread.join(30)
        scale = index_at_scale(engine.tokenizer, texts, prompts, args.index_documents, args.seed) \
            if args.index_documents else {}
    out = {"first_ask_cached_share": {str(s): v["first_ask_cached_share"] for s, v in per_size.items()},
           "context_cached_share": {str(s): v["context_cached_share"] for s, v in per_size.items()},
           "ttft_over_full_p50": {str(s): v["ttft_over_full_p50"] for s, v in per_size.items()},
           "ingested_passages": len(texts), "questions": args.questions, "overlap": args.overlap, **scale}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
