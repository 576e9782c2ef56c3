"""Deleted documents leave every replica's own tiers (``cluster.purge``), without Ray:
the log's numbering, window, epoch and revived keys, and a follower deleting from memory
and disk only."""

from __future__ import annotations

from kvblend.cluster.purge import PurgeFollower, PurgeLog, delete_local
from kvblend.store.config import StoreConfig, build_store
from tests.store.conftest import redis_prefix, redis_server  # noqa: F401 - the Redis fixtures
from tests.store.helpers import keyed


def test_the_log_answers_what_came_after_a_number_within_its_window() -> None:
    log = PurgeLog(keep=3)
    e = log.epoch
    assert log.since(0, e) == ([], 0, e)
    assert log.add(["t/a", "t/b"]) == 2
    assert log.since(0, e) == (["t/a", "t/b"], 2, e) and log.since(1, e) == (["t/b"], 2, e)
    assert log.since(2, e) == ([], 2, e)
    log.add(["t/c", "t/d"])  # "t/a" falls out of the window
    assert log.since(0, e) == (["t/b", "t/c", "t/d"], 4, e) and log.since(3, e) == (["t/d"], 4, e)


def test_a_reader_of_another_log_reads_this_one_whole() -> None:
    """A log created again (its actor's node died) restarts its numbers: a reader ahead of
    them skipped every key added before its next read."""
    log = PurgeLog()
    log.add(["t/k"])
    assert log.since(10, "an older log's epoch") == (["t/k"], 1, log.epoch)


def test_keys_stored_again_are_not_deleted_by_a_replay() -> None:
    """A document deleted and posted again: a replica (re)starting replays the log and
    deleted the new copy."""
    log = PurgeLog()
    log.add(["t/a", "t/b"])
    log.revive(["t/a", "t/never-deleted"])
    assert log.since(0, log.epoch)[0] == ["t/b"]
    log.add(["t/a"])  # deleted once more
    assert log.since(0, log.epoch)[0] == ["t/a", "t/b", "t/a"]


def test_the_log_forgets_what_falls_out_of_its_window() -> None:
    log = PurgeLog(keep=2)
    log.add(["t/a"])
    log.revive(["t/a"])
    log.add(["t/b", "t/c"])  # "t/a" leaves the window, and with it its revival
    assert log._revived == set() and set(log._logged) == {"t/b", "t/c"}
    assert log.since(0, log.epoch)[0] == ["t/b", "t/c"]


def _follower(store, log: PurgeLog) -> PurgeFollower:
    return PurgeFollower(store, 60.0, read=log.since)


def test_a_follower_deletes_the_logged_keys_from_its_memory_and_disk_tiers_only(tmp_path) -> None:
    store = build_store(StoreConfig(tiers=("memory", "disk"), disk_dir=str(tmp_path)))
    gone, kept, other = keyed(1, tenant="acme"), keyed(2, tenant="acme"), keyed(1, tenant="bob")
    for key, chunk in (gone, kept, other):
        store.put(key, chunk)
    assert [t.name for t in store.tiers if t.contains(gone[0])] == ["memory", "disk"]
    log = PurgeLog()
    follower = _follower(store, log)
    assert follower.follow() == 0
    log.add([str(gone[0]), "not a key"])
    assert follower.follow() == 2 and follower.seq == 2  # its memory and its disk entry
    assert not any(t.contains(gone[0]) for t in store.tiers)
    assert all(store.contains(k) for k, _ in (kept, other))  # another key, another tenant: untouched
    assert follower.follow() == 0  # applied once


def test_a_follower_that_cannot_read_the_log_or_delete_an_entry_goes_on(tmp_path) -> None:
    store = build_store(StoreConfig(tiers=("memory",)))
    (a, chunk_a), (b, chunk_b) = keyed(3), keyed(4)
    store.put(a, chunk_a)
    store.put(b, chunk_b)
    log = PurgeLog()
    log.add([str(a), str(b)])
    answers = iter([RuntimeError("actor unreachable")])

    def read(seq, epoch):
        for answer in answers:
            raise answer
        return log.since(seq, epoch)

    memory = store.tiers[0]
    delete = memory.delete
    memory.delete = lambda key: (_ for _ in ()).throw(PermissionError("read-only")) if key == a else delete(key)
    follower = PurgeFollower(store, 60.0, read=read)
    assert follower.follow() == 0 and follower.seq == 0  # the read failed: retried
    assert follower.follow() == 1 and not store.contains(b)  # a's failure did not stop b's delete


def test_delete_local_leaves_a_shared_tier_alone(redis_server, redis_prefix) -> None:
    store = build_store(StoreConfig(tiers=("memory", "redis"), redis_url=redis_server.url, redis_prefix=redis_prefix))
    key, chunk = keyed(4)
    store.put(key, chunk)
    assert delete_local(store, [str(key)]) == 1
    assert [t.name for t in store.tiers if t.contains(key)] == ["redis"]  # the ingress deletes there
    store.close()


def test_the_thread_stops_when_closed(tmp_path) -> None:
    follower = PurgeFollower(build_store(StoreConfig(tiers=("memory",))), 0.01, read=PurgeLog().since).start()
    follower.close()
    assert not follower._thread.is_alive()
