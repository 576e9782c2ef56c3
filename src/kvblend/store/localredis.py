"""A throwaway ``redis-server`` on a free loopback port, for tests and benchmarks.

No persistence (``--save '' --appendonly no``), its own temporary directory, stopped on
exit. Install the binary with ``scripts/ensure-redis.sh``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class RedisServerMissing(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """``with LocalRedis() as r: r.url`` — a private server; ``stop()``/``start()`` simulate
    an outage (the same port is reused)."""

    def __init__(self, port: int | None = None, startup_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerMissing("redis-server not found: run scripts/ensure-redis.sh")
        self.binary = binary
        self.port = port or free_port()
        self.startup_s = startup_s
        self._dir = tempfile.TemporaryDirectory(prefix="kvblend-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> LocalRedis:
        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--dir", self._dir.name, "--protected-mode", "yes", "--daemonize", "no"]
        log = open(Path(self._dir.name) / "redis.log", "ab")
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.startup_s
        try:
            while time.monotonic() < deadline:
                if self._proc is not None and self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise RuntimeError(f"redis-server did not answer within {self.startup_s} s")
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def log_tail(self, n: int = 2000) -> str:
        path = Path(self._dir.name) / "redis.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
