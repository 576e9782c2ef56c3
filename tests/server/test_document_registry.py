"""The document registry off the event loop: which chunk keys are still in use is read
from the key index (never the tenant's rows), a DELETE among 10 000 documents is quick,
registry calls never stall other requests, and POST's check-then-put is atomic per id."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.server.documents import DocumentRegistry, KeyedLocks, RegistryFullError, StoredChunk, new_record
from kvblend.settings import Settings
from kvblend.store.keys import ChunkKey
from tests.conftest import make_loaded

SLOW_S = 0.4
# a registry call's time in the stall test: a blocked loop would make another request wait
# about 3/4 of it, well above the 1/2 allowed, while a busy 2-core host's scheduling noise
# (0.59 s once, with SLOW_S) stays under it
STALL_S = 1.2
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "who is the doctor ?"}], "max_tokens": 2}


def key(n: int, tenant: str = "default") -> str:
    return f"{tenant}/{hashlib.sha256(str(n).encode()).hexdigest()}"


def record(doc_id: str, keys: list[str]):
    return new_record(doc_id, "x", [StoredChunk(f"{doc_id}-{i}", k, (1, 2, 3)) for i, k in enumerate(keys)], {})


def fill(reg: DocumentRegistry, n: int, tenant: str = "default") -> None:
    """``n`` documents of two chunks each: document i has keys i and i + 1 (shared with i + 1)."""
    for i in range(n):
        reg.put(tenant, record(f"doc-{i:05d}", [key(i, tenant), key(i + 1, tenant)]))


def tables_read(reg: DocumentRegistry, call) -> set[str]:
    """The tables whose columns SQLite reads while ``call()`` runs."""
    seen: set[str] = set()

    def authorize(action, table, column, db, trigger):
        if action == sqlite3.SQLITE_READ:
            seen.add(table)
        return sqlite3.SQLITE_OK

    reg._db.set_authorizer(authorize)
    try:
        call()
    finally:
        reg._db.set_authorizer(None)
    return seen


def test_keys_in_use_reads_the_key_index_not_the_document_rows(tmp_path) -> None:
    reg = DocumentRegistry(tmp_path / "documents.sqlite")
    fill(reg, 50)
    fill(reg, 3, tenant="bob")
    reg.put("default", record("twin", [key(0)]))
    got: dict[str, set[str]] = {}
    read = tables_read(reg, lambda: got.update(used=reg.keys_in_use("default", [key(0), key(1), key(60)], "doc-00000")))
    assert "documents" not in read and "chunk_keys" in read
    assert got["used"] == {key(0), key(1)}  # 0: the twin; 1: doc-00001; 60: nobody
    assert reg.keys_in_use("default", [key(0)], "twin") == {key(0)}
    assert reg.keys_in_use("default", [key(0, "bob")], "none") == set()  # another tenant's key
    assert reg.keys_in_use("default", [key(i) for i in range(1200)], "none") == {key(i) for i in range(51)}
    reg.delete("default", "twin")
    assert reg.keys_in_use("default", [key(0)], "doc-00000") == set()  # the index follows deletes
    reg.put("default", record("doc-00001", [key(500)]))  # and replacements
    assert reg.keys_in_use("default", [key(1), key(2)], "doc-00000") == {key(2)}
    reg.close()


def test_a_registry_written_before_the_key_index_is_indexed_when_opened(tmp_path) -> None:
    path = tmp_path / "documents.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE documents (tenant TEXT NOT NULL, id TEXT NOT NULL, sha256 TEXT NOT NULL, "
               "text TEXT NOT NULL, tokens INTEGER NOT NULL, chunk_key TEXT NOT NULL, metadata TEXT NOT NULL, "
               "created REAL NOT NULL, chunks TEXT NOT NULL DEFAULT '[]', PRIMARY KEY (tenant, id))")
    chunks = json.dumps([{"id": "c0", "key": key(1), "ids": [1]}, {"id": "c1", "key": key(2), "ids": [2]}])
    db.execute("INSERT INTO documents VALUES ('default', 'a', 'h', 't', 2, ?, '{}', 1.0, ?)", (key(1), chunks))
    db.execute("INSERT INTO documents VALUES ('default', 'old', 'h', 't', 2, ?, '{}', 1.0, '[]')", (key(3),))
    db.commit()
    db.close()
    reg = DocumentRegistry(path)
    assert reg.keys_in_use("default", [key(1), key(2), key(3)], "none") == {key(1), key(2), key(3)}
    assert reg.keys_in_use("default", [key(1), key(2), key(3)], "a") == {key(3)}
    reg.close()
    assert DocumentRegistry(path).keys_in_use("default", [key(2)], "old") == {key(2)}  # indexed once, kept


def test_put_refuses_a_new_id_past_the_limit_in_its_transaction(tmp_path) -> None:
    reg = DocumentRegistry(None)
    reg.put("t", record("a", [key(1, "t")]), limit=1)
    with pytest.raises(RegistryFullError):
        reg.put("t", record("b", [key(2, "t")]), limit=1)
    reg.put("t", record("a", [key(3, "t")]), limit=1)  # replacing an id is not a new document
    assert reg.count("t") == 1 and reg.keys_in_use("t", [key(2, "t"), key(3, "t")], "none") == {key(3, "t")}
    reg.put("u", record("b", [key(2, "u")]), limit=1)  # limits are per tenant


def test_keyed_locks_serialize_one_key_and_forget_it_after() -> None:
    async def run() -> list[str]:
        locks, order = KeyedLocks(), []

        async def hold(k: str, name: str) -> None:
            async with locks.hold(k):
                order.append(f"{name}+")
                await asyncio.sleep(0.01)
                order.append(f"{name}-")

        await asyncio.gather(hold("a", "1"), hold("a", "2"), hold("b", "3"))
        assert len(locks) == 0
        return order

    order = asyncio.run(run())
    assert order.index("1-") < order.index("2+")  # one holder of "a" at a time
    assert order.index("3+") < order.index("1-")  # "b" did not wait for "a"


# ----- the app ------------------------------------------------------------------------------
def app_client(tmp_path: Path, **settings):
    app = create_app(Engine(make_loaded()), Settings.load(model="tiny", state_dir=str(tmp_path), **settings))
    return TestClient(app), app.state.kvblend


def test_delete_among_10000_documents_is_quick(tmp_path) -> None:
    reg = DocumentRegistry(tmp_path / "documents.sqlite")
    t = time.perf_counter()
    for i in range(10_000):
        reg.put("default", record(f"doc-{i:05d}", [key(2 * i), key(2 * i + 1)]))
    built = time.perf_counter() - t
    reg.close()
    client, state = app_client(tmp_path)
    with client:
        reg = state.registry
        timings = []
        for i in range(0, 10_000, 1000):
            t = time.perf_counter()
            r = client.delete(f"/v1/documents/doc-{i:05d}")
            timings.append(time.perf_counter() - t)
            assert r.status_code == 200 and r.json()["deleted"] is True
        read = tables_read(reg, lambda: reg.keys_in_use("default", [key(3), key(5)], "doc-00001"))
        assert reg.count("default") == 9_990 and "documents" not in read
    timings.sort()
    print(f"\n10 000 documents (built in {built:.1f} s): DELETE median {timings[5] * 1e3:.1f} ms, "
          f"max {timings[-1] * 1e3:.1f} ms")
    assert timings[5] < 0.25  # ≤ 50 ms on a quiet machine; generous for a shared one


class SlowRegistry:
    """A registry whose every call takes ``STALL_S`` seconds and notes whether it ran on a
    thread with a running event loop."""

    def __init__(self, inner: DocumentRegistry) -> None:
        self.inner, self.on_loop, self.calls = inner, [], 0

    def __getattr__(self, name: str):
        fn = getattr(self.inner, name)

        def slow(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                self.on_loop.append(name)
            except RuntimeError:
                pass
            self.calls += 1
            time.sleep(STALL_S)
            return fn(*args, **kwargs)

        return slow


@pytest.mark.parametrize("route", ["delete", "get", "list", "post", "chat-by-id"])
def test_a_slow_registry_never_stalls_other_requests(tmp_path, route) -> None:
    client, state = app_client(tmp_path)
    with client:
        assert client.post("/v1/documents", json={"id": "d1", "text": "the doctor works in paris ."}).status_code == 200
        slow = state.registry = SlowRegistry(state.registry)
        call = {
            "delete": lambda: client.delete("/v1/documents/d1"),
            "get": lambda: client.get("/v1/documents/d1"),
            "list": lambda: client.get("/v1/documents"),
            "post": lambda: client.post("/v1/documents", json={"id": "d2", "text": "the nurse works in rome ."}),
            "chat-by-id": lambda: client.post("/v1/chat/completions", json={**CHAT, "documents": [{"id": "d1"}]}),
        }[route]
        with ThreadPoolExecutor(1) as pool:
            started = time.perf_counter()
            pending = pool.submit(call)
            time.sleep(STALL_S / 4)
            t = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            waited = time.perf_counter() - t
            assert pending.result().status_code == 200
            took = time.perf_counter() - started
    assert slow.calls >= 1 and slow.on_loop == []
    assert took >= STALL_S and waited < STALL_S / 2, (took, waited)


def _racing(client: TestClient, bodies: list[dict]) -> list:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: client.post("/v1/documents", json=b), bodies))


def _slow_warm(state, monkeypatch) -> list[list[ChunkKey]]:
    """``engine.plan_warm`` (the POST's first step: cut and key the text) slowed so that
    concurrent POSTs overlap; returns the keys each call planned to warm."""
    real, warmed = state.engine.plan_warm, []

    def plan_warm(*args, **kwargs):
        time.sleep(SLOW_S)
        plan = real(*args, **kwargs)
        warmed.append(plan.keys)
        return plan

    monkeypatch.setattr(state.engine, "plan_warm", plan_warm)
    return warmed


def test_two_posts_of_one_id_with_other_texts_one_wins_one_gets_409(tmp_path, monkeypatch) -> None:
    client, state = app_client(tmp_path)
    with client:
        warmed = _slow_warm(state, monkeypatch)
        texts = ["the doctor works in paris .", "the nurse lives in rome ."]
        replies = _racing(client, [{"id": "same", "text": t} for t in texts])
        assert sorted(r.status_code for r in replies) == [200, 409], [r.text for r in replies]
        winner = texts[[r.status_code for r in replies].index(200)]
        stored = state.registry.get("default", "same")
        assert stored.text == winner
        for keys in warmed:  # no KV is left that no document names
            for k in keys:
                assert state.engine.store.contains(k) == (str(k) in stored.keys)


def test_two_new_documents_racing_for_the_last_slot_one_gets_400(tmp_path, monkeypatch) -> None:
    client, state = app_client(tmp_path, limits={"max_stored_documents": 1})
    with client:
        warmed = _slow_warm(state, monkeypatch)
        replies = _racing(client, [{"id": "a", "text": "the doctor works in paris ."},
                                   {"id": "b", "text": "the nurse lives in rome ."}])
        assert sorted(r.status_code for r in replies) == [200, 400], [r.text for r in replies]
        assert state.registry.count("default") == 1
        kept = (state.registry.get("default", "a") or state.registry.get("default", "b")).keys
        assert len(warmed) == 2
        for keys in warmed:  # the refused document's KV was dropped
            for k in keys:
                assert state.engine.store.contains(k) == (str(k) in kept)


def test_the_change_log_tells_other_processes_what_changed_and_prunes_itself(tmp_path, monkeypatch) -> None:
    from kvblend.server import documents

    path = tmp_path / "documents.sqlite"
    mine, theirs = DocumentRegistry(path), DocumentRegistry(path)  # two processes on one file
    start = theirs.last_change()
    mine.put("acme", new_record("a", "alpha text", [StoredChunk("c0", key(0), (1, 2, 3))], {}))
    mine.put("acme", new_record("b", "beta text", [StoredChunk("c0", key(0), (1, 2, 3))], {}))
    theirs.put("zen", new_record("z", "zeta text", [StoredChunk("c0", key(0), (1, 2, 3))], {}))
    assert mine.delete("acme", "a") and not mine.delete("acme", "nope")  # a missed delete logs nothing
    changes, last = theirs.changes_since(start)
    assert changes == [("acme", "a"), ("acme", "b"), ("acme", "a")] and last == theirs.last_change()
    assert mine.changes_since(start) == ([("zen", "z")], last)  # its own changes left out
    assert theirs.changes_since(last) == ([], last)
    monkeypatch.setattr(documents, "KEEP_CHANGES", 2)
    for i in range(4):
        mine.put("acme", new_record(f"p{i}", f"text {i}", [StoredChunk("c0", key(0), (1, 2, 3))], {}))
    assert theirs.changes_since(last) is None  # pruned past it: start again from the rows
    assert theirs.changes_since(theirs.last_change() - 1) == ([("acme", "p3")], theirs.last_change())


def test_an_index_too_far_behind_the_log_is_rebuilt_from_the_rows(tmp_path, monkeypatch) -> None:
    from kvblend.server import documents
    from kvblend.server.index import open_index

    settings = Settings(state_dir=str(tmp_path))
    path = tmp_path / "documents.sqlite"
    writer, reader = DocumentRegistry(path), DocumentRegistry(path)
    tokenizer = make_loaded().tokenizer
    text = "the company headquartered in oslo was green and the river was red ."
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    feed = open_index(settings, reader, tokenizer)
    monkeypatch.setattr(documents, "KEEP_CHANGES", 1)
    writer.put("acme", new_record("gone", text, [StoredChunk("c0", key(1), ids)], {}))
    assert writer.delete("acme", "gone")
    writer.put("acme", new_record("kept", text, [StoredChunk("c0", key(1), ids)], {}))
    assert feed.catch_up() == -1  # the log kept only the last change: rebuilt
    assert {m.document for m in feed.index.match("acme", [f"so {text} where ?"])} == {"kept"}
    assert feed.catch_up() == 0 and feed.seq == reader.last_change()


def test_a_post_racing_another_process_for_one_id_gets_409_and_leaves_its_row(tmp_path, monkeypatch) -> None:
    """Two ingress processes share the registry file; the in-process lock cannot order them,
    so the put checks in its transaction that the row is still what the POST saw."""
    client, state = app_client(tmp_path)
    other = DocumentRegistry(tmp_path / "documents.sqlite")  # the second process
    theirs = new_record("same", "the nurse lives in rome .", [StoredChunk("c0", key(7), (1, 2, 3))], {})
    real_count = state.registry.count

    def count_while_the_other_stores(tenant: str) -> int:  # between this POST's read and its put
        other.put(tenant, theirs)
        return real_count(tenant)

    with client:
        warmed = _slow_warm(state, monkeypatch)
        monkeypatch.setattr(state.registry, "count", count_while_the_other_stores)
        reply = client.post("/v1/documents", json={"id": "same", "text": "the doctor works in paris ."})
        assert reply.status_code == 409, reply.text
        assert state.registry.get("default", "same").text == theirs.text
        (keys,) = warmed
        assert keys and not any(state.engine.store.contains(k) for k in keys)  # the loser's KV was dropped


def test_a_post_racing_another_process_storing_the_same_text_succeeds(tmp_path, monkeypatch) -> None:
    """A client retrying through another ingress stores the same text: no conflict (the POST
    is idempotent), and the row is the one text."""
    client, state = app_client(tmp_path)
    other = DocumentRegistry(tmp_path / "documents.sqlite")
    text = "the doctor works in paris ."
    real_count = state.registry.count

    def count_while_the_other_stores(tenant: str) -> int:
        other.put(tenant, new_record("same", text, [StoredChunk("c0", key(8), (1, 2, 3))], {}))
        return real_count(tenant)

    with client:
        monkeypatch.setattr(state.registry, "count", count_while_the_other_stores)
        reply = client.post("/v1/documents", json={"id": "same", "text": text})
        assert reply.status_code == 200, reply.text
        assert state.registry.get("default", "same").text == text


def test_the_change_log_reader_sees_gaps_and_a_replaced_file_and_the_own_set_stays_bounded(tmp_path, monkeypatch):
    from kvblend.server import documents

    path = tmp_path / "documents.sqlite"
    mine, theirs = DocumentRegistry(path), DocumentRegistry(path)
    row = lambda i: new_record(f"d{i}", f"text {i}", [StoredChunk("c0", key(0), (1, 2, 3))], {})  # noqa: E731
    for i in range(3):
        mine.put("acme", row(i))
    assert theirs.changes_since(10) is None  # the log ends before the reader's place: another file
    monkeypatch.setattr(documents, "KEEP_CHANGES", 2)
    for i in range(3, 9):
        mine.put("acme", row(i))
    assert len(mine._own) <= 3  # nobody reads the log here: what it pruned is forgotten
    last = mine.last_change()
    assert theirs.changes_since(last - 3) is None  # the log keeps the last two: a gap after last - 3
    assert theirs.changes_since(last - 2) == ([("acme", "d7"), ("acme", "d8")], last)


def test_a_tenants_totals_are_exact_for_any_number_of_documents_and_kept_by_any_writer(tmp_path) -> None:
    """The store view summed tokens and chunks over a tenant's first 1000 documents; the
    registry now keeps each tenant's totals (triggers: a replaced row is taken out first,
    whoever writes the file), and a registry from before them is totalled once when opened."""
    from kvblend.server.storeview import documents_summary

    path = tmp_path / "documents.sqlite"
    reg = DocumentRegistry(path)
    for i in range(1200):
        reg.put("acme", new_record(f"d{i:04d}", f"text {i}", [StoredChunk("c0", key(i), (1, 2, 3)),
                                                              StoredChunk("c1", key(i + 5000), (4,))], {}))
    reg.put("acme", new_record("d0000", "text 0", [StoredChunk("c0", key(0), (1, 2))], {}))  # replaced: 3 -> 2 tokens
    reg.put("zen", new_record("z", "zeta", [StoredChunk("c0", key(1, "zen"), (1,))], {}))
    assert reg.delete("acme", "d0001")
    expected = {"count": 1199, "tokens": 1198 * 4 + 2, "chunks": 1198 * 2 + 1, "summed_over": 1199}
    assert documents_summary(reg, "acme") == expected
    assert reg.totals("zen") == (1, 1, 1) and reg.totals("nobody") == (0, 0, 0)
    # another writer (raw SQL, as an older kvblend would) keeps them too
    reg._db.execute("INSERT OR REPLACE INTO documents (tenant, id, sha256, text, tokens, chunk_key, metadata, created, chunks)"
                    " VALUES ('zen', 'z', 's', 'zeta', 7, 'k', '{}', 0, '[]')")
    assert reg.totals("zen") == (1, 7, 1)
    reg.close()
    # a registry from before the totals: filled once when opened
    raw = sqlite3.connect(path)
    raw.execute("DROP TABLE tenant_totals")
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()
    assert documents_summary(DocumentRegistry(path), "acme") == expected


def test_a_deletion_tells_the_other_stores_which_chunk_keys_it_freed(tmp_path, caplog) -> None:
    """The hooks replicas follow (``ServerState.purge``/``revive``, set by the Ray Serve
    ingress): the keys no other document uses, once they left this app's store, and a
    stored document's keys; a failing hook does not fail the DELETE."""
    client, state = app_client(tmp_path, documents={"chunk_tokens": 4})
    told: list[list[str]] = []
    revived: list[list[str]] = []
    state.purge, state.revive = told.append, revived.append
    with client:
        shared_text = "the doctor works in paris ."
        assert client.post("/v1/documents", json={"id": "a", "text": shared_text + " the river"}).status_code == 200
        assert client.post("/v1/documents", json={"id": "b", "text": shared_text}).status_code == 200
        a_keys, b_keys = (state.registry.get("default", doc).keys for doc in ("a", "b"))
        assert revived == [a_keys, b_keys]  # a stored document's keys are kept wherever they were deleted
        assert client.delete("/v1/documents/a").status_code == 200
        assert told == [[k for k in a_keys if k not in b_keys]] and told[0]  # b's chunks stay in use

        def broken(keys: list[str]) -> None:
            raise RuntimeError("actor gone")

        state.purge = broken
        assert client.delete("/v1/documents/b").status_code == 200
        assert client.get("/v1/documents/b").status_code == 404
    assert any("could not tell the other replicas" in r.getMessage() for r in caplog.records)
