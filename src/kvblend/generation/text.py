"""Incremental detokenisation with stop strings, for streaming."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # tokens decoded before the new ones, so that merges and spaces across them come out right


class TextStream:
    """Turns generated token ids into text deltas, holding back partial UTF-8 and any
    tail that could still become a stop string. ``stopped`` turns True once a stop
    string appears; the text before it is all that is ever emitted.

    Each token costs a decode of a few tokens, not of the whole answer: the text so far
    is grown by the difference between decoding a short window of tokens with and
    without the new ones (the window starts a few tokens back, so that a tokenizer's
    merges, leading spaces and byte pieces across the boundary decode as they do in
    the whole answer). A window ending in a partial UTF-8 character is not read yet.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:self._read]
        self.emitted = ""
        self.stopped = False
        self._prefix = 0  # the window starts here ...
        self._read = 0  # ... and self.text covers the ids before here

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self) -> None:
        """Grow ``text`` by the new tokens' text, unless it ends in a partial character."""
        window = self._decode(self.ids[self._prefix:])
        seen = self._decode(self.ids[self._prefix:self._read])
        if window.endswith(REPLACEMENT) or len(window) < len(seen):
            return  # a partial UTF-8 character (or a merge not settled): wait for more tokens
        self.text += window[len(seen):]
        self._read = len(self.ids)
        self._prefix = max(self._prefix, self._read - CONTEXT_TOKENS)

    def _stop_cut(self, text: str, since: int) -> int | None:
        """Where the first stop string starts in ``text``, looking only where one could be new."""
        hits = [i for i in (text.find(s, max(0, since - len(s) + 1)) for s in self.stop) if i >= 0]
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
        before = len(self.text)
        self.ids.append(token_id)
        self._advance()
        if len(self.text) == before:
            return ""
        cut = self._stop_cut(self.text, len(self.emitted))
        if cut is not None:
            self.stopped = True
            return self._emit(self.text[:cut])
        return self._emit(self.text[: len(self.text) - self._held_back(self.text)])

    def finish(self) -> str:
        """Flush what was held back (call once generation ends without a stop)."""
        if self.stopped:
            return ""
        if self._read < len(self.ids):  # a partial character at the very end: shown as decoded
            self.text += self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
            self._read = len(self.ids)
        return self._emit(self.text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
