"""`kvblend demo`: retrieval-augmented answers by CacheBlend over a small bundled corpus.

On first run it ingests 12 MuSiQue passages (CC BY 4.0; see kvblend/data/README.md):
chunks on the model's tokenizer, embeds and indexes them, and precomputes each chunk's KV
into the disk store under ``$KVBLEND_HOME``. Later runs find everything unchanged. Then it
answers a few questions: retrieve the top-k passages, blend their cached KV, and print the
TTFT beside a full prefill of the same prompt, the answers, and the sources.
"""

from __future__ import annotations

import argparse
import json
import time

from kvblend.blend.config import BlendConfig
from kvblend.data import MUSIQUE_RAG
from kvblend.engine import Engine
from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, musique_query
from kvblend.metrics import best_f1, first_line, token_f1
from kvblend.generation import SamplingParams
from kvblend.cliargs import load_from_args
from kvblend.rag.ask import Answer, ask
from kvblend.rag.chunking import ChunkerConfig
from kvblend.commands.ingest import default_store_dir
from kvblend.rag.retriever import default_index_dir
from kvblend.rag.ingest import IngestConfig, Ingestor, KvWarmer
from kvblend.rag.readers import Document
from kvblend.rag.retriever import Retriever, RetrieverConfig
from kvblend.store.config import StoreConfig, build_store

DEMO_TENANT = "demo"
CHUNK_TOKENS = 1024  # one MuSiQue passage (~450 words) per chunk, as in the paper's setup


def _say(text: str) -> None:
    print(text, flush=True)


def _corpus() -> tuple[list[Document], list[dict]]:
    examples = json.loads(MUSIQUE_RAG.read_text())
    docs = [Document(f"musique/q{i}/p{j}", c["text"]) for i, ex in enumerate(examples) for j, c in enumerate(ex["ctxs"])]
    return docs, examples


def _ingest(engine: Engine, retriever: Retriever, loaded, docs: list[Document]) -> None:
    config = IngestConfig(ChunkerConfig("tokens", CHUNK_TOKENS), tenant=DEMO_TENANT, batch_size=8)
    ingestor = Ingestor(retriever, loaded.tokenizer, loaded.tokenizer_fingerprint, config, KvWarmer(engine))
    s = ingestor.ingest_documents(docs)
    if s.chunks_new:
        _say(f"ingested {s.documents} passages: {s.chunks_new} chunks, {s.tokens_new} tokens; chunk KV computed in "
             f"{s.kv_s:.1f}s, embedded in {s.embed_s:.1f}s (done once: later runs re-use both)")
    else:
        _say(f"corpus already ingested ({s.unchanged} passages unchanged): re-using its index and chunk KV")


def _answer(engine: Engine, retriever: Retriever, question: str, top_k: int, ratio: float) -> Answer:
    kw = dict(system=MUSIQUE_INSTRUCTION, method="blend", blend=BlendConfig(ratio=ratio))
    return ask(engine, retriever, musique_query(question), tenant=DEMO_TENANT, top_k=top_k, request_kw=kw,
               sampling=SamplingParams(max_tokens=24, stop=("\n",)), compare=True, query=question)


def _report(example: dict, a: Answer) -> None:
    blend, full = a.result, a.full
    s, f = blend.stats, full.stats
    hits = sum(d.hit for d in s.docs)
    _say(f"Q: {example['question']}   (gold: {example['answers'][0]})")
    _say(f"  full prefill  TTFT {f.ttft_s:6.2f}s  answer {first_line(full.text)!r}")
    _say(f"  blend         TTFT {s.ttft_s:6.2f}s  answer {first_line(blend.text)!r}  "
         f"({hits}/{len(s.docs)} chunks from cache, {s.recompute_frac:.0%} recomputed, "
         f"{f.ttft_s / max(s.ttft_s, 1e-9):.1f}x faster)")
    _say(f"  agreement with full (token F1) {token_f1(first_line(blend.text), first_line(full.text)):.2f}; "
         f"gold F1 full {best_f1(first_line(full.text), example['answers']):.2f}, "
         f"blend {best_f1(first_line(blend.text), example['answers']):.2f}")
    for i, (h, d) in enumerate(zip(a.hits, s.docs), start=1):
        _say(f"  [{i}] {h.source}  score {h.score:.4f}  {d.tokens} tokens  KV: {d.source}  "
             f"{h.text.strip()[:60]!r}")
    _say("")


def run_demo(args: argparse.Namespace) -> int:
    t = time.perf_counter()
    loaded = load_from_args(args)
    _say(f"model {loaded.name}: {loaded.config.num_layers} layers, loaded in {time.perf_counter() - t:.1f}s")
    engine = Engine(loaded, store=build_store(StoreConfig(disk_dir=str(default_store_dir()))))
    folder = default_index_dir(loaded.tokenizer_fingerprint).with_name(f"demo-{loaded.tokenizer_fingerprint[:16]}")
    retriever = Retriever(RetrieverConfig(folder))
    try:
        docs, examples = _corpus()
        _ingest(engine, retriever, loaded, docs)
        _say(f"index {folder}, chunk KV in {default_store_dir()}\n")
        for example in examples[: args.questions]:
            _report(example, _answer(engine, retriever, example["question"], args.chunks, args.ratio))
    finally:
        retriever.close()
        engine.close()
    return 0
