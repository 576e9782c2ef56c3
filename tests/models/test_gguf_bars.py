"""The GGUF conversion's progress bar follows transformers' switch (`kvblend ingest --quiet`)."""

from __future__ import annotations

import io

from transformers import modeling_gguf_pytorch_utils as reader
from transformers.utils import logging as hf_logging

from kvblend.models.gguf import _bars_as_configured


def test_the_conversion_bar_is_off_when_bars_are_disabled() -> None:
    """transformers' GGUF reader calls tqdm directly: `--quiet` still drew its tensor bar."""
    original = reader.tqdm
    hf_logging.disable_progress_bar()
    try:
        with _bars_as_configured():
            assert reader.tqdm(range(3)).disable
        assert reader.tqdm is original
    finally:
        hf_logging.enable_progress_bar()
    with _bars_as_configured():
        assert not reader.tqdm(range(3), file=io.StringIO()).disable  # on as configured
    assert reader.tqdm is original
