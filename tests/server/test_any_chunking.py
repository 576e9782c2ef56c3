"""Any app's chunking over an ingested corpus (issue 41). A folder is ingested with
``kvblend``'s own chunker (128-token windows); then unchanged apps cut the same files their
own way (LangChain's ``RecursiveCharacterTextSplitter``, LlamaIndex's ``SentenceSplitter``),
paste their chunks into a prompt and call ``kvblend serve`` (the real SmolLM2, in process).
No test registers the apps' chunks: the runs of ingested text in the prompt are reused
from the ingested chunks' KV on the first request, and a re-ingest that drops a file drops
its runs from matching."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from kvblend.data import MUSIQUE_RAG
from kvblend.engine import Engine
from kvblend.models import load_model
from kvblend.server.app import create_app
from kvblend.settings import Settings
from tests.server.helpers import uvicorn_thread

MODEL = "smollm2-135m"
KEY, TENANT = "key-any-chunking", "apps"
PASSAGES = [c["text"] for q in json.loads(MUSIQUE_RAG.read_text()) for c in q["ctxs"]][:6]


def ingest(engine: Engine, folder: Path, files: Path) -> None:
    """``kvblend ingest`` of ``files`` into ``folder`` (BM25 only), KV through ``engine``."""
    from kvblend.rag.chunking import ChunkerConfig
    from kvblend.rag.ingest import IngestConfig, Ingestor, KvWarmer
    from kvblend.rag.retriever import Retriever, RetrieverConfig

    retriever = Retriever(RetrieverConfig(folder, mode="bm25"))
    try:
        config = IngestConfig(ChunkerConfig("tokens", 128), tenant=TENANT, dense=False)
        Ingestor(retriever, engine.tokenizer, engine.loaded.tokenizer_fingerprint, config, KvWarmer(engine)).ingest(
            [files], progress=False)
    finally:
        retriever.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An ingested folder of six passages, then a server over it (matching on, discovery off)."""
    work = tmp_path_factory.mktemp("any-chunking")
    files, index = work / "corpus", work / "index"
    files.mkdir()
    for i, p in enumerate(PASSAGES):
        (files / f"passage-{i}.txt").write_text(p)
    engine = Engine(load_model(MODEL))
    ingest(engine, index, files)
    settings = Settings(model=MODEL, api_keys={KEY: TENANT}, state_dir=str(work / "state"),
                        retrieval={"index_dir": str(index)})
    app = create_app(engine, settings)
    with uvicorn_thread(app) as url:
        yield engine, url, files, index, app


def langchain_chunks(texts: list[str]) -> list[str]:
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    splitter = RecursiveCharacterTextSplitter(chunk_size=900, chunk_overlap=100, separators=["\n\n", "\n", ". ", " "])
    return [c for t in texts for c in splitter.split_text(t)]


def langchain_ask(url: str, chunks: list[str], question: str) -> dict:
    """A stuff-the-context chain, unchanged; the raw usage of its answer."""
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are a helpful assistant."),
        ("human", "Answer using the context:\n\n{context}\n\nQuestion: {question}"),
    ])
    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=KEY, max_tokens=4, temperature=0)
    reply = (prompt | llm).invoke({"context": "\n\n".join(chunks), "question": question})
    return reply.response_metadata["token_usage"]


def context_tokens(engine: Engine, chunks: list[str]) -> int:
    return len(engine.tokenizer("\n\n".join(chunks), add_special_tokens=False)["input_ids"])


def test_an_unchanged_langchain_app_reuses_ingested_kv_on_its_first_request(served) -> None:
    engine, url, *_ = served
    chunks = langchain_chunks(PASSAGES[:3])
    assert len(chunks) > 3 and all(len(c) <= 900 for c in chunks)  # its own cuts, not ingest's
    usage = langchain_ask(url, chunks, "Who is the child of the Victim of Romance performer?")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.6 * context_tokens(engine, chunks), (cached, usage)


def test_llamaindex_sentence_chunks_reuse_ingested_kv(served) -> None:
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
    from llama_index.llms.openai_like import OpenAILike

    engine, url, *_ = served
    splitter = SentenceSplitter(chunk_size=120, chunk_overlap=15, tokenizer=str.split)  # the app's own tokens
    chunks = [c for t in PASSAGES[3:5] for c in splitter.split_text(t)]
    assert len(chunks) > 2
    llm = OpenAILike(model=MODEL, api_base=f"{url}/v1", api_key=KEY, is_chat_model=True, max_tokens=4,
                     temperature=0)
    prompt = DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join(chunks), query_str="What is the album?")
    raw = llm.complete(prompt).raw
    usage = raw["usage"] if isinstance(raw, dict) else raw.usage.model_dump()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.6 * context_tokens(engine, chunks), (cached, usage)


def _matched_documents(url: str, chunks: list[str]) -> list[dict]:
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Context:\n\n" + "\n\n".join(chunks) + "\n\nQuestion: who?"}]}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        resp = c.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["kvblend"].get("matches") or []


def test_a_run_crossing_two_ingested_chunks_is_reused_from_both(served) -> None:
    engine, url, files, *_ = served
    text = PASSAGES[5]
    middle = text[300:-300]  # from ~70 tokens into the first 128-token chunk to inside the last
    matches = _matched_documents(url, [middle])
    assert len(matches) >= 2 and not matches[0]["whole"] and matches[0]["chunk_offset"] > 0
    assert not matches[-1]["whole"] and matches[-1]["chunk_offset"] == 0
    assert sum(m["end"] - m["start"] for m in matches) >= 0.9 * len(middle)
    assert {m["document"] for m in matches} == {f"ingest:{files / 'passage-5.txt'}"}
    assert all(b["start"] == a["end"] for a, b in zip(matches, matches[1:]))  # adjacent: the run continues


def test_a_reingest_that_drops_a_file_drops_its_runs(served) -> None:
    engine, url, files, index, _ = served
    kept, dropped = langchain_chunks([PASSAGES[0]]), langchain_chunks([PASSAGES[1]])
    documents = {m["document"] for m in _matched_documents(url, kept + dropped)}
    gone = f"ingest:{files / 'passage-1.txt'}"
    assert gone in documents and f"ingest:{files / 'passage-0.txt'}" in documents
    (files / "passage-1.txt").unlink()
    ingest(engine, index, files)
    deadline = time.monotonic() + 30
    while gone in documents and time.monotonic() < deadline:  # the server follows the catalog (~1 s)
        time.sleep(1.0)
        documents = {m["document"] for m in _matched_documents(url, kept + dropped)}
    assert gone not in documents and f"ingest:{files / 'passage-0.txt'}" in documents
