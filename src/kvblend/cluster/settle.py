"""What a replica charged for a call cancelled before its end, back to the ingress's ledger.

The ingress keeps each tenant's own token rate across the replicas
(``engine.fair.TenantLedger``) from what the replicas report in each call's stream
(``cluster.wire``: the prefill with ``Answering``, each decoded token, the totals in
``Ended``). A call cancelled before its ``Ended`` (the client left) gets nothing more, so
the prefill a replica ran before the request's first output, and what it charged after
the last item the ingress read, stayed in that replica's own bucket only: a tenant whose
clients leave mid-prefill was served prefills its rate never paid for.

So each ingress owns a small Ray actor, its ``Inbox`` (named ``kvblend-settle:<ingress
replica id>``; it lives and dies with the ingress). The calls of tenants with limits name
it (``ModelCall.reply_to``); a replica whose call is cancelled before its ``Ended`` sends
the request's totals there once its scheduler has ended it (``Settled``, ``post``), and
the ingress's ``follow_inbox`` thread hands them to ``RemoteScheduler.settle``, which
charges the tenant what it was not charged yet. One case stays short: a request that had
ended on the replica, its last items and ``Ended`` still on their way, when the client
left; the replica sent its end and posts nothing, so the tokens of the items the ingress
never read (those in flight, a few at most) are charged by the replica only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

from kvblend.cluster.wire import Settled

if TYPE_CHECKING:
    from kvblend.cluster.remote import RemoteScheduler

log = logging.getLogger("kvblend.cluster")

INBOX_NAME = "kvblend-settle"
NAMESPACE = "kvblend"
TAKE_WAIT_S = 1.0  # how long one take waits for something to arrive


class Inbox:
    """Settlements on their way to one ingress (a Ray actor, async: ``take`` waits)."""

    def __init__(self) -> None:
        self._items: list[Settled] = []
        self._ready = asyncio.Event()

    async def post(self, item: Settled) -> None:
        self._items.append(item)
        self._ready.set()

    async def take(self, wait_s: float) -> list[Settled]:
        """What was posted since the last take, waiting up to ``wait_s`` for something."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), wait_s)
        items, self._items = self._items, []
        self._ready.clear()
        return items


def start_inbox(ingress_id: str) -> tuple[str, Any]:
    """This ingress's inbox, owned by the calling process (it ends with it): its name and
    its actor handle (keep it: an owned actor ends once no handle is left)."""
    import ray

    name = f"{INBOX_NAME}:{ingress_id}"
    actor = ray.remote(num_cpus=0)(Inbox).options(name=name, namespace=NAMESPACE, get_if_exists=True).remote()
    return name, actor


def follow_inbox(inbox: Any, scheduler: RemoteScheduler, stop: threading.Event) -> threading.Thread:
    """A daemon thread handing what ``inbox`` receives to ``scheduler.settle`` (at least
    every ``TAKE_WAIT_S``, with nothing) until ``stop`` is set."""
    import ray

    def run() -> None:
        while not stop.is_set():
            try:
                items = ray.get(inbox.take.remote(TAKE_WAIT_S), timeout=TAKE_WAIT_S + 10.0)
            except Exception as exc:  # noqa: BLE001 - the actor is busy or restarting: try again
                log.debug("settlement inbox unavailable: %s", exc)
                stop.wait(TAKE_WAIT_S)
                continue
            scheduler.settle(items)

    thread = threading.Thread(target=run, name="kvblend-settle", daemon=True)
    thread.start()
    return thread


@functools.lru_cache(maxsize=64)
def _inbox(name: str) -> Any:
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)


def post(reply_to: str, item: Settled) -> None:
    """Send ``item`` to the inbox named ``reply_to`` (a replica's side, any thread; never
    waits for it). An inbox gone with its ingress drops it: nobody is left to charge."""
    try:
        _inbox(reply_to).post.remote(item)
    except Exception as exc:  # noqa: BLE001 - its ingress is gone
        log.debug("settlement for %s dropped: %s", reply_to, exc)


__all__ = ["Inbox", "follow_inbox", "post", "start_inbox"]
