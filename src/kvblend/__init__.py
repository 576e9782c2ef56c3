"""kvblend: CacheBlend-style KV reuse for retrieval-augmented generation.

Reference: Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with
Cached Knowledge Fusion", EuroSys '25 (arXiv 2405.16444).
"""

__version__ = "0.1.0"
