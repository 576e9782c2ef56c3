"""The server's ``retrieval`` field over an index built by the ingest pipeline, per tenant,
and the quality guard composed into the server (shadow checks off the request's path)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.conftest import WORDS
from tests.server.helpers import ADMIN, ALICE, BOB, CAROL, ServerProcess

PLANTED = "the budget was approved in lisbon by the doctor ."
BOB_OWN = "the budget of bob was small ."
QUESTION = "where was the budget approved ?"
_RARE = {"budget", "approved", "lisbon", "doctor", "small"}


def _filler(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = [w for w in WORDS if w.isalpha() and w not in _RARE]
    return [" ".join(rng.choice(vocab, 10)) + " ." for _ in range(n)]


def _ingest(tiny_model_dir: str, folder, tenant: str, docs: list[tuple[str, str]]) -> None:
    import torch

    from kvblend.models.loader import load_model
    from kvblend.rag.chunking import ChunkerConfig
    from kvblend.rag.ingest import IngestConfig, Ingestor
    from kvblend.rag.readers import Document
    from kvblend.rag.retriever import Retriever, RetrieverConfig

    loaded = load_model(tiny_model_dir, "cpu", torch.float32)
    retriever = Retriever(RetrieverConfig(folder, mode="bm25"))
    try:
        config = IngestConfig(ChunkerConfig("tokens", 32), tenant=tenant, dense=False)
        ingestor = Ingestor(retriever, loaded.tokenizer, loaded.tokenizer_fingerprint, config)
        ingestor.ingest_documents([Document(s, t) for s, t in docs], progress=False)
    finally:
        retriever.close()


@pytest.fixture(scope="module")
def rag_server(tiny_model_dir, tmp_path_factory):
    """A server with retrieval over a bm25 index (alice: a planted passage among filler;
    bob: his own passage) and the guard shadow-checking every blended request."""
    work = tmp_path_factory.mktemp("rag-server")
    index = work / "index"
    _ingest(tiny_model_dir, index, "alice",
            [(f"alice-{i}.txt", t) for i, t in enumerate(_filler(12, 0))] + [("alice-planted.txt", PLANTED)])
    _ingest(tiny_model_dir, index, "bob", [(f"bob-{i}.txt", t) for i, t in enumerate(_filler(6, 1))]
            + [("bob-notes.txt", BOB_OWN)])
    config = {"api_keys": {ALICE: "alice", BOB: "bob", CAROL: "carol"}, "admin_key": ADMIN,
              "store": {"tiers": ["memory"], "memory_bytes": "64MiB"},
              "retrieval": {"enabled": True, "index_dir": str(index), "mode": "bm25", "max_top_k": 4},
              "guard": {"enabled": True, "shadow_fraction": 1.0, "min_samples": 2, "window": 4, "min_f1": None},
              "drain_timeout_s": 10}
    proc = ServerProcess(tiny_model_dir, work, config)
    yield proc
    proc.stop()


def _client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _ask(client: httpx.Client, **extra) -> httpx.Response:
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_retrieval_blends_the_callers_own_top_chunks(rag_server) -> None:
    with _client(rag_server, ALICE) as alice, _client(rag_server, BOB) as bob:
        a = _ask(alice, retrieval={"top_k": 2})
        assert a.status_code == 200, a.text
        block = a.json()["kvblend"]
        assert block["sources"][0]["source"] == "alice-planted.txt"
        assert len(block["documents"]) == len(block["sources"]) >= 1  # the hits were what got blended
        b = _ask(bob, retrieval={"top_k": 4})
        assert b.status_code == 200, b.text
        bob_sources = b.json()["kvblend"]["sources"]
        assert bob_sources[0]["source"] == "bob-notes.txt"
        assert not {s["source"] for s in bob_sources} & {"alice-planted.txt"}
        assert not {s["chunk_id"] for s in bob_sources} & {s["chunk_id"] for s in block["sources"]}
        assert all(s["source"].startswith("bob-") for s in bob_sources)
        streamed = _ask(alice, retrieval={"top_k": 2}, stream=True).text
        last = [ln for ln in streamed.splitlines() if '"kvblend"' in ln][-1]
        assert '"alice-planted.txt"' in last and "bob-notes.txt" not in streamed


def test_retrieval_request_bounds(rag_server, alice) -> None:
    with _client(rag_server, ALICE) as client:
        both = _ask(client, retrieval={"top_k": 1}, documents=["the river ."])
        assert both.status_code == 400 and both.json()["error"]["param"] == "retrieval"
        over = _ask(client, retrieval={"top_k": 5})
        assert over.status_code == 400 and over.json()["error"]["param"] == "retrieval.top_k"
        assert _ask(client, retrieval={"top_k": 0}).status_code == 400
        assert _ask(client, retrieval={"top_k": 1, "depth": 3}).status_code == 400
    off = _ask(alice, retrieval={"top_k": 1})  # the shared server has retrieval disabled
    assert off.status_code == 400 and off.json()["error"]["param"] == "retrieval"
    assert "not enabled" in off.json()["error"]["message"]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_checks(server, n: int, timeout_s: float = 90.0) -> str:
    import time

    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as admin:
        while True:
            text = admin.get("/metrics").text
            if _metric(text, "kvblend:shadow_checks_total", outcome="ok") >= n or time.monotonic() > deadline:
                return text
            time.sleep(0.2)


DOCS = ["the river of oslo runs north to the city .", "the company in rome published a novel in year one ."]


def test_guard_shadow_checks_every_blend_without_changing_answers(rag_server, server) -> None:
    """Guard on, shadow fraction 1: each blended request is shadow-checked (metrics, log),
    and every answer equals the guard-off server's answer to the same request.

    Both servers are asked as carol, a tenant no other test uses: whether a blend escalates
    depends on its tenant's earlier risks (``engine.escalation``), so only a tenant with the
    same history on both servers makes their answers comparable (as alice, the shared
    server's many earlier blends once escalated a blend the guard server's did not)."""
    questions = ["where does the river run ?", "who published a novel ?", "where is the company ?"]

    def ask(client: httpx.Client, q: str) -> dict:
        r = _ask(client, documents=DOCS, messages=[{"role": "user", "content": q}], kvblend={"method": "auto"})
        assert r.status_code == 200, r.text
        return r.json()

    def answer(body: dict) -> tuple[str, bool]:
        return body["choices"][0]["message"]["content"], body["kvblend"].get("escalated", False)

    # stored synchronously on both servers: every request below hits, so no answer depends on
    # whether a background write-back finished before it (the shared server's copies are
    # deleted at the end)
    with _client(server, CAROL) as shared:
        stored = [shared.post("/v1/documents", json={"text": doc}).json()["id"] for doc in DOCS]
        with _client(rag_server, CAROL) as client:
            for doc in DOCS:
                assert client.post("/v1/documents", json={"text": doc}).status_code == 200
            bodies = [ask(client, q) for q in questions]
            assert all(b["kvblend"]["method"] == "blend" for b in bodies)  # auto routed to blend by the guard
            guarded = [answer(b) for b in bodies]
            text = _wait_checks(rag_server, len(questions))
            # after the shadow checks ran, the same requests still get the same answers
            again = [answer(ask(client, q)) for q in questions]
        plain = [answer(ask(shared, q)) for q in questions]
        for doc_id in stored:
            assert shared.delete(f"/v1/documents/{doc_id}").json()["deleted"] is True
    # after the checks the same requests get the answers they got before (a repeat is served
    # its first blend whole; the guard-off server's repeat is the same replay, whose last
    # prompt token is computed by another attention path: on this random tiny model a near
    # tie in a later token may then go the other way, so the servers are compared once)
    assert guarded == plain and again == guarded
    assert _metric(text, "kvblend:shadow_checks_total", outcome="ok") >= len(questions)
    assert _metric(text, "kvblend:shadow_agreement_f1_count") >= len(questions)
    assert _metric(text, "kvblend:guard_fallbacks_total") == 0
    assert "tenant" not in "".join(ln for ln in text.splitlines() if "shadow" in ln or "guard" in ln)
    assert '"shadow": true' in rag_server.log()


def test_the_search_takes_the_end_of_a_long_message_and_names_a_message_without_text() -> None:
    """A last user message over the search's 8192 characters was a 400 naming `retrieval`
    ("the query must be ... at most 8192 characters"), as if the option were wrong."""
    from kvblend.rag.retriever import MAX_QUERY_CHARS
    from kvblend.server.errors import APIError
    from kvblend.server.protocol import ChatCompletionRequest, CompletionRequest
    from kvblend.server.retrieval import query_text

    def chat(*texts: str) -> ChatCompletionRequest:
        return ChatCompletionRequest(model="m", retrieval={"top_k": 1},
                                     messages=[{"role": "user", "content": t} for t in texts])

    long = "context " * 2000 + "where does the river of oslo run ?"
    query = query_text(chat(long))
    assert len(query) == MAX_QUERY_CHARS and query.endswith("where does the river of oslo run ?")
    assert query_text(chat("who ?", "what ?")) == "what ?"
    assert query_text(chat("where ?" + " " * 9000)) == "where ?"  # trimmed before the cut
    with pytest.raises(APIError) as blank:
        query_text(chat("who ?", "   "))
    assert blank.value.param == "messages.1.content" and "no text" in str(blank.value)
    with pytest.raises(APIError) as empty:
        query_text(CompletionRequest(model="m", prompt="", retrieval={"top_k": 1}))
    assert empty.value.param == "prompt"


def test_serving_with_no_index_creates_none_and_finds_what_a_later_ingest_writes(tmp_path, monkeypatch) -> None:
    """``kvblend serve`` with retrieval on created an empty index folder
    (``$KVBLEND_HOME/rag/<tokenizer>``, its catalog) at startup, before anything was
    ingested. Now nothing is written there: a search finds nothing, as over an empty index,
    until an ingest (another process) writes the index, which the next request then reads."""
    from starlette.testclient import TestClient

    from kvblend.engine import Engine
    from kvblend.rag.chunking import ChunkerConfig
    from kvblend.rag.ingest import IngestConfig, Ingestor
    from kvblend.rag.readers import Document
    from kvblend.rag.retriever import Retriever, RetrieverConfig, default_index_dir
    from kvblend.server import create_app
    from kvblend.settings import Settings
    from tests.conftest import make_loaded

    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    loaded = make_loaded()
    folder = default_index_dir(loaded.tokenizer_fingerprint)
    settings = Settings.load(model="tiny", state_dir=str(tmp_path / "state"),
                             retrieval={"enabled": True, "mode": "bm25"})
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2,
            "retrieval": {"top_k": 2}}
    with TestClient(create_app(Engine(loaded), settings)) as client:
        before = client.post("/v1/chat/completions", json=body)
        assert before.status_code == 200, before.text
        assert before.json()["kvblend"]["sources"] == [] and before.json()["kvblend"]["documents"] == []
        assert not folder.parent.exists(), sorted(folder.parent.rglob("*"))
        writer = Retriever(RetrieverConfig(folder, mode="bm25"))  # what `kvblend ingest` does
        try:
            config = IngestConfig(ChunkerConfig("tokens", 32), dense=False)
            Ingestor(writer, loaded.tokenizer, loaded.tokenizer_fingerprint, config).ingest_documents(
                [Document("planted.txt", PLANTED)], progress=False)
        finally:
            writer.close()
        after = client.post("/v1/chat/completions", json=body)
        assert after.status_code == 200, after.text
        assert [s["source"] for s in after.json()["kvblend"]["sources"]] == ["planted.txt"]
