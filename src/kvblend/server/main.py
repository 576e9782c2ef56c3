"""``kvblend serve``: load the model, build the app, run uvicorn, drain on SIGTERM.

The first SIGTERM/SIGINT makes the server refuse new work (503, ``/health`` 503) while
running and queued requests finish for up to ``drain_timeout_s``; then background chunk
writes are flushed and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from types import FrameType

import uvicorn

from kvblend.settings import Settings

log = logging.getLogger("kvblend.server")


class _JsonLines(logging.Formatter):
    """Request lines are JSON already; other records become {"level", "logger", "message"}."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name == "kvblend.server.requests":
            return message
        out = {"level": record.levelname.lower(), "logger": record.name, "message": message}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines())
    root = logging.getLogger("kvblend")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def build_engine(settings: Settings):
    import torch

    from kvblend.engine import Engine, PrefixCache
    from kvblend.models import load_model
    from kvblend.store.config import build_store

    loaded = load_model(settings.model, settings.device, getattr(torch, settings.dtype),
                        decode_weights=settings.decode_weights)
    settings.blend.check_model(loaded.config.num_layers)
    compute = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[settings.dtype]
    store = build_store(settings.store.store_config(compute))
    return Engine(loaded, store=store, prefix_cache=PrefixCache(settings.store.prefix_cache_bytes),
                  calibrate="background" if settings.blend.calibrate else False)  # serve at once


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the app instead of closing sockets."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.kvblend = state
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drainer is not None:  # second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.kvblend.draining = True
        self._drainer = threading.Thread(target=self._drain, name="kvblend-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        timeout = self.kvblend.settings.drain_timeout_s
        log.info("draining: up to %.1f s for running requests", timeout)
        try:
            self.kvblend.scheduler.drain(timeout)
        except Exception:  # noqa: BLE001 - exit anyway, but say why
            log.exception("drain failed")
        log.info("drained; stopping")
        self.should_exit = True


def serve(settings: Settings) -> int:
    """Run the server until a signal drains it; returns the exit status."""
    from kvblend.server.app import create_app

    configure_logging(settings.log_level)
    engine = build_engine(settings)
    app = create_app(engine, settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, app.state.kvblend)
    log.info("serving %s on http://%s:%d", settings.model_id, settings.host, settings.port)
    try:
        server.run()
    finally:
        engine.close()
    return 0


__all__ = ["DrainingServer", "build_engine", "configure_logging", "serve"]
