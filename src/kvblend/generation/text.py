"""Incremental detokenisation with stop strings, for streaming."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns generated token ids into text deltas, holding back partial UTF-8 and any
    tail that could still become a stop string. ``stopped`` turns True once a stop
    string appears; the text before it is all that is ever emitted.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _stop_cut(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.stop if s in text]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """How many trailing chars might begin a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    longest = max(longest, n)
                    break
        return longest

    def push(self, token_id: int) -> str:
        """Add one token; return the newly safe text (possibly empty)."""
        self.ids.append(token_id)
        text = self._decoded()
        cut = self._stop_cut(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith(REPLACEMENT):
            return ""
        return self._emit(text[: len(text) - self._held_back(text)])

    def finish(self) -> str:
        """Flush what was held back (call once generation ends without a stop)."""
        if self.stopped:
            return ""
        return self._emit(self._decoded())

    def _emit(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
