"""``kvblend ingest`` and ``kvblend serve`` share one chunk store (issue #21, point 5):
chunks ingested once are disk hits in a fresh server on the default settings, and on a
model without a BOS token ``/v1/completions`` hits the chunks ``/v1/documents`` stored."""

from __future__ import annotations

import httpx
from starlette.testclient import TestClient

from kvblend.cli import main
from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded
from tests.server.helpers import ServerProcess

DOCS = {
    "lisbon.txt": "the budget was approved in lisbon by the doctor . the river of lisbon is blue .",
    "oslo.txt": "the novel was published in oslo . the company of oslo is headquartered in rome .",
    "madrid.txt": "the project led by the doctor was approved in madrid . the city of madrid is green .",
}
QUESTION = "where was the budget approved ?"


def test_ingested_chunks_are_disk_hits_in_a_fresh_server_on_the_defaults(tiny_model_dir, tmp_path,
                                                                         monkeypatch) -> None:
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    assert main(["ingest", str(folder), "--model", tiny_model_dir, "--retriever", "bm25", "--quiet",
                 "--chunk-tokens", "8"]) == 0
    assert any((tmp_path / "home" / "kv").rglob("*.safetensors"))  # the server's default disk tier
    config = {"retrieval": {"enabled": True, "mode": "bm25"}, "drain_timeout_s": 10}  # no store settings
    server = ServerProcess(tiny_model_dir, tmp_path / "server", config)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"model": tiny_model_dir, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2,
                    "temperature": 0, "retrieval": {"top_k": 3}}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            block = r.json()["kvblend"]
    finally:
        assert server.stop() == 0
    assert block["sources"][0]["source"].endswith("lisbon.txt")
    n = len(block["sources"])
    assert n >= 2 and [d["source"] for d in block["documents"]] == ["disk"] * n, block
    assert block["doc_hits"] == {"disk": n} and block["doc_misses"] == 0


def _no_bos_client(tmp_path) -> TestClient:
    loaded = make_loaded()
    loaded.tokenizer.bos_token = None  # Qwen2.5-like: ChatML template, no BOS token
    assert loaded.tokenizer.bos_token_id is None and loaded.tokenizer.chat_template
    settings = Settings.load(model="tiny", state_dir=str(tmp_path))
    return TestClient(create_app(Engine(loaded), settings))


def test_completions_hit_stored_documents_on_a_model_without_bos(tmp_path) -> None:
    text = DOCS["lisbon.txt"]
    with _no_bos_client(tmp_path) as client:
        assert client.post("/v1/documents", json={"text": text, "id": "lisbon"}).status_code == 200
        plain = {"model": "tiny", "prompt": QUESTION, "documents": [{"id": "lisbon"}], "max_tokens": 2,
                 "temperature": 0}
        r = client.post("/v1/completions", json=plain)
        assert r.status_code == 200, r.text
        assert [d["source"] for d in r.json()["kvblend"]["documents"]] == ["memory"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "documents": [{"id": "lisbon"}],
                "max_tokens": 2, "temperature": 0}
        c = client.post("/v1/chat/completions", json=chat)
        assert [d["source"] for d in c.json()["kvblend"]["documents"]] == ["memory"]
