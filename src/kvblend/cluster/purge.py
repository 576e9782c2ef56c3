"""Deleted documents leave every replica: the chunk keys ``DELETE /v1/documents/{id}`` freed.

With one process, a DELETE removes the document's chunk KV from every tier of the one
store. With replicas, the ingress's store holds only the shared tiers (disk on its node,
Redis); each model replica keeps its own memory tier, and the disk tier of its own node.
So the ingress appends the keys it deleted to a small named Ray actor (``PurgeLog``, the
last ``KEEP`` keys, numbered), and every model replica follows the log (``PurgeFollower``,
one thread, every ``period_s``) and deletes those keys from its memory and disk tiers
(Redis, shared, was done by the ingress). A replica starting (or restarted) reads the
whole log first, so a node's disk tier also loses the entries deleted while no replica
ran there, as far back as the log reaches. A key is content-addressed and names its
tenant: deleting it from a tier that does not hold it is a no-op, and no other tenant's
entry can be touched.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
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
    ``keep`` are kept (a Ray actor: ``purge_actor``)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keys: deque[str] = deque(maxlen=keep)
        self._last = 0

    def add(self, keys: Iterable[str]) -> int:
        """Append ``keys``; the sequence number of the last."""
        for key in keys:
            self._keys.append(key)
            self._last += 1
        return self._last

    def since(self, seq: int) -> tuple[list[str], int]:
        """The keys numbered after ``seq`` that are still kept, and the last number
        (``seq`` 0: every key kept)."""
        first = self._last - len(self._keys) + 1  # the number of the oldest kept key
        skip = max(0, seq - first + 1)
        return list(itertools.islice(self._keys, skip, None)), self._last


def purge_actor(create: bool = True) -> Any | None:
    """The named log (created, detached, on first use when ``create``); None when absent."""
    import ray

    try:
        if create:
            return ray.remote(num_cpus=0)(PurgeLog).options(
                name=PURGE_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
        return ray.get_actor(PURGE_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def publish_purged(keys: list[str]) -> None:
    """The ingress's ``ServerState.purge``: append the keys a DELETE freed to the log
    (waits for the actor: once the DELETE answers, the keys are in the log)."""
    import ray

    ray.get(purge_actor().add.remote(keys), timeout=10.0)


def delete_local(store: Any, keys: Iterable[str]) -> int:
    """Delete ``keys`` from ``store``'s memory and disk tiers; how many entries were there."""
    tiers = [t for t in getattr(store, "tiers", ()) if t.name in LOCAL_TIERS]
    removed = 0
    for text in keys:
        try:
            key = ChunkKey.parse(text)
        except ValueError:
            continue
        removed += sum(bool(tier.delete(key)) for tier in tiers)
    return removed


class PurgeFollower:
    """A model replica's thread: every ``period_s``, the log's keys after the last one
    applied are deleted from this replica's memory and disk tiers (``delete_local``). A
    failed read is logged and retried next period. ``read(seq)`` answers as
    ``PurgeLog.since`` (default: the named actor)."""

    def __init__(self, store: Any, period_s: float, read: Callable[[int], tuple[list[str], int]] | None = None) -> None:
        self.store, self.period_s = store, period_s
        self.seq = 0  # the whole log first: a restarted replica's disk tier may hold deleted entries
        self._read = read or _read_actor
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvblend-purge", daemon=True)

    def start(self) -> PurgeFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.follow()
            self._stop.wait(self.period_s)

    def follow(self) -> int:
        """Apply the log's new keys now; how many entries were deleted here."""
        try:
            keys, last = self._read(self.seq)
        except Exception:  # noqa: BLE001 - purging must not take a replica down; retried next period
            log.warning("reading the purge log failed", exc_info=True)
            return 0
        removed = delete_local(self.store, keys)
        self.seq = last
        if removed:
            log.info("purged %d deleted chunk entries from this replica's tiers", removed)
        return removed

    def close(self) -> None:
        self._stop.set()


def _read_actor(seq: int) -> tuple[list[str], int]:
    import ray

    actor = purge_actor(create=False)
    if actor is None:  # no DELETE yet in this cluster
        return [], seq
    return ray.get(actor.since.remote(seq), timeout=10.0)


__all__ = ["KEEP", "PurgeFollower", "PurgeLog", "delete_local", "publish_purged", "purge_actor"]
