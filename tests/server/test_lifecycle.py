"""Two server processes sharing one real redis-server, and SIGTERM during a stream:
new work gets 503, the running stream finishes, write-back is flushed, exit status 0."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import main_config
from tests.server.helpers import ALICE, ServerProcess

AUTH = {"Authorization": f"Bearer {ALICE}"}

DOC = "the novel about the river of oslo was published by the company in the year two ."


@pytest.fixture(scope="module")
def second(tiny_model_dir, tmp_path_factory, redis_url):
    """Another server (memory, disk, redis) with the same keys, sharing the main one's redis."""
    root = tmp_path_factory.mktemp("second")
    config = {**main_config(redis_url), "drain_timeout_s": 90}  # ends once drained; slack for a loaded host
    config["store"] = {"tiers": ["memory", "disk", "redis"], "redis_url": redis_url, "disk_dir": str(root / "disk")}
    proc = ServerProcess(tiny_model_dir, root, config)
    yield proc, root / "disk"
    proc.stop()


def model_of(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def test_a_second_server_hits_the_first_ones_document_in_redis(server, second) -> None:
    b, _ = second
    stored = httpx.post(server.url + "/v1/documents", json={"text": DOC}, headers=AUTH, timeout=60).json()
    assert "redis" in stored["tiers"]
    body = {"model": model_of(b), "messages": [{"role": "user", "content": "who published the novel ?"}],
            "documents": [DOC], "max_tokens": 2, "temperature": 0}
    first = httpx.post(b.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert first["kvblend"]["documents"][0]["source"] == "redis"  # B never saw this document
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= stored["tokens"]
    again = {**body, "messages": [{"role": "user", "content": "who published it ?"}]}  # not the same prompt whole
    second_time = httpx.post(b.url + "/v1/chat/completions", json=again, headers=AUTH, timeout=60).json()
    assert second_time["kvblend"]["documents"][0]["source"] == "memory"  # promoted on the first hit
    httpx.delete(server.url + f"/v1/documents/{stored['id']}", headers=AUTH)


def test_sigterm_during_a_stream_drains_and_exits_zero(second) -> None:
    a, disk = second
    model = model_of(a)
    fresh = "the green river of madrid and the blue city of rome ."
    warm = {"model": model, "messages": [{"role": "user", "content": "which river ?"}], "documents": [fresh],
            "max_tokens": 1, "temperature": 0}
    assert httpx.post(a.url + "/v1/chat/completions", json=warm, headers=AUTH, timeout=60).status_code == 200
    lines: list[str] = []
    started = threading.Event()

    def read_stream() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", a.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert started.wait(60)
    a.proc.send_signal(15)
    refused = None
    deadline = time.monotonic() + 20
    while refused is None and time.monotonic() < deadline and reader.is_alive():
        try:
            health = httpx.get(a.url + "/health", timeout=2)
            new = httpx.post(a.url + "/v1/chat/completions", json=warm, headers=AUTH, timeout=10)
            if health.status_code == 503:
                refused = (health.status_code, new.status_code, new.json()["error"]["code"])
        except httpx.TransportError:
            break
        time.sleep(0.02)
    reader.join(120)
    assert refused == (503, 503, 503)
    assert lines[-1] == "data: [DONE]"
    assert '"completion_tokens": 1500' in lines[-2]  # the running stream finished in full
    assert a.proc.wait(30) == 0
    assert list(Path(disk).rglob("*.safetensors")), "write-back of the missed document reached the disk tier"
    assert '"event": "request"' in a.log() and fresh not in a.log()  # request lines, never document text
