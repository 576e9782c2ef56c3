"""Retrieval for RAG: chunking on the model's tokenizer, an embedded retriever (dense, BM25,
hybrid), and ingestion that precomputes each chunk's KV into the store.

The narrow entry points the server can call:

    Retriever(RetrieverConfig(folder)).search(tenant, query, top_k) -> list[Hit]
    Ingestor(...).chunk(text) -> list[Chunk]          # the same chunking as ``kvblend ingest``
"""

from kvblend.rag.chunking import Chunk, ChunkerConfig, chunk_text
from kvblend.rag.retriever import Hit, Retriever, RetrieverConfig

__all__ = ["Chunk", "ChunkerConfig", "Hit", "Retriever", "RetrieverConfig", "chunk_text"]
