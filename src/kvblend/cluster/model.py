"""The model deployment's replica: today's engine and scheduler behind Ray Serve methods.

Each replica loads the model, builds its store from ``store.*`` (its own memory tier; the
disk and Redis tiers are the shared ones every replica names), and runs one
``engine.scheduler.Scheduler`` with the app's metrics on it. The ingress calls:

* ``generate(call: ModelCall)`` — an async generator (through ``.options(stream=True)``):
  ``Accepted``, ``Started``, ``Answering``, the scheduler's items, ``Ended``
  (``cluster.wire``). A cancelled call cancels the request here and, once it ended, sends
  what its tenant was charged to the ingress's inbox (``cluster.settle``);
* ``compute_documents(call: DocumentCall)`` — `/v1/documents` precompute on the jobs
  lane, stored through this replica's store (so into the shared tiers too);
returns this replica's id, or a ``WireError``;
* ``shadow(call: ShadowCall)`` — the quality guard's shadow check of a request served
  (usually) here, on this replica's background lane; the ``ShadowResult``, None when the
  lane dropped it, or a ``WireError``. The guard itself (its windows, fallback and
  metrics) lives in the ingress.

Ray Serve calls ``check_health`` (raises once the scheduler's supervisor gave up, so Ray
replaces the replica) and ``record_routing_stats`` (the resident chunk keys of the memory
tier as a ``cluster.affinity.ResidentSummary``, the queue, and the requests not answering
yet, for the request router).
Replicas push their Prometheus exposition to the ``cluster.metrics`` board for the
ingress's ``/metrics``, and follow ``cluster.purge``'s log of deleted documents' chunk keys
(deleting them from their own memory and disk tiers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Any

from kvblend.cluster.affinity import ResidentSummary
from kvblend.cluster.metrics import MetricsPusher
from kvblend.cluster.purge import PurgeFollower, log_reader
from kvblend.cluster.settle import post
from kvblend.cluster.wire import (
    INTERNAL, Accepted, Answering, DocumentCall, Ended, ModelCall, Settled, ShadowCall, Started, WireError, to_wire,
)
from kvblend.engine.scheduler import Admitted, DrainingError, RequestHandle
from kvblend.guard.quality import start_check
from kvblend.guard.shadow import ShadowResult
from kvblend.server.app import build_scheduler, server_metrics
from kvblend.server.main import build_engine, configure_logging
from kvblend.settings import Settings

log = logging.getLogger("kvblend.cluster")


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def _app_name() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.deployment_id.app_name


def memory_tier(store: Any) -> Any | None:
    """The store's memory tier, if it has one."""
    return next((t for t in getattr(store, "tiers", ()) if t.name == "memory"), None)


class ModelReplica:
    """One model replica; see the module docstring. ``settings`` as ``kvblend serve`` merged them."""

    def __init__(self, settings: Settings) -> None:
        import torch

        configure_logging(settings.log_level)
        torch.set_num_threads(replica_threads(settings))
        self.settings = settings
        self.replica = _replica_id()
        self.engine = build_engine(settings)
        self.scheduler = build_scheduler(self.engine, settings)
        self.metrics = server_metrics(settings.model_id, self.engine, self.scheduler)
        self.scheduler.start()
        self.pusher = MetricsPusher(self.replica, self.metrics.registry, settings.cluster.routing_stats_period_s)
        self.unanswered = Unanswered()
        self._closed = threading.Event()
        self.purger = PurgeFollower(self.engine.store, settings.cluster.routing_stats_period_s,
                                    log_reader(_app_name()), on_purge=self.engine.forget_blends).start()
        self.post = post  # a cancelled call's charges, to its ingress's inbox
        log.info("model replica %s ready", self.replica)

    # -- requests
    async def generate(self, call: ModelCall):  # noqa: ANN201 - an async generator of wire items
        try:
            handle = self.scheduler.submit(call.request, call.sampling)
        except Exception as exc:  # noqa: BLE001 - refusals go back as data
            yield Ended(0.0, self._wire(exc), replica=self.replica)
            return
        self.unanswered.add(handle)
        try:
            yield Accepted(self.replica)  # inside the try: a call cancelled here cancels the request too
            async for item in self._answer(handle):
                yield item
            yield Ended(handle.queue_s, None, handle.charged_prefill, handle.charged_decode)
        except Exception as exc:  # noqa: BLE001 - the request's error, in-band (the scheduler logged it)
            yield Ended(handle.queue_s, to_wire(exc), handle.charged_prefill, handle.charged_decode)
        except BaseException:  # cancelled (client gone): no Ended goes out
            self._settle_later(call, handle)
            raise
        finally:
            self.unanswered.discard(handle)
            if not handle.done:  # the call was cancelled (client gone): free the slot
                handle.cancel()

    def _settle_later(self, call: ModelCall, handle: RequestHandle) -> None:
        """Once the cancelled call's request has ended here, send what its tenant was
        charged for it to the call's ingress (``cluster.settle``), if it asked."""
        if call.reply_to is not None:
            handle.on_end(lambda h: self.post(call.reply_to, Settled(call.call, h.charged_prefill, h.charged_decode)))

    async def _answer(self, handle: RequestHandle):  # noqa: ANN202 - an async generator of wire items
        """The request's items as the scheduler gives them, with ``Started`` and ``Answering``."""
        answering = False
        async for item in handle.aevents(admissions=True):
            if isinstance(item, Admitted):
                yield Started(item.queue_s)
                continue
            self.unanswered.discard(handle)  # its stats or first token: its prefill is done
            if not answering:
                answering = True
                yield Answering(handle.charged_prefill)
            yield item

    async def compute_documents(self, call: DocumentCall) -> str | WireError:
        """Compute the chunks not stored yet (this replica's store decides) on the jobs
        lane and store them; this replica's id, or the refusal as a ``WireError``."""
        try:
            plan = await asyncio.to_thread(self.engine.plan_warm, list(call.chunks), call.prefix, call.tenant)
            if [str(k) for k in plan.keys] != [k for k, _ in call.route_keys]:
                raise RuntimeError("the ingress keyed these chunks otherwise: is every process serving one model?")
            todo = plan.todo
            if todo:
                future = self.scheduler.submit_job(self.engine.compute_steps(todo, call.prefix), call.name)
                try:
                    computed = await asyncio.wrap_future(future)
                except asyncio.CancelledError:
                    if future.cancelled():  # dropped by drain or worker death
                        raise DrainingError("the server stopped before this work ran") from None
                    raise
                await asyncio.to_thread(self.engine.put_chunks, computed)
        except Exception as exc:  # noqa: BLE001 - refusals go back as data
            return self._wire(exc)
        return self.replica

    async def shadow(self, call: ShadowCall) -> ShadowResult | None | WireError:
        """Run a shadow check on the background lane (below requests and jobs; paced like
        a prefill while streams decode). None when the lane refuses or drops it."""
        job = start_check(self.scheduler, call.request, call.served, call.probe, self.settings.guard.chunk_tokens)
        if job is None:
            return None
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancelled():  # dropped by drain or worker death
                return None
            job.cancel()  # the ingress is gone: the check is not wanted any more
            raise
        except Exception as exc:  # noqa: BLE001 - the scheduler logged it; the ingress counts it failed
            return to_wire(exc)

    @staticmethod
    def _wire(exc: BaseException) -> WireError:
        """``exc`` as data; an unexpected one is logged here, where its cause is."""
        error = to_wire(exc)
        if error.kind == INTERNAL and type(exc).__name__ != INTERNAL:
            log.error("internal error: %s", type(exc).__name__, exc_info=exc)
        return error

    # -- Ray Serve hooks
    def check_health(self) -> None:
        """Raises when the model worker is gone (its supervisor gave up): Ray restarts us."""
        if self.scheduler.started and not self.scheduler.alive and not self.scheduler.draining:
            raise RuntimeError(f"replica {self.replica}: the model worker has stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        """``{"resident": ResidentSummary.to_dict(), "waiting": int, "running": int,
        "unanswered": int, "at": float}``: the chunk keys the memory tier holds (every
        tenant's: a key names its tenant), the scheduler's queue, and the requests not
        answering yet (queued or in prefill: ``Unanswered``) at wall-clock time ``at``."""
        tier = memory_tier(self.engine.store)
        keys = [str(k) for k in tier.resident_keys()] if tier is not None else []
        return {"resident": ResidentSummary.from_keys(keys).to_dict(), "waiting": self.scheduler.num_waiting,
                "running": self.scheduler.num_running, "unanswered": len(self.unanswered), "at": time.time()}

    def __del__(self) -> None:
        """Ray Serve's graceful shutdown: drain the scheduler, flush write-back, close."""
        closed = getattr(self, "_closed", None)
        if closed is None or closed.is_set():
            return
        closed.set()
        self.pusher.close()
        if getattr(self, "purger", None) is not None:
            self.purger.close()
        try:
            self.scheduler.drain(self.settings.drain_timeout_s)
        finally:
            self.engine.close()


class Unanswered:
    """The requests this replica has taken and not started answering: each from its
    arrival to its first item (its stats or first token) or its end. That is the load the
    router bounds: a request waits for the prefills ahead of it, while the streams already
    decoding cost a new prefill little. Thread-safe."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def add(self, handle: object) -> None:
        with self._lock:
            self._ids.add(id(handle))

    def discard(self, handle: object) -> None:
        with self._lock:
            self._ids.discard(id(handle))

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)


def max_ongoing(settings: Settings) -> int:
    """Calls one model replica takes at once: its scheduler's running and queued requests,
    its jobs lane and, with the guard on, its background lane (the shadow checks every
    ingress sends; one the full lane refuses returns at once), so that the scheduler (fair
    queue, 429s) does the queueing."""
    sch = settings.scheduler
    return sch.max_running + sch.max_queued + sch.max_jobs + (sch.max_background if settings.guard.enabled else 0)


def replica_threads(settings: Settings) -> int:
    """Torch threads of a model replica: its CPUs rounded (``cluster.replica_cpus``; unset: 1)."""
    cpus = settings.cluster.replica_cpus
    return max(1, math.floor(cpus + 0.5)) if cpus is not None else 1


__all__ = ["ModelReplica", "Unanswered", "max_ongoing", "memory_tier"]
