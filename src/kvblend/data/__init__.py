"""Embedded sample data (see README.md here for its source and licence)."""

from pathlib import Path

MUSIQUE_SAMPLE = Path(__file__).parent / "musique_sample.json"
MUSIQUE_RAG = Path(__file__).parent / "musique_rag.json"  # the demo's corpus: 3 questions, 12 passages
