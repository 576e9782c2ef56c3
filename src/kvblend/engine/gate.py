"""Admission of requests into an engine that may be closing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvblend.errors import EngineClosedError


class RequestGate:
    """Lets requests in until ``close``; ``close`` then waits for those inside to leave.

    Requests that arrive after ``close`` began get ``EngineClosedError``; one already
    inside finishes normally, so the engine's shared resources (store, writer) are only
    shut down once nothing uses them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    @contextmanager
    def admit(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed: it takes no new requests")
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def close(self) -> bool:
        """Refuse new requests and wait for admitted ones; False if already closed."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.wait_for(lambda: self._inside == 0)
            return True
