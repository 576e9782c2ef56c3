"""``POST /v1/documents`` cuts a long document with the ``kvblend.rag`` chunker (32-token
windows on the shared server): each chunk's KV is stored, a request naming the document
expands to its chunks and hits each, and delete removes every chunk's KV."""

from __future__ import annotations

import json
import sqlite3

from kvblend.server.documents import DocumentRegistry, StoredChunk, new_record

# 68 words of the tiny model's word-level vocabulary: chunks of 32, 32 and 4 tokens
TEXT = ("the doctor works in paris . the city of paris is blue . "
        "the company led by the doctor is headquartered in rome . "
        "the river of oslo is green . the novel was published in madrid . "
        "the novel about the river of oslo was published by the company in the year two . "
        "the doctor works in rome . the city of madrid is green .")
QUESTION = "where is the company headquartered ?"


def _chat(model: str, documents: list, question: str = QUESTION) -> dict:
    """A chat over ``documents``; another ``question`` than an earlier request's makes the store
    serve the documents again (the same prompt whole is served the earlier blend's KV)."""
    return {"model": model, "messages": [{"role": "user", "content": question}], "documents": documents,
            "max_tokens": 2, "temperature": 0, "kvblend": {"method": "blend"}}


def _chunk_texts(text: str, size: int) -> list[str]:
    words = text.split()
    return [" ".join(words[i:i + size]) for i in range(0, len(words), size)]


def test_long_document_is_chunked_hit_by_id_and_deleted_everywhere(alice, bob) -> None:
    model = alice.get("/v1/models").json()["data"][0]["id"]
    posted = alice.post("/v1/documents", json={"text": TEXT, "id": "long-doc"})
    assert posted.status_code == 200, posted.text
    doc = posted.json()
    assert doc["tokens"] == 68 and doc["num_chunks"] == 3 and doc["tier"] == "memory"
    assert alice.post("/v1/documents", json={"text": TEXT, "id": "long-doc"}).json() == doc  # idempotent
    detail = alice.get("/v1/documents/long-doc").json()
    assert [c["tokens"] for c in detail["chunks"]] == [32, 32, 4] and detail["tiers"][0] == "memory"
    assert len({c["id"] for c in detail["chunks"]}) == 3
    listed = {d["id"]: d for d in alice.get("/v1/documents").json()["data"]}
    assert listed["long-doc"]["num_chunks"] == 3
    assert bob.get("/v1/documents/long-doc").status_code == 404  # tenant-scoped

    r = alice.post("/v1/chat/completions", json=_chat(model, [{"id": "long-doc"}])).json()
    docs = r["kvblend"]["documents"]
    assert [d["tokens"] for d in docs] == [32, 32, 4]
    assert all(d["source"] == "memory" for d in docs), docs
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 68
    # the chunks' texts sent inline are the same token windows: they hit too (before delete)
    inline = alice.post("/v1/chat/completions", json=_chat(model, _chunk_texts(TEXT, 32), "who ?")).json()
    assert [d["source"] for d in inline["kvblend"]["documents"]] == ["memory"] * 3
    # the whole text sent inline is cut the same way: the same prompt as by id, so served whole
    # the blend that answered it (every document inside the cached prompt)
    whole = alice.post("/v1/chat/completions", json=_chat(model, [TEXT])).json()
    assert [(d["tokens"], d["source"]) for d in whole["kvblend"]["documents"]] == [(32, "prefix"), (32, "prefix"),
                                                                                  (4, "prefix")]
    assert whole["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
    assert whole["choices"][0]["message"]["content"] == r["choices"][0]["message"]["content"]

    twin = alice.post("/v1/documents", json={"text": TEXT}).json()  # the same chunks under another id
    assert twin["id"] != "long-doc" and twin["num_chunks"] == 3
    assert alice.delete("/v1/documents/long-doc").json()["deleted"] is True
    assert alice.post("/v1/chat/completions", json=_chat(model, [{"id": "long-doc"}])).status_code == 404
    kept = alice.post("/v1/chat/completions", json=_chat(model, [{"id": twin["id"]}], "what ?")).json()
    assert [d["source"] for d in kept["kvblend"]["documents"]] == ["memory"] * 3  # the twin still uses them
    assert alice.delete(f"/v1/documents/{twin['id']}").json()["deleted"] is True
    after = alice.post("/v1/chat/completions", json=_chat(model, _chunk_texts(TEXT, 32), "where ?")).json()
    assert all(d["source"] != "memory" and d["source"] != "redis" for d in after["kvblend"]["documents"])


def test_registry_reads_rows_written_before_chunking(tmp_path) -> None:
    path = tmp_path / "documents.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE documents (tenant TEXT NOT NULL, id TEXT NOT NULL, sha256 TEXT NOT NULL, "
               "text TEXT NOT NULL, tokens INTEGER NOT NULL, chunk_key TEXT NOT NULL, metadata TEXT NOT NULL, "
               "created REAL NOT NULL, PRIMARY KEY (tenant, id))")
    db.execute("INSERT INTO documents VALUES ('t', 'old', 'h', 'a b', 2, 'key-old', ?, 1.0)", (json.dumps({}),))
    db.commit()
    db.close()
    reg = DocumentRegistry(path)
    old = reg.get("t", "old")
    assert old.chunks == () and old.keys == ["key-old"] and old.public()["num_chunks"] == 1
    new = new_record("new", "a b c", [StoredChunk("c1", "k1", (1, 2)), StoredChunk("c2", "k2", (3,))], {})
    reg.put("t", new)
    got = reg.get("t", "new")
    assert got.tokens == 3 and got.keys == ["k1", "k2"] and got.chunks[1].token_ids == (3,)
    assert reg.get("u", "new") is None
    reg.close()
