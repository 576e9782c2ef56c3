"""The GGUF conversion's progress bar follows transformers' switch (`kvblend ingest --quiet`)."""

from __future__ import annotations

import io
import threading
import time

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


def test_two_conversions_at_once_leave_the_reader_as_found() -> None:
    """The switch swaps a module global: a second conversion entering while the first ran
    saved the first's stand-in and, leaving last, put it back for good (bars off for the
    process's life). The first conversion leaves before the second here."""
    original = reader.tqdm
    first_in, first_may_leave, first_left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with _bars_as_configured():
            first_in.set()
            first_may_leave.wait(10)
        first_left.set()

    def second() -> None:
        first_in.wait(10)
        with _bars_as_configured():
            first_left.wait(10)

    hf_logging.disable_progress_bar()
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        first_in.wait(10)
        time.sleep(0.5)  # the second is inside the switch now, or waiting to enter it
        first_may_leave.set()
        for t in threads:
            t.join(10)
    finally:
        hf_logging.enable_progress_bar()
        leaked, reader.tqdm = reader.tqdm, original
    assert leaked is original
