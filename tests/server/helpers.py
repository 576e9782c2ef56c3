"""Start a real ``kvblend serve`` in a subprocess on a free loopback port, or an app under
uvicorn in a thread."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvblend.store.localredis import free_port

ALICE, BOB, ADMIN = "key-alice-0001", "key-bob-00001", "key-admin-001"
# a tenant only test_guard_shadow_checks_every_blend_without_changing_answers uses, on the shared
# server and its own: a blend's escalation depends on its tenant's earlier risks, so the two
# servers' answers are comparable only for a tenant with the same history on both
CAROL = "key-carol-0001"


@contextlib.contextmanager
def uvicorn_thread(app: Any, start_timeout_s: float = 60.0) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a daemon thread; yields its URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        srv.should_exit = True
        thread.join(30)


def concurrently(client: Any, n: int, timeout_s: float = 600.0) -> dict[int, Any]:
    """``client(i)`` for i < ``n`` on threads started together: each one's result by i; the
    first exception any raised is raised here."""
    got: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = client(i)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert len(got) == n, f"clients still running after {timeout_s} s"
    return got


def save_tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama with the word-level ChatML tokenizer, as an HF folder
    (2048-token context, so that long generations and over-long prompts are cheap)."""
    from tests.conftest import make_hf_model, make_tokenizer

    tok = make_tokenizer()
    model = make_hf_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class ServerProcess:
    """``kvblend serve`` with a YAML config; ``url``; ``stop()`` sends SIGTERM and returns
    the exit status; ``log()`` is what it wrote to stderr/stdout."""

    def __init__(self, model: str, workdir: Path, config: dict, ready_s: float | None = 90.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {"state_dir": str(workdir / "state"), **config}
        self.config_file = workdir / "kvblend.yaml"
        self.config_file.write_text(yaml.safe_dump(cfg))
        self.log_file = workdir / "server.log"
        env = {**os.environ, "KVBLEND_HOME": os.environ.get("KVBLEND_HOME", str(Path.home() / ".cache" / "kvblend"))}
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvblend", "serve", "--model", model, "--port", str(self.port),
                 "--config", str(self.config_file)], stdout=log, stderr=subprocess.STDOUT, env=env)
        if ready_s is not None:
            self.wait_ready(ready_s)

    def wait_ready(self, ready_s: float = 90.0) -> ServerProcess:
        """Block until /health answers 200 (start several servers first, then wait)."""
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {ready_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def openai_in_process(engine: Any, state_dir: Path, **settings_kwargs: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``kvblend serve``'s app over ``engine`` in this process (no socket): the engine, the
    HTTP test client, and the real ``openai`` client speaking through it. ``settings_kwargs``:
    settings other than the defaults."""
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from kvblend.server.app import create_app
    from kvblend.settings import Settings

    settings = Settings.load(model="tiny", state_dir=str(state_dir), **settings_kwargs)
    with TestClient(create_app(engine, settings)) as http:
        yield engine, http, OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
