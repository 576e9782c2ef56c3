"""Tenant isolation through the API: B cannot hit, list, delete or learn the length of
A's documents or prefixes, and nothing B receives names A's documents."""

from __future__ import annotations

import pytest


SECRET = "the budget of project alpha was approved by the doctor in lisbon ."


@pytest.fixture
def model_id(alice):
    return alice.get("/v1/models").json()["data"][0]["id"]


def ask(client, model_id, documents, **extra):
    body = {"model": model_id, "messages": [{"role": "user", "content": "who approved the budget ?"}],
            "documents": documents, "max_tokens": 2, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_documents_are_invisible_to_other_tenants(alice, bob, model_id) -> None:
    doc = alice.post("/v1/documents", json={"text": SECRET, "id": "alpha-budget"}).json()
    assert doc["tokens"] > 0
    assert "alpha-budget" not in {d["id"] for d in bob.get("/v1/documents").json()["data"]}
    missing = bob.get("/v1/documents/never-existed").json()
    foreign = bob.get("/v1/documents/alpha-budget")
    assert foreign.status_code == 404
    # the answer is the same as for an id nobody has: no length, no tier, no existence
    assert foreign.json()["error"]["message"].replace("alpha-budget", "X") == \
        missing["error"]["message"].replace("never-existed", "X")
    assert bob.delete("/v1/documents/alpha-budget").status_code == 404
    by_id = ask(bob, model_id, [{"id": "alpha-budget"}])
    assert by_id.status_code == 404 and "budget" not in by_id.json()["error"]["message"].replace("alpha-budget", "")
    # B sending A's text inline computes it afresh: A's KV is never reused for B
    inline = ask(bob, model_id, [SECRET]).json()
    assert inline["kvblend"]["documents"][0]["source"] == "chunk"
    assert inline["kvblend"]["doc_hits"] == {}
    # A's document is still there and still hits for A
    assert alice.get("/v1/documents/alpha-budget").status_code == 200
    mine = ask(alice, model_id, [{"id": "alpha-budget"}]).json()
    assert mine["kvblend"]["documents"][0]["source"] == "memory"
    # B's own copy of the same text is B's, under the same id without clashing
    assert bob.post("/v1/documents", json={"text": SECRET, "id": "alpha-budget"}).status_code == 200
    bob.delete("/v1/documents/alpha-budget")
    assert alice.get("/v1/documents/alpha-budget").status_code == 200
    alice.delete("/v1/documents/alpha-budget")


def test_prefixes_are_not_shared_across_tenants(alice, bob, model_id) -> None:
    long_system = "the budget of project alpha was approved by the doctor in lisbon . " * 6
    body = {"messages": [{"role": "system", "content": long_system},
                         {"role": "user", "content": "who approved it ?"}], "kvblend": {"method": "prefix"}}
    first = ask(alice, model_id, [], **body).json()
    again = ask(alice, model_id, [], **body).json()
    assert again["kvblend"]["prefix_hit_tokens"] > 60  # A's own prefix is reused
    probe = ask(bob, model_id, [], **body).json()
    # at most the few template tokens B itself sent before (never A's system prompt)
    assert probe["kvblend"]["prefix_hit_tokens"] <= 4
    assert probe["usage"]["prompt_tokens_details"]["cached_tokens"] <= 4
    assert first["usage"]["prompt_tokens"] == probe["usage"]["prompt_tokens"]
