"""Embedded sample data (see README.md here for its source and licence)."""

from pathlib import Path

MUSIQUE_SAMPLE = Path(__file__).parent / "musique_sample.json"
MUSIQUE_RAG = Path(__file__).parent / "musique_rag.json"  # the demo's corpus: 3 questions, 12 passages
# the blend's shift test measured once for the packaged models (``kvblend.engine.calibration``)
SHIFT_VERDICTS = Path(__file__).parent / "shift_verdicts.json"


def format_musique_passage(title: str, text: str) -> str:
    """One retrieved MuSiQue passage as it enters the prompt (the evaluation's and the
    per-model shift test's one format)."""
    return f"{title}\n\n{text}\n\n"
