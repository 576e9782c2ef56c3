"""Stored documents found in plain prompts through the API (tiny model, in process): the
``kvblend.matches`` block, chunk-granular matches, the per-request switch, tenants,
deletion, inline documents seen once, and the index rebuilt from the registry at startup."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server.app import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded

KEYS = {"alice-key-1": "alice", "bob-key-22": "bob"}
ALICE, BOB = ({"Authorization": "Bearer alice-key-1"}, {"Authorization": "Bearer bob-key-22"})
DOC = ("the city of paris is blue . the river was red and the project led to rome . "
       "doctor alpha works in lisbon . the company headquartered in oslo was green .")
OTHER = "the novel published in year one was in madrid and the north river . the end"


def client(tmp_path, **documents) -> TestClient:
    settings = Settings.load(model="tiny", state_dir=str(tmp_path), api_keys=KEYS,
                             documents={"chunk_tokens": 12, **documents})
    return TestClient(create_app(Engine(make_loaded()), settings))


def ask(c: TestClient, content: str, headers=ALICE, **extra) -> dict:
    r = c.post("/v1/chat/completions", headers=headers,
               json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}], **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_registered_document_is_found_chunk_by_chunk(tmp_path) -> None:
    with client(tmp_path) as c:
        posted = c.post("/v1/documents", headers=ALICE, json={"text": DOC, "id": "city"}).json()
        assert posted["num_chunks"] > 1
        content = f"context : {DOC} so which city ?"
        body = ask(c, content)
        matches = body["kvblend"]["matches"]
        assert len(matches) == posted["num_chunks"] and {m["document"] for m in matches} == {"city"}
        assert "".join(content[m["start"] : m["end"]] for m in matches).replace(" ", "") == DOC.replace(" ", "")
        assert all(d["source"] == "memory" for d in body["kvblend"]["documents"])  # precomputed when posted
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= sum(m["tokens"] for m in matches)
        assert "matches" not in ask(c, content, kvblend={"match": False})["kvblend"]
        assert "matches" not in ask(c, content, headers=BOB)["kvblend"]  # never another tenant's
        assert c.delete("/v1/documents/city", headers=ALICE).status_code == 200
        assert "matches" not in ask(c, content)["kvblend"]


def test_inline_documents_are_found_later_and_the_index_survives_a_restart(tmp_path) -> None:
    with client(tmp_path) as c:
        ask(c, "which city ?", documents=[OTHER])  # seen once in a documents field
        assert [m["document"] for m in ask(c, f"{OTHER} which city ?")["kvblend"]["matches"]] == [None]  # its first chunk (the second is shorter than an anchor window)
        c.post("/v1/documents", headers=ALICE, json={"text": DOC, "id": "city"})
    with client(tmp_path) as again:  # a new server on the same state: rebuilt from the registry
        found = ask(again, f"{DOC} which city ?")["kvblend"]["matches"]
        assert found and {m["document"] for m in found} == {"city"}
        assert "matches" not in ask(again, f"{OTHER} which city ?")["kvblend"]  # inline ones were not stored


def test_matching_off_in_the_settings(tmp_path) -> None:
    with client(tmp_path, match=False) as c:
        c.post("/v1/documents", headers=ALICE, json={"text": DOC})
        assert "matches" not in ask(c, f"{DOC} which city ?")["kvblend"]


def test_two_servers_on_one_registry_follow_each_others_documents(tmp_path) -> None:
    """Ingress replicas on one host share the registry file: a document posted through one
    is found in the other's prompts without a restart, and stops being found once deleted
    through either (the registry's change log, applied before shaping)."""
    with client(tmp_path) as a, client(tmp_path) as b:
        assert "matches" not in ask(b, f"{DOC} which city ?")["kvblend"]
        assert a.post("/v1/documents", headers=ALICE, json={"text": DOC, "id": "city"}).status_code == 200
        found = ask(b, f"{DOC} which city ?")["kvblend"]["matches"]
        assert found and {m["document"] for m in found} == {"city"}
        assert "matches" not in ask(b, f"{DOC} which city ?", headers=BOB)["kvblend"]  # still per tenant
        assert b.delete("/v1/documents/city", headers=ALICE).status_code == 200
        assert "matches" not in ask(a, f"{DOC} which city ?")["kvblend"]
        assert "matches" not in ask(b, f"{DOC} which city ?")["kvblend"]
        b.post("/v1/documents", headers=ALICE, json={"text": OTHER, "id": "novel"})
        assert [m["document"] for m in ask(a, f"{OTHER} which city ?")["kvblend"]["matches"]] == ["novel"]


def test_a_local_add_does_not_undo_another_processs_delete(tmp_path) -> None:
    """This process stores a document; before it indexes it, another process deletes the
    row: the add is not made (the other's change decides), and catching up changes nothing."""
    from kvblend.server.documents import DocumentRegistry, StoredChunk, new_record
    from kvblend.server.index import open_index, record_texts

    path = tmp_path / "documents.sqlite"
    mine, theirs = DocumentRegistry(path), DocumentRegistry(path)
    loaded = make_loaded()
    feed = open_index(Settings(), mine, loaded.tokenizer)
    ids = tuple(loaded.tokenizer(DOC, add_special_tokens=False)["input_ids"])
    record = new_record("city", DOC, [StoredChunk("c0", "acme/" + "0" * 64, ids)], {})
    mine.put("alice", record)
    theirs.delete("alice", "city")
    feed.stored("alice", "city", record.sha256, record_texts(loaded.tokenizer, record))
    assert feed.index.match("alice", [f"so {DOC}"]) == []
    feed.catch_up()
    assert feed.index.match("alice", [f"so {DOC}"]) == []
    theirs.put("alice", record)
    assert feed.catch_up(limit=1, wait=False) == 1 and {m.document for m in feed.index.match("alice", [DOC])} == {"city"}
    with feed._lock:  # another request is applying changes: this one goes on without waiting
        theirs.delete("alice", "city")
        assert feed.catch_up(wait=False) == 0
    assert feed.catch_up() == 1 and feed.index.match("alice", [DOC]) == []


def test_a_server_follows_another_processs_documents_without_requests(tmp_path) -> None:
    """A bulk upload through another ingress is indexed here in the background (every
    ``FOLLOW_S``), not by the next request here."""
    import time

    with client(tmp_path) as a, client(tmp_path) as b:
        index = b.app.state.kvblend.index
        assert index.count("alice") == 0
        assert a.post("/v1/documents", headers=ALICE, json={"text": DOC, "id": "city"}).status_code == 200
        deadline = time.monotonic() + 10
        while index.count("alice") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert index.count("alice") > 0  # no request was sent to b
