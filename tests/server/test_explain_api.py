"""``"kvblend": {"explain": true}`` and ``GET /v1/kvblend/store``: the data the playground
page shows, on a real ``kvblend serve`` (tiny model) and on the app in-process for the bounds."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded

DOCS = ["the doctor works in paris . the city of paris is blue . the river was red and the project led to rome . "
        "the budget was approved in lisbon that year and the model of the city was green .",
        "the company led by the doctor is headquartered in rome . the novel was published in oslo that year ."]
QUESTION = "where is the company headquartered ?"
BLEND = {"method": "blend", "ratio": 0.3}


def body(model: str, documents=DOCS, **kvblend) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": QUESTION}], "documents": documents,
            "max_tokens": 4, "temperature": 0, "kvblend": {**BLEND, **kvblend}}


def blend_until_hits(client: httpx.Client | TestClient, payload: dict) -> dict:
    """The first request stores the documents' KV in the background: ask until all hit."""
    for _ in range(50):
        reply = client.post("/v1/chat/completions", json=payload).json()
        if reply["kvblend"]["doc_misses"] == 0:
            return reply
        time.sleep(0.05)
    raise AssertionError(f"the documents never hit: {reply['kvblend']}")


@pytest.fixture
def model_id(alice) -> str:
    return alice.get("/v1/models").json()["data"][0]["id"]


def check_positions(explain: dict, block: dict, n_docs: int) -> None:
    """Every listed token lies inside its prompt document, the kept ones number what the
    stats counted for it, and the prompt documents cover the request's documents in order."""
    (check,) = explain["checks"]
    docs = explain["documents"]
    assert [d["index"] for d in docs] == list(range(len(block["documents"])))
    assert sorted({d["origin"] for d in docs}) == list(range(n_docs))
    for doc, stat in zip(docs, block["documents"]):
        assert doc["n_tokens"] == stat["tokens"] == len(doc["tokens"]) and not doc["truncated"]
        sel, reused = doc["selected"], doc["reused"]
        assert len(sel["positions"]) == doc["kept"] == check["doc_selected"][doc["index"]]
        assert len(sel["scores"]) == len(sel["by"]) == len(sel["positions"])
        every = sel["positions"] + reused["positions"]
        assert len(set(every)) == len(every) and all(0 <= p < doc["n_tokens"] for p in every)
        assert set(doc["deviation"]["positions"]) <= set(every)
    assert sum(check["doc_selected"]) == check["selected"] > 0


@pytest.mark.parametrize("strategy", [{}, {"selection": "deviation", "budget": False, "sinks": 0, "shift": False}])
def test_explain_lists_each_documents_recomputed_tokens(alice, model_id, strategy) -> None:
    payload = body(model_id, explain=True, **strategy)
    block = blend_until_hits(alice, payload)["kvblend"]
    explain = block["explain"]
    check_positions(explain, block, len(DOCS))
    chunked = [d for d in explain["documents"] if d["origin"] == 0]  # documents.chunk_tokens is 32 here
    assert len(chunked) > 1 and [d["offset"] for d in chunked] == [0, *[32 * i for i in range(1, len(chunked))]]
    text = "".join(t for d in chunked for t in d["tokens"])
    assert text.split() == DOCS[0].split()  # the token texts spell the document
    if strategy:  # cacheblend: the layer-1 check chose, and measured every candidate's deviation
        assert explain["selection"] == "deviation" and explain["score"] == "V deviation at layer 1"
        assert {b for d in explain["documents"] for b in d["selected"]["by"]} == {"layer 1"}
    else:
        assert explain["selection"] == "question"
        assert {"sink", "question pass"} <= {b for d in explain["documents"] for b in d["selected"]["by"]}


def test_explain_is_there_only_when_asked_and_streams_once(alice, model_id) -> None:
    plain = blend_until_hits(alice, body(model_id))
    assert "explain" not in plain["kvblend"]
    assert "explain" not in alice.post("/v1/chat/completions", json=body(model_id, explain=False)).json()["kvblend"]
    stream = {**body(model_id, explain=True), "stream": True, "stream_options": {"include_usage": True}}
    with alice.stream("POST", "/v1/chat/completions", json=stream) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    explained = [c for c in chunks if "explain" in (c.get("kvblend") or {})]
    assert len(explained) == 1 and explained[0]["choices"][0]["finish_reason"] is not None
    assert chunks[-1]["usage"] is not None and "explain" not in chunks[-1]["kvblend"]
    check_positions(explained[0]["kvblend"]["explain"], explained[0]["kvblend"], len(DOCS))


def test_explain_of_full_prefill_lists_tokens_but_no_selection(alice, model_id) -> None:
    reply = alice.post("/v1/chat/completions", json=body(model_id, method="full", explain=True)).json()
    explain = reply["kvblend"]["explain"]
    assert explain["checks"] == [] and explain["selection"] is None
    assert all(d["tokens"] and "selected" not in d for d in explain["documents"])


def test_explain_is_the_requesters_own_and_never_logged(server, alice, bob, model_id) -> None:
    secret = "the budget approved in lisbon was green and the novel was published in madrid ."
    assert alice.post("/v1/documents", json={"text": secret, "id": "alice-only"}).status_code == 200
    refused = bob.post("/v1/chat/completions", json=body(model_id, documents=[{"id": "alice-only"}], explain=True))
    assert refused.status_code == 404  # another tenant's stored document cannot be named, nor explained
    mine = alice.post("/v1/chat/completions", json=body(model_id, documents=[{"id": "alice-only"}],
                                                        explain=True)).json()["kvblend"]
    assert mine["documents"][0]["source"] == "memory"
    assert "".join(mine["explain"]["documents"][0]["tokens"]).split() == secret.split()
    bobs = bob.post("/v1/chat/completions", json=body(model_id, documents=[secret], explain=True)).json()["kvblend"]
    assert bobs["documents"][0]["source"] == "chunk"  # the same text is not alice's KV for bob
    log = server.log()
    assert "explain" not in log and "lisbon" not in log and "alice-only" not in log


def test_store_view_is_scoped_to_the_tenant(alice, bob, server) -> None:
    alice.post("/v1/documents", json={"text": DOCS[1], "id": "alice-store-view"})
    mine, theirs = alice.get("/v1/kvblend/store").json(), bob.get("/v1/kvblend/store").json()
    assert mine["object"] == "kvblend.store" and mine["documents"]["count"] >= 1
    assert [t["name"] for t in mine["tiers"]] == ["memory", "redis"]
    memory = mine["tiers"][0]
    assert memory["capacity_bytes"] == 64 * 1024**2 and memory["used_bytes"] >= memory["tenant"]["bytes"] > 0
    assert memory["tenant"]["hit_rate"] is None or 0 <= memory["tenant"]["hit_rate"] <= 1
    assert "alice-store-view" not in json.dumps(theirs)
    assert theirs["tiers"][0]["used_bytes"] == memory["used_bytes"]  # shared occupancy is fine to show
    assert httpx.get(server.url + "/v1/kvblend/store").status_code == 401


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    settings = Settings.load(model="tiny", state_dir=str(tmp_path_factory.mktemp("bounded")),
                             limits={"explain_document_tokens": 10, "explain_total_tokens": 15})
    with TestClient(create_app(Engine(make_loaded(), self_check=False), settings)) as client:
        yield client


def test_explain_is_bounded_per_document_and_in_all(bounded) -> None:
    explain = blend_until_hits(bounded, body("tiny", explain=True))["kvblend"]["explain"]
    shown = [len(d["tokens"]) for d in explain["documents"]]
    assert shown == [10, 5] and explain["truncated"]
    assert explain["limits"] == {"document_tokens": 10, "total_tokens": 15}
    for doc, n in zip(explain["documents"], shown):
        assert doc["truncated"] and doc["n_tokens"] > n
        assert all(p < n for part in ("selected", "reused") for p in doc[part]["positions"])
        assert doc["kept"] >= len(doc["selected"]["positions"])  # the count stays whole


def test_the_page_is_static_self_contained_and_needs_no_key(server) -> None:
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert "http://" not in page.text and "https://" not in page.text
    for asset in ("/playground/playground.js", "/playground/playground.css"):
        r = httpx.get(server.url + asset)
        assert r.status_code == 200 and "https://" not in r.text
