"""Retrieval for RAG: quality on MuSiQue, end-to-end answers, ingest throughput, query latency.

(a) One index over every passage of the development questions (``musique_dev.json``: 100
    questions x 10 passages, 861 distinct). For each question, recall@6 of its own first 6
    passages (the ones the CacheBlend evaluation gives the model), for dense
    (all-MiniLM-L6-v2), BM25 (bm25s) and hybrid (reciprocal-rank fusion).
(b) End to end on a few questions (SmolLM2, blend at r = 0.15): the answer from the top-6
    retrieved chunks against the answer from the 6 given passages (agreement token F1), and
    both against the gold answer.
(c) Ingest throughput (chunks/s embedded, tokens/s of chunk-KV precompute, measured in (a)
    and (b)) and the vector index's query latency p50/p95 at 1k, 10k and 100k chunks
    (synthetic clustered 384-d vectors; 200 queries each), plus a whole dense search
    (query embedding + index + catalog) over the real index.

Ends with ONE line of JSON. Run:  python benchmarks/rag.py [--data ../shared/data/musique_dev.json] [--e2e 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvblend.rag.chunking import ChunkerConfig
from kvblend.rag.faiss_index import FaissIndex
from kvblend.rag.ingest import IngestConfig, Ingestor, KvWarmer
from kvblend.rag.readers import Document
from kvblend.rag.retriever import MODES, Retriever, RetrieverConfig

TENANT = "bench"


def passages(data: list[dict]) -> tuple[list[Document], list[list[str]]]:
    """Distinct passages as documents, and each question's first-6 sources."""
    source_of: dict[str, str] = {}
    own = []
    for ex in data:
        mine = []
        for j, c in enumerate(ex["ctxs"]):
            src = source_of.setdefault(c["text"], f"p{len(source_of):04d}")
            if j < 6:
                mine.append(src)
        own.append(mine)
    return [Document(s, t) for t, s in source_of.items()], own


def recall_at_6(retriever: Retriever, data: list[dict], own: list[list[str]]) -> dict[str, float]:
    out = {}
    for mode in MODES:
        scores = []
        for ex, mine in zip(data, own):
            got = {h.source for h in retriever.search(TENANT, ex["question"], 6, mode)}
            scores.append(len(got & set(mine)) / len(set(mine)))
        out[mode] = round(statistics.mean(scores), 4)
    return out


def percentiles(samples: list[float]) -> tuple[float, float]:
    ms = np.asarray(samples) * 1e3
    return round(float(np.percentile(ms, 50)), 3), round(float(np.percentile(ms, 95)), 3)


def index_latency(n: int, folder: Path, dim: int = 384, queries: int = 200) -> tuple[float, float, float]:
    """(p50 ms, p95 ms, recall@6 vs exact) of FaissIndex.search over n clustered vectors."""
    rng = np.random.default_rng(n)
    centers = rng.standard_normal((max(8, n // 50), dim)).astype(np.float32)
    vecs = centers[rng.integers(0, len(centers), n)] + 0.7 * rng.standard_normal((n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx = FaissIndex(folder, dim)
    for s in range(0, n, 10_000):
        idx.upsert(TENANT, [str(i) for i in range(s, min(n, s + 10_000))], vecs[s : s + 10_000])
    qs = vecs[rng.integers(0, n, queries)] + 0.05 * rng.standard_normal((queries, dim)).astype(np.float32)
    exact = np.argsort(-(qs @ vecs.T), axis=1)[:, :6]
    times, found = [], 0
    for q, truth in zip(qs, exact):
        t = time.perf_counter()
        hits = idx.search(TENANT, q, 6)
        times.append(time.perf_counter() - t)
        found += len({int(h.chunk_id) for h in hits} & set(truth.tolist()))
    idx.close()
    return (*percentiles(times), round(found / (6 * queries), 4))


def dense_search_latency(retriever: Retriever, data: list[dict]) -> tuple[float, float]:
    times = []
    for ex in data:
        t = time.perf_counter()
        retriever.search(TENANT, ex["question"], 6, "dense")
        times.append(time.perf_counter() - t)
    return percentiles(times)


def end_to_end(loaded, retriever: Retriever, data: list[dict], n: int, home: Path) -> dict:
    """Blend over retrieved vs given passages on ``n`` questions; KV precompute timed."""
    from kvblend.blend.config import BlendConfig
    from kvblend.engine import Engine, Request
    from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, musique_query
    from kvblend.metrics import best_f1, first_line, token_f1
    from kvblend.generation import SamplingParams
    from kvblend.rag.ask import ask
    from kvblend.store.config import StoreConfig, build_store

    engine = Engine(loaded, store=build_store(StoreConfig(disk_dir=str(home / "kv"), disk_fsync=False)))
    warmer = KvWarmer(engine)
    sampling = SamplingParams(max_tokens=24, stop=("\n",))
    kw = dict(system=MUSIQUE_INSTRUCTION, method="blend", blend=BlendConfig(ratio=0.15))
    agree, gold_r, gold_g, kv_tokens, kv_s = [], [], [], 0, 0.0
    for ex in data[:n]:
        given = [tuple(loaded.tokenizer(c["text"], add_special_tokens=False)["input_ids"]) for c in ex["ctxs"][:6]]
        hits = retriever.search(TENANT, ex["question"], 6, "hybrid")
        for ids in given + [h.token_ids for h in hits]:
            t = time.perf_counter()
            if warmer.warm(ids, TENANT):
                kv_s += time.perf_counter() - t
                kv_tokens += len(ids)
        got = ask(engine, retriever, musique_query(ex["question"]), tenant=TENANT, top_k=6, request_kw=kw,
                  sampling=sampling, query=ex["question"])
        ref = engine.generate(Request(documents=given, question=musique_query(ex["question"]), tenant=TENANT, **kw),
                              sampling)
        a, b = first_line(got.result.text), first_line(ref.text)
        agree.append(token_f1(a, b))
        gold_r.append(best_f1(a, ex["answers"]))
        gold_g.append(best_f1(b, ex["answers"]))
        print(f"  {ex['question'][:60]!r}: retrieved {a!r} | given {b!r} | gold {ex['answers'][0]!r}", flush=True)
    engine.close()
    return {"e2e_questions": n, "agree_f1_retrieved_vs_given": round(statistics.mean(agree), 4),
            "gold_f1_retrieved": round(statistics.mean(gold_r), 4), "gold_f1_given": round(statistics.mean(gold_g), 4),
            "kv_precompute_tokens_per_s": round(kv_tokens / kv_s, 1) if kv_s else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/musique_dev.json")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--e2e", type=int, default=2, help="questions for the end-to-end part (0: skip)")
    ap.add_argument("--scales", default="1000,10000,100000")
    args = ap.parse_args()
    from kvblend.models import load_model

    data = json.loads(Path(args.data).read_text())
    docs, own = passages(data)
    loaded = load_model(args.model)
    out: dict = {"passages": len(docs), "questions": len(data)}
    with tempfile.TemporaryDirectory(prefix="kvblend-rag-bench-") as tmp:
        home = Path(tmp)
        retriever = Retriever(RetrieverConfig(home / "index"))
        ingestor = Ingestor(retriever, loaded.tokenizer, loaded.tokenizer_fingerprint,
                            IngestConfig(ChunkerConfig("tokens", 1024), tenant=TENANT, batch_size=64))
        s = ingestor.ingest_documents(docs, progress=False)
        out.update(chunks=s.chunks_new, embed_chunks_per_s=round(s.chunks_new / s.embed_s, 1),
                   ingest_s=round(s.total_s, 1))
        recall = recall_at_6(retriever, data, own)
        out.update({f"recall_at_6_{m}": v for m, v in recall.items()})
        print(f"(a) recall@6 of each question's own 6 passages over {len(docs)} passages: {recall}", flush=True)
        p50, p95 = dense_search_latency(retriever, data)
        out.update(dense_search_p50_ms=p50, dense_search_p95_ms=p95)
        print(f"    whole dense search (embed query + index + catalog) over {s.chunks_new} chunks: "
              f"p50 {p50} ms, p95 {p95} ms", flush=True)
        if args.e2e:
            print(f"(b) end to end, {args.e2e} question(s):", flush=True)
            out.update(end_to_end(loaded, retriever, data, args.e2e, home))
        retriever.close()
        print("(c) vector index query latency (synthetic clustered vectors, 384-d, top-6):", flush=True)
        for n in (int(x) for x in args.scales.split(",")):
            p50, p95, rec = index_latency(n, home / f"scale-{n}")
            label = f"{n // 1000}k"
            out.update({f"query_p50_ms_{label}": p50, f"query_p95_ms_{label}": p95, f"index_recall_{label}": rec})
            print(f"    {n:>7d} chunks: p50 {p50} ms, p95 {p95} ms, recall@6 vs exact {rec}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
