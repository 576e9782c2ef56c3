"""Deleted documents leave every replica's own tiers (``cluster.purge``), without Ray:
the log's numbering and window, and a follower deleting from memory and disk only."""

from __future__ import annotations

from kvblend.cluster.purge import PurgeFollower, PurgeLog, delete_local
from kvblend.store.config import StoreConfig, build_store
from tests.store.conftest import redis_prefix, redis_server  # noqa: F401 - the Redis fixtures
from tests.store.helpers import keyed


def test_the_log_answers_what_came_after_a_number_within_its_window() -> None:
    log = PurgeLog(keep=3)
    assert log.since(0) == ([], 0)
    assert log.add(["t/a", "t/b"]) == 2
    assert log.since(0) == (["t/a", "t/b"], 2) and log.since(1) == (["t/b"], 2) and log.since(2) == ([], 2)
    log.add(["t/c", "t/d"])  # "t/a" falls out of the window
    assert log.since(0) == (["t/b", "t/c", "t/d"], 4) and log.since(3) == (["t/d"], 4)
    assert log.since(9) == ([], 4)  # a reader ahead of a new log (the cluster restarted) starts over at its end


def test_a_follower_deletes_the_logged_keys_from_its_memory_and_disk_tiers_only(tmp_path) -> None:
    store = build_store(StoreConfig(tiers=("memory", "disk"), disk_dir=str(tmp_path)))
    gone, kept, other = keyed(1, tenant="acme"), keyed(2, tenant="acme"), keyed(1, tenant="bob")
    for key, chunk in (gone, kept, other):
        store.put(key, chunk)
    assert [t.name for t in store.tiers if t.contains(gone[0])] == ["memory", "disk"]
    log = PurgeLog()
    follower = PurgeFollower(store, 60.0, read=log.since)
    assert follower.follow() == 0
    log.add([str(gone[0]), "not a key"])
    assert follower.follow() == 2 and follower.seq == 2  # its memory and its disk entry
    assert not any(t.contains(gone[0]) for t in store.tiers)
    assert all(store.contains(k) for k, _ in (kept, other))  # another key, another tenant: untouched
    assert follower.follow() == 0  # applied once


def test_a_follower_that_cannot_read_the_log_retries(tmp_path) -> None:
    store = build_store(StoreConfig(tiers=("memory",)))
    key, chunk = keyed(3)
    store.put(key, chunk)
    answers = iter([RuntimeError("actor unreachable"), ([str(key)], 1)])

    def read(seq: int):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    follower = PurgeFollower(store, 60.0, read=read)
    assert follower.follow() == 0 and follower.seq == 0
    assert follower.follow() == 1 and not store.contains(key)


def test_delete_local_leaves_a_shared_tier_alone(redis_server, redis_prefix) -> None:
    store = build_store(StoreConfig(tiers=("memory", "redis"), redis_url=redis_server.url, redis_prefix=redis_prefix))
    key, chunk = keyed(4)
    store.put(key, chunk)
    assert delete_local(store, [str(key)]) == 1
    assert [t.name for t in store.tiers if t.contains(key)] == ["redis"]  # the ingress deletes there
    store.close()
