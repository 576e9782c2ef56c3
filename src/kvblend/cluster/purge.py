"""Deleted documents leave every replica: the chunk keys ``DELETE /v1/documents/{id}`` freed.

With one process, a DELETE removes the document's chunk KV from every tier of the one
store. With replicas, the ingress's store holds only the shared tiers (disk on its node,
Redis); each model replica keeps its own memory tier, and the disk tier of its own node.
So the ingress appends the keys it deleted to a small named Ray actor (``PurgeLog``, one
per Serve application, the last ``KEEP`` keys, numbered), and every model replica follows
the log (``PurgeFollower``, one thread, every ``period_s``) and deletes those keys from its
memory and disk tiers (Redis, shared, was done by the ingress). A document stored again
revives its keys in the log, so that a replica replaying it does not delete the new copy. A replica starting (or restarted) reads the
whole log first, so a node's disk tier also loses the entries deleted while no replica
ran there, as far back as the log reaches. A key is content-addressed and names its
tenant: deleting it from a tier that does not hold it is a no-op, and no other tenant's
entry can be touched.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from kvblend.store.keys import ChunkKey

log = logging.getLogger("kvblend.cluster")

PURGE_NAME = "kvblend-purged"
NAMESPACE = "kvblend"
KEEP = 65_536  # keys the log keeps (about 6 MiB of key text)
LOCAL_TIERS = ("memory", "disk")  # a replica's own tiers (Redis is shared: the ingress deleted there)


class PurgeLog:
    """Deleted chunk keys in order, each with its sequence number (1, 2, ...); the last
    ``keep`` are kept (a Ray actor: ``purge_actor``). ``epoch`` names this log: a log
    created again (its actor's node died) has another, and its readers start over."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keys: deque[str] = deque()
        self._keep = keep
        self._logged: Counter[str] = Counter()  # how often each key is in ``_keys``
        self._last = 0
        self._revived: set[str] = set()  # logged keys stored again since: not to be deleted
        self.epoch = uuid.uuid4().hex

    def add(self, keys: Iterable[str]) -> int:
        """Append ``keys``; the sequence number of the last."""
        for key in keys:
            self._keys.append(key)
            self._logged[key] += 1
            self._revived.discard(key)
            self._last += 1
            if len(self._keys) > self._keep:
                self._drop_oldest()
        return self._last

    def _drop_oldest(self) -> None:
        old = self._keys.popleft()
        self._logged[old] -= 1
        if not self._logged[old]:
            del self._logged[old]
            self._revived.discard(old)  # out of the log: nothing left to keep it from

    def revive(self, keys: Iterable[str]) -> None:
        """``keys`` are stored again (a document posted after its deletion): a reader that
        has not applied their deletion yet, or replays the log, leaves them alone."""
        self._revived.update(k for k in keys if k in self._logged)

    def since(self, seq: int, epoch: str | None = None) -> tuple[list[str], int, str]:
        """The keys numbered after ``seq`` that are still kept and not revived, the last
        number and the epoch (``seq`` 0, or another ``epoch`` than this log's: every key kept)."""
        if epoch != self.epoch:
            seq = 0
        if seq >= self._last:
            return [], self._last, self.epoch
        first = self._last - len(self._keys) + 1  # the number of the oldest kept key
        skip = max(0, seq - first + 1)
        keys = [k for k in itertools.islice(self._keys, skip, None) if k not in self._revived]
        return keys, self._last, self.epoch


def purge_actor(app: str, create: bool = True) -> Any | None:
    """The named log of Serve application ``app`` (created, detached, on first use when
    ``create``); None when absent. One per application: two applications serving the same
    model (staging and production) must not delete each other's entries."""
    import ray

    try:
        if create:
            return ray.remote(num_cpus=0)(PurgeLog).options(
                name=f"{PURGE_NAME}:{app}", namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
        return ray.get_actor(f"{PURGE_NAME}:{app}", namespace=NAMESPACE)
    except ValueError:
        return None


class PurgePublisher:
    """The ingress's side (``ServerState.purge`` and ``ServerState.revive``): a DELETE's
    freed keys appended to application ``app``'s log, a stored document's keys revived
    (each waits for the actor: once the request answers, the log says so)."""

    def __init__(self, app: str) -> None:
        self.app = app

    def purge(self, keys: list[str]) -> None:
        import ray

        ray.get(purge_actor(self.app).add.remote(keys), timeout=10.0)

    def revive(self, keys: list[str]) -> None:
        import ray

        actor = purge_actor(self.app, create=False)
        if actor is not None:  # no log: nothing was deleted in this application yet
            ray.get(actor.revive.remote(keys), timeout=10.0)


def delete_local(store: Any, keys: Iterable[str]) -> int:
    """Delete ``keys`` from ``store``'s memory and disk tiers; how many entries were there.
    A key a tier fails to delete (an unreadable file, ...) is logged and passed over."""
    tiers = [t for t in getattr(store, "tiers", ()) if t.name in LOCAL_TIERS]
    removed = 0
    for text in keys:
        try:
            key = ChunkKey.parse(text)
        except ValueError:
            continue
        for tier in tiers:
            try:
                removed += bool(tier.delete(key))
            except Exception:  # noqa: BLE001 - one entry must not stop the others' purge
                log.warning("could not purge %s from the %s tier", text, tier.name, exc_info=True)
    return removed


class PurgeFollower:
    """A model replica's thread: every ``period_s``, the log's keys after the last one
    applied are deleted from this replica's memory and disk tiers (``delete_local``). A
    failed read is logged and retried next period. ``read(seq, epoch)`` answers as
    ``PurgeLog.since`` (``log_reader(app)``: the application's actor). ``on_purge(keys)``
    is told each batch of keys applied (the engine's ``forget_blends``)."""

    def __init__(self, store: Any, period_s: float,
                 read: Callable[[int, str | None], tuple[list[str], int, str]],
                 on_purge: Callable[[list[str]], Any] | None = None) -> None:
        self.store, self.period_s, self.on_purge = store, period_s, on_purge
        self.seq, self.epoch = 0, None  # the whole log first: a restarted replica's disk may hold deleted entries
        self._read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvblend-purge", daemon=True)

    def start(self) -> PurgeFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.follow()
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                log.warning("purging deleted documents failed", exc_info=True)
            self._stop.wait(self.period_s)

    def follow(self) -> int:
        """Apply the log's new keys now; how many entries were deleted here."""
        try:
            keys, last, epoch = self._read(self.seq, self.epoch)
        except Exception:  # noqa: BLE001 - purging must not take a replica down; retried next period
            log.warning("reading the purge log failed", exc_info=True)
            return 0
        removed = delete_local(self.store, keys)
        if keys and self.on_purge is not None:
            self.on_purge(keys)
        self.seq, self.epoch = last, epoch
        if removed:
            log.info("purged %d deleted chunk entries from this replica's tiers", removed)
        return removed

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop, and wait for a pass in progress (before the store closes)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def log_reader(app: str) -> Callable[[int, str | None], tuple[list[str], int, str]]:
    """``PurgeFollower``'s reader of application ``app``'s log (the actor handle kept;
    looked up again after a failure)."""
    import ray

    handle: list[Any] = []

    def read(seq: int, epoch: str | None) -> tuple[list[str], int, str]:
        if not handle:
            actor = purge_actor(app, create=False)
            if actor is None:  # no DELETE yet in this application
                return [], seq, epoch or ""
            handle.append(actor)
        try:
            return ray.get(handle[0].since.remote(seq, epoch), timeout=10.0)
        except Exception:
            handle.clear()
            raise

    return read


__all__ = ["KEEP", "PurgeFollower", "PurgeLog", "PurgePublisher", "delete_local", "log_reader", "purge_actor"]
