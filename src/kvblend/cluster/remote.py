"""The ingress's stand-in for the scheduler: the app talks to it as to a local one.

``RemoteScheduler`` has the caller side of ``engine.scheduler.Scheduler`` the app uses
(``asubmit`` instead of ``submit``, ``compute_documents`` instead of ``submit_job``,
``start_shadow`` for the guard's checks instead of ``submit_background``, the gauges,
``drain``) over a Ray Serve ``DeploymentHandle`` to the model deployment. A
request's ``RemoteHandle`` has ``RequestHandle``'s event interface (``aevents``,
``cancel``, ``done``, ``queue_s``, ``replica``), fed by a streaming handle call
(``.options(stream=True)``). ``cancel`` cancels the call, which cancels the request on the
replica (its generator's ``finally``). A request whose replica is lost (killed, node down,
the hop failed, or its model worker died) before it streamed a token is sent once more,
to another replica (``ModelCall.avoid`` names the lost one to the router); lost again, or
lost after a token, it is a ``WorkerDeadError`` (503: retry), never a partial answer
passed off as whole.

Each replica's scheduler sees only the requests routed to it, so a tenant's own
``max_queued`` and ``tokens_per_s`` are also kept here, where all of them pass
(``engine.fair.TenantLedger``, this ingress's part of them): a request is refused (429,
Retry-After, the replica's messages) while the tenant has that many waiting on the
replicas (sent, not started yet), or its bucket is empty; the replicas report what they
charged it (``cluster.wire``), taken from its bucket here as it comes (the prefill before
the first output, then each decoded token, the rest at the end; for a call cancelled before
its end, the rest once the replica ended the request, through this ingress's inbox:
``cluster.settle``, ``RemoteScheduler.settle``). The scheduler-wide ``max_queued`` stays
with each replica, which it protects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import Future
from typing import Any

from kvblend.cluster.metrics import RestartTally, board_texts
from kvblend.cluster.wire import (
    Accepted, Answering, DocumentCall, Ended, ModelCall, RouteKeys, Settled, ShadowCall, Started, WireError, rebuild,
)
from kvblend.engine import Engine, Request
from kvblend.engine.fair import TenantLedger
from kvblend.engine.request import Result
from kvblend.engine.scheduler import DrainingError, QueueFullError, SchedulerObserver, WorkerDeadError
from kvblend.generation.sampling import SamplingParams
from kvblend.generation.stream import StreamEvent
from kvblend.store.keys import ChunkKey, chunk_key

log = logging.getLogger("kvblend.cluster")
SETTLE_WAIT_S = 60.0  # a call ended without its totals is forgotten this long after (its replica was lost)


def route_keys(engine: Engine, request: Request) -> RouteKeys:
    """One (chunk key string, tokens) per document of ``request``: the keys a replica's
    store files them under (the request's pre-rendered layout gives their token ids)."""
    layout = request.layout if request.layout is not None else engine.layout(request)
    if not layout.docs:
        return ()
    ctx = engine.key_context(engine.chunk_prefix(request, layout), request.tenant)
    return tuple((str(chunk_key(ids, ctx)), len(ids)) for ids in layout.docs)


def _lost(exc: BaseException | str) -> WorkerDeadError:
    log.warning("model replica call failed: %s", exc)
    return WorkerDeadError("the model replica serving this request stopped; retry the request")


def _worker_died(item: object) -> bool:
    """An ``Ended`` saying the replica's model worker died (its requests end so; Ray then replaces it)."""
    return isinstance(item, Ended) and item.error is not None and item.error.kind == WorkerDeadError.__name__


class RemoteHandle:
    """One request on a model replica; see the module docstring. Read ``aevents`` once.
    ``call``: what was sent (None: it is not sent again when its replica is lost);
    ``retried``: whether it was."""

    def __init__(self, request: Request, stream: Any, owner: RemoteScheduler, number: int = 0,
                 call: ModelCall | None = None) -> None:
        self.request = request
        self.number = number  # the call's number at this ingress (``ModelCall.call``)
        self.call = call
        self.retried = False
        self.finished_at: float | None = None
        self.replica: str | None = None
        self.queue_s = 0.0
        self.stats = None
        self._stream = stream  # ray.serve.handle.DeploymentResponseGenerator
        self._owner = owner
        self._ended = False
        self._cancelled = False
        self._waiting = True  # counted in the tenant's ledger as waiting, until it starts or ends
        self._prefill_charged = 0.0  # what the tenant's ledger was charged for this request so far
        self._decode_charged = 0
        self._events = 0

    @property
    def done(self) -> bool:
        return self._ended

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel the call: the replica drops the request (queue or batch)."""
        if not self._ended and not self._cancelled:
            self._cancelled = True
            self._stream.cancel()
            self._finish()

    def _finish(self) -> None:
        if not self._ended:
            self._ended = True
            self.finished_at = time.monotonic()
            self._left_queue()
            self._owner._release()

    def _left_queue(self) -> None:
        if self._waiting:
            self._waiting = False
            self._owner._ledger_call("left", self.request.tenant)

    def _charge_up_to(self, prefill: float, decode: int) -> None:
        """Bring what the tenant's ledger was charged for this request up to the replica's
        totals so far (``prefill`` tokens, ``decode`` tokens); from the event loop, or the
        inbox's thread once the call was cancelled."""
        owner = self._owner
        with owner._ledger_lock:
            more_prefill = max(0.0, prefill - self._prefill_charged)
            more_decode = max(0, decode - self._decode_charged)
            self._prefill_charged += more_prefill
            self._decode_charged += more_decode
            if owner.ledger is not None and (more_prefill or more_decode):
                owner.ledger.charge(self.request.tenant, more_prefill, more_decode)

    async def _next(self) -> Any:
        """The call's next item. A lost replica (Ray's error, a stream cut before its
        ``Ended``, an ``Ended`` saying its worker died) before any token: the call goes once
        more, to another replica, and its items follow; else a ``WorkerDeadError``."""
        while True:
            try:
                item = await self._stream.__anext__()
            except asyncio.CancelledError:
                raise
            except StopAsyncIteration:
                lost: BaseException | str = "the stream ended before its end"
            except Exception as exc:  # noqa: BLE001 - the replica or the hop failed (Ray's errors)
                lost = exc
            else:
                if not (_worker_died(item) and self._may_retry()):
                    return item
                self._charge_up_to(item.prefill_tokens, item.decode_tokens)
                self.replica = item.replica or self.replica  # a refusal names its replica
                lost = item.error.message
            if not self._may_retry():
                raise _lost(lost) from None
            self._send_again(lost)

    def _may_retry(self) -> bool:
        return (self.call is not None and not self.retried and self._events == 0 and not self._cancelled
                and not self._owner.draining)

    def _send_again(self, lost: BaseException | str) -> None:
        """Send the call again, once, avoiding the replica that lost it (``Accepted`` follows)."""
        self.retried = True
        log.warning("model replica %s lost a request before its first token (%s); sending it to another",
                    self.replica or "(not known yet)", lost)
        try:
            self._stream.cancel()  # in case the replica still runs it (the hop failed, not the replica)
        except Exception:  # noqa: BLE001 - a stream that failed may refuse even that
            pass
        avoid = (self.replica,) if self.replica is not None else ()
        self.replica = None
        if not self._waiting:  # it waits in a queue again
            self._waiting = True
            self._owner._ledger_call("queued", self.request.tenant)
        self._stream, self.number, self.call = self._owner._send_again(self, avoid)

    async def open(self) -> None:
        """Wait for the replica to accept the request; raises its refusal (429, 503, ...)."""
        try:
            first = await self._next()
        except BaseException:
            self._finish()
            raise
        if isinstance(first, Ended):
            self._owner._got_totals(self)
            self._finish()
            raise rebuild(first.error or WireError("InternalRequestError", "no answer"))
        assert isinstance(first, Accepted), first
        self.replica = first.replica

    async def aevents(self) -> AsyncIterator[Any]:
        """StreamEvents and the RequestStats, as the replica sends them; raises the
        request's error as the local scheduler would."""
        try:
            while True:
                item = await self._next()
                if isinstance(item, Accepted):  # sent again: the replica that took it
                    self.replica = item.replica
                    continue
                if isinstance(item, Started):
                    self.queue_s = item.queue_s
                    self._left_queue()
                    continue
                if isinstance(item, Answering):
                    self._left_queue()
                    self._charge_up_to(item.prefill_tokens, self._decode_charged)
                    continue
                if isinstance(item, Ended):
                    self.queue_s = item.queue_s
                    self._charge_up_to(item.prefill_tokens, item.decode_tokens)
                    self._owner._got_totals(self)
                    if item.error is not None:
                        raise rebuild(item.error)
                    return
                if hasattr(item, "ttft_s"):  # RequestStats
                    self.stats = item
                elif isinstance(item, StreamEvent):
                    self._events += 1
                    # the first token came with the prefill; each next one was decoded
                    self._charge_up_to(self._prefill_charged, self._events - 1)
                yield item
        finally:
            self._finish()


class RemoteScheduler:
    """The scheduler's caller side over the model deployment; see the module docstring.

    ``num_running`` counts this ingress's requests in flight (the replicas' own queues are
    in their metrics, labelled by replica); ``alive`` is False while no model replica is
    running (``replicas_running``, kept by the ingress's watcher; None: not known yet), so
    ``/health`` tells a load balancer that this ingress cannot answer; Ray restarts dead
    replicas. ``restarts``: the model workers' loop restarts over the replicas, as the
    watcher last read them from their metrics. ``inbox``: the name of this ingress's inbox
    (``cluster.settle``), named in the calls of tenants with limits; None: not named."""

    num_waiting = 0
    num_background = 0
    num_jobs = 0
    started = True

    def __init__(self, handle: Any, engine: Engine, ledger: TenantLedger | None = None) -> None:
        self.handle = handle  # DeploymentHandle of the model deployment
        self.engine = engine
        self.ledger = ledger  # the tenants' own limits (this ingress's part); None: only the replicas'
        self._ledger_lock = threading.Lock()
        self.observer = SchedulerObserver()  # the replicas' own observers feed their metrics
        self._stream = handle.options(stream=True)
        self._in_flight = 0
        self._idle = threading.Condition()
        self._draining = False
        self.replicas_running: int | None = None
        self.restarts = 0
        self.inbox: str | None = None
        self._numbers = itertools.count(1)
        self._awaiting: dict[int, RemoteHandle] = {}  # calls that named the inbox and have no totals yet
        self._tasks: set[asyncio.Task] = set()

    @property
    def alive(self) -> bool:
        return self.replicas_running != 0

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_running(self) -> int:
        return self._in_flight

    def start(self) -> None:  # noqa: D401 - the replicas start their own workers
        """Nothing to start here."""

    def _release(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def _ledger_call(self, method: str, *args: Any) -> Any:
        if self.ledger is None:
            return None
        with self._ledger_lock:
            return getattr(self.ledger, method)(*args)

    async def asubmit(self, request: Request, sampling: SamplingParams) -> RemoteHandle:
        """Send the request to a replica the router picks; returns once it was accepted.
        DrainingError while this ingress drains; QueueFullError (429) while the tenant is
        at its own queue cap or over its token rate (``ledger``); the replica's refusals as
        raised there."""
        if self._draining:
            raise DrainingError("the server is shutting down and takes no new requests")
        number, reply_to = next(self._numbers), self._reply_to(request.tenant)
        call = ModelCall(route_keys(self.engine, request), request, sampling, reply_to, number)
        if self.ledger is not None:
            with self._ledger_lock:
                refusal = self.ledger.check(request.tenant)
                if refusal is not None:
                    raise QueueFullError(refusal.message, max(1, math.ceil(refusal.retry_after_s)))
                self.ledger.queued(request.tenant)
        with self._idle:
            self._in_flight += 1
        try:
            stream = self._stream.generate.remote(call)
        except BaseException:
            self._ledger_call("left", request.tenant)
            self._release()
            raise
        handle = RemoteHandle(request, stream, self, number, call)
        if reply_to is not None:
            with self._ledger_lock:
                self._awaiting[number] = handle
        await handle.open()
        return handle

    def _send_again(self, handle: RemoteHandle, avoid: tuple[str, ...]) -> tuple[Any, int, ModelCall]:
        """Send ``handle``'s call again under a new number, the router told to pass over
        ``avoid``; its stream, number and call. Its old number awaits no totals (a replica
        lost or unreachable sends none, and a late one finds nothing to settle)."""
        assert handle.call is not None
        call = dataclasses.replace(handle.call, call=next(self._numbers), avoid=avoid)
        with self._ledger_lock:
            self._awaiting.pop(handle.number, None)
            if call.reply_to is not None:
                self._awaiting[call.call] = handle
        return self._stream.generate.remote(call), call.call, call

    def _reply_to(self, tenant: str) -> str | None:
        """The inbox a call of ``tenant`` names: only a tenant this ingress keeps limits for."""
        if self.inbox is None or self.ledger is None or self.ledger.share(tenant) is None:
            return None
        return self.inbox

    def _got_totals(self, handle: RemoteHandle) -> None:
        """The call's totals came in its stream (``Ended``): no settlement is awaited."""
        with self._ledger_lock:
            self._awaiting.pop(handle.number, None)

    def settle(self, items: list[Settled]) -> None:
        """Charge each call's tenant what its replica charged beyond what came in its stream
        (the call was cancelled before its ``Ended``: ``cluster.settle``); forget the calls
        that ended without their totals over ``SETTLE_WAIT_S`` ago (their replica was lost)."""
        now = time.monotonic()
        with self._ledger_lock:
            found = [(self._awaiting.pop(item.call, None), item) for item in items]
            for number, handle in list(self._awaiting.items()):
                if handle.finished_at is not None and now - handle.finished_at > SETTLE_WAIT_S:
                    del self._awaiting[number]
        for handle, item in found:
            if handle is not None:
                handle._charge_up_to(item.prefill_tokens, item.decode_tokens)

    async def compute_documents(self, todo: list[tuple[ChunkKey, tuple[int, ...]]], prefix: tuple[int, ...],
                                name: str) -> str:
        """Compute and store ``todo``'s chunks on a replica (routed by their keys); returns
        the replica's id. Raises the replica's refusal (429 when its jobs lane is full)."""
        if self._draining:
            raise DrainingError("the server is shutting down and takes no new requests")
        call = DocumentCall(tuple((str(k), len(ids)) for k, ids in todo), todo[0][0].tenant if todo else "default",
                            tuple(tuple(ids) for _, ids in todo), tuple(prefix), name)
        try:
            answer = await self.handle.compute_documents.remote(call)
        except Exception as exc:  # noqa: BLE001 - the replica or the hop failed (Ray's errors)
            raise _lost(exc) from None
        if isinstance(answer, WireError):
            raise rebuild(answer)
        return answer

    def start_shadow(self, request: Request, served: Result, probe: Request | None) -> Future | None:
        """Send the guard's shadow check of a served request to a replica (routed by its
        documents, so usually the one that served it); never waits; call it on the app's
        event loop. The Future resolves
        to the ``ShadowResult``, fails with the check's error (or a lost replica), and is
        cancelled when the replica's lane dropped it; None while this ingress drains."""
        if self._draining:
            return None
        keyed = probe if probe is not None else request
        call = ShadowCall(route_keys(self.engine, keyed), request, served, probe)
        out: Future = Future()

        async def run() -> None:
            try:
                answer = await self.handle.shadow.remote(call)
            except Exception as exc:  # noqa: BLE001 - the replica or the hop failed (Ray's errors)
                out.set_exception(_lost(exc))
                return
            if answer is None:
                out.cancel()
            elif isinstance(answer, WireError):
                out.set_exception(rebuild(answer))
            else:
                out.set_result(answer)

        self._spawn(run())
        return out

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on the app's event loop (``start_shadow`` is called there, when a
        request ends), keeping a reference until it is done (the loop keeps weak ones)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def drain(self, timeout_s: float) -> None:
        """Refuse new work; wait up to ``timeout_s`` for this ingress's requests in flight."""
        self._draining = True
        until = time.monotonic() + max(timeout_s, 0.0)
        with self._idle:
            while self._in_flight > 0 and time.monotonic() < until:
                self._idle.wait(max(0.0, until - time.monotonic()))


def tenant_ledger(settings: Any) -> TenantLedger:
    """The ledger of one ingress among ``cluster.ingress_replicas``: the tenants' own
    ``max_queued`` and ``tokens_per_s`` (``scheduler.tenants``) split between them, as Serve
    spreads the HTTP requests over them."""
    sch = settings.scheduler
    return TenantLedger(sch.shares(), sch.decode_weight, parts=settings.cluster.ingress_replicas)


def running_replicas(status: Any, app: str, deployment: str) -> int | None:
    """How many replicas of ``deployment`` in ``app`` are RUNNING in a ``serve.status()``
    answer (None when the app or deployment is not in it)."""
    application = status.applications.get(app)
    overview = application.deployments.get(deployment) if application is not None else None
    if overview is None:
        return None
    return sum(n for state, n in overview.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


def watch_replicas(scheduler: RemoteScheduler, app: str, deployment: str, period_s: float,
                   stop: threading.Event) -> threading.Thread:
    """A daemon thread setting, every ``period_s`` until ``stop`` is set,
    ``scheduler.replicas_running`` from ``serve.status()`` and ``scheduler.restarts`` from
    the replicas' metrics (``cluster.metrics.RestartTally``); a failed read leaves the last value."""
    from ray import serve

    tally = RestartTally()

    def run() -> None:
        while not stop.is_set():
            try:
                scheduler.replicas_running = running_replicas(serve.status(), app, deployment)
            except Exception as exc:  # noqa: BLE001 - the controller is busy or restarting: try again
                log.debug("serve.status() failed: %s", exc)
            try:
                scheduler.restarts = tally.update(board_texts())
            except Exception as exc:  # noqa: BLE001 - the board is busy or restarting: try again
                log.debug("replica metrics unavailable: %s", exc)
            stop.wait(period_s)

    thread = threading.Thread(target=run, name="kvblend-replica-watch", daemon=True)
    thread.start()
    return thread


__all__ = ["RemoteHandle", "RemoteScheduler", "route_keys", "running_replicas", "tenant_ledger", "watch_replicas"]
