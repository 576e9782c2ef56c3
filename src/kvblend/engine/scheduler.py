"""Continuous batching: one worker thread owns the model and serves many requests.

Contract (the HTTP server builds on exactly this)::

    sched = Scheduler(engine, max_running=8, max_queued=64, deadline_s=None, observer=None)
    sched.start()                                # starts the single model-worker thread
    handle = sched.submit(request, sampling)     # QueueFullError (-> 429 + Retry-After),
                                                 # DrainingError (-> 503), WorkerDeadError (-> 503)
    for item in handle.events(): ...             # StreamEvent..., RequestStats after the first
                                                 # token's event; raises the request's KvblendError
    async for item in handle.aevents(): ...      # the same, for asyncio
    handle.cancel()                              # client gone: slot freed within one step
    job = sched.submit_background(steps)         # low-priority lane: a Future of the job's result,
                                                 # or None when the lane is full (counted dropped)
    sched.drain(timeout_s)                       # stop accepting, finish, flush write-back
    sched.alive, sched.draining, sched.num_running, sched.num_waiting, sched.num_background

How the worker runs:

* Requests wait in a bounded FCFS queue (``max_queued``); at most ``max_running``
  decode at once.
* Each loop turn admits at most one waiting request — ``Engine.prepare`` (prefix
  lookup, chunk fusion or full prefill) and its first token — then runs ONE batched
  decode step for every running request (``generation.batch.decode_batch``:
  projections and MLP over the batch, attention per request over its own cache). So
  a new prefill delays running streams by one prefill, never more.
* Sampling, stop strings, EOS and max_tokens per request, by ``DecodeSlot`` (the same
  rules as ``Engine.stream``).
* Background jobs (shadow checks) are a low-priority lane of at most ``max_background``
  jobs, run one at a time in FIFO order. A job is an iterator whose every ``next()`` does
  one small piece of model work (a prefill chunk, a decode token); its return value
  (``StopIteration.value``) resolves the job's Future. The worker runs ONE step of the
  current job at the end of a turn, and only when no request waits in the queue: so a
  newly waiting request is admitted before the next background step, and running
  streams get a decode step between any two. A job that raises ends alone (its Future
  holds the exception; logged, counted ``failed``); the worker goes on. Drain does not
  wait for background jobs: pending and running ones are dropped at once (their Futures
  cancelled, counted ``dropped``), as on worker death.
* A cancelled request leaves the queue at once, or the batch before the next step; a
  request past its deadline (queued time included) ends with ``DeadlineExceededError``.
* A request's own error (too long, invalid) ends that request only; so does an
  unexpected error in its prefill (``InternalRequestError``). Anything that escapes
  the batched step kills the worker: ``alive`` turns False and every pending
  request gets ``WorkerDeadError``.

Observers (metrics) get callbacks on the worker thread; they must be quick and
thread-safe, and an exception they raise is logged and ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

from kvblend.engine.engine import Engine
from kvblend.engine.request import Request, RequestStats, Result, result_of
from kvblend.errors import InvalidRequestError, KvblendError
from kvblend.generation.batch import DecodeSlot, decode_batch
from kvblend.generation.sampling import SamplingParams
from kvblend.generation.stream import StreamEvent

log = logging.getLogger(__name__)


# ----- errors ---------------------------------------------------------------------------
class QueueFullError(KvblendError):
    """The waiting queue holds ``max_queued`` requests: retry after ``retry_after_s``
    (HTTP 429 with a Retry-After header)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DrainingError(KvblendError):
    """The scheduler is shutting down and takes no new work (HTTP 503); also what a
    request still unfinished when the drain timeout ends receives."""


class DeadlineExceededError(KvblendError):
    """The request was not finished within its deadline (queued time included)."""


class RequestCancelledError(KvblendError):
    """The request was cancelled (its client went away); what ``events()`` raises if it is
    read after ``cancel()``."""


class InternalRequestError(RuntimeError):
    """One request failed on an unexpected error (a bug, not the client's doing: HTTP
    500; the traceback is logged). Deliberately not a KvblendError."""


class WorkerDeadError(KvblendError):
    """The model worker stopped on an internal error; nothing more will be served
    (HTTP 503; the cause is logged on the server)."""


# ----- observer ---------------------------------------------------------------------------
class Outcome(NamedTuple):
    """How a request ended, for metrics and the per-request log line.

    ``status``: "ok", "cancelled", "deadline", "error", "drained" or "worker_dead".
    ``stats`` is None when the request never got its first token."""

    status: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    e2e_s: float  # submit -> end
    stats: RequestStats | None
    error: Exception | None


class SchedulerObserver:
    """Hooks for metrics; every method is a no-op here, override what you need. All are
    called on the worker thread except ``on_queued`` (the submitting thread)."""

    def on_queued(self, handle: RequestHandle) -> None:
        """The request entered the waiting queue."""

    def on_admitted(self, handle: RequestHandle) -> None:
        """The request left the queue (``handle.queue_s`` is set) and starts its prefill."""

    def on_first_token(self, handle: RequestHandle, stats: RequestStats) -> None:
        """The first token is out; ``stats.ttft_s`` counts from submit."""

    def on_token(self, handle: RequestHandle, event: StreamEvent, now: float) -> None:
        """One token was produced at ``now`` (``time.perf_counter()``), the first included."""

    def on_step(self, batch_size: int, seconds: float) -> None:
        """One batched decode step over ``batch_size`` requests took ``seconds``."""

    def on_finish(self, handle: RequestHandle, outcome: Outcome) -> None:
        """The request ended, by any path (called exactly once per admitted or queued request)."""


# ----- handle -------------------------------------------------------------------------------
class _End(NamedTuple):
    error: Exception | None


_ids = itertools.count(1)


class RequestHandle:
    """One submitted request: read its events, or cancel it.

    ``events()`` / ``aevents()`` may be read by one consumer, once. Items arrive as the
    worker produces them: StreamEvents, and the request's RequestStats right after the
    first token's event. The stream ends after the event with a ``finish_reason``, or
    raises the request's KvblendError (deadline, cancel, drain, worker death, invalid).
    """

    def __init__(self, request: Request, sampling: SamplingParams, deadline_s: float | None) -> None:
        self.id = f"req-{next(_ids)}"
        self.request = request
        self.sampling = sampling
        self.submitted = time.perf_counter()
        self.deadline = None if deadline_s is None else self.submitted + deadline_s
        self.queue_s = 0.0  # set when the worker admits it
        self.completion_tokens = 0
        self.stats: RequestStats | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aitems: asyncio.Queue | None = None
        self._ended = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        """Ask the worker to drop this request; its slot is freed before the next step."""
        self._cancelled.set()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    # -- the worker side
    def _push(self, item: StreamEvent | RequestStats | _End) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = isinstance(item, _End)
            if self._loop is None:
                self._items.put(item)
                return
            loop, aitems = self._loop, self._aitems
        try:
            loop.call_soon_threadsafe(aitems.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read this
            self._cancelled.set()

    # -- the consumer side
    def events(self) -> Iterator[StreamEvent | RequestStats]:
        """Blocking iterator over the request's items (see the class docstring); raises the
        request's KvblendError, or InternalRequestError."""
        while True:
            item = self._items.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item

    async def aevents(self) -> AsyncIterator[StreamEvent | RequestStats]:
        """``events()`` for asyncio: the worker hands items to this loop thread-safely."""
        with self._lock:
            self._loop, self._aitems = asyncio.get_running_loop(), asyncio.Queue()
            while not self._items.empty():  # what arrived before we switched
                self._aitems.put_nowait(self._items.get())
        while True:
            item = await self._aitems.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item

    def result(self) -> Result:
        """Block until the request ends and return it whole (raises its error)."""
        return result_of(self.events())


class _Running(NamedTuple):
    handle: RequestHandle
    slot: DecodeSlot


class _Job(NamedTuple):
    name: str
    steps: Iterator[Any]
    future: Future


class BackgroundStats(NamedTuple):
    """The background lane's counters since the scheduler was made: jobs queued or running
    now, and jobs ended by outcome (ok, failed: the job raised, dropped: the lane was
    full, or it was dropped by drain or worker death)."""

    pending: int
    ok: int
    failed: int
    dropped: int


# ----- scheduler ------------------------------------------------------------------------------
class Scheduler:
    """Owns the engine's model on one worker thread; see the module docstring.

    ``deadline_s``: default per-request deadline in seconds (None: no deadline);
    ``max_background``: background jobs queued or running at most (more are dropped)."""

    def __init__(self, engine: Engine, max_running: int = 8, max_queued: int = 64, deadline_s: float | None = None,
                 observer: SchedulerObserver | None = None, max_background: int = 16) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if max_background < 0:
            raise ValueError(f"max_background must be >= 0, got {max_background}")
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.engine = engine
        self.max_running = max_running
        self.max_queued = max_queued
        self.deadline_s = deadline_s
        self.observer = observer or SchedulerObserver()
        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[_Running] = []
        self._thread: threading.Thread | None = None
        self._draining = False
        self._drain_until: float | None = None
        self._dead: str | None = None
        self._service_s = 1.0  # moving average of a request's time in the worker, for Retry-After
        self.max_background = max_background
        self._background: deque[_Job] = deque()  # the head is the job being stepped
        self._bg_counts = {"ok": 0, "failed": 0, "dropped": 0}

    # -- state
    @property
    def alive(self) -> bool:
        """The worker thread runs and has not crashed."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def started(self) -> bool:
        """``start()`` was called (the worker may since have stopped: see ``alive``)."""
        return self._thread is not None

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_background(self) -> int:
        """Background jobs queued or running now."""
        return len(self._background)

    def background_stats(self) -> BackgroundStats:
        with self._cond:
            return BackgroundStats(len(self._background), **self._bg_counts)

    # -- the caller side
    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the scheduler was already started")
        self._thread = threading.Thread(target=self._work, name="kvblend-worker", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sampling: SamplingParams, deadline_s: float | None = None) -> RequestHandle:
        """Queue a request; returns at once. ``deadline_s`` overrides the default deadline."""
        if deadline_s is not None and deadline_s <= 0:
            raise InvalidRequestError(f"the deadline must be > 0 s, got {deadline_s}")
        handle = RequestHandle(request, sampling, deadline_s if deadline_s is not None else self.deadline_s)
        with self._cond:
            if self._dead is not None:
                raise WorkerDeadError("the model worker has stopped; this server cannot serve requests")
            if self._draining:
                raise DrainingError("the server is shutting down and takes no new requests")
            if len(self._waiting) >= self.max_queued:
                raise QueueFullError(f"the server is busy: {len(self._waiting)} requests are already waiting",
                                     self._retry_after())
            self._waiting.append(handle)
            self._notify("on_queued", handle)  # before the worker can see it
            self._cond.notify()
        return handle

    def submit_background(self, steps: Iterator[Any], name: str = "background") -> Future | None:
        """Queue a low-priority job (see the module docstring); returns at once. The Future
        resolves to the job's return value on the worker thread (its done-callbacks run
        there: keep them quick), holds its exception if it raised, and is cancelled if
        the job is dropped by drain or worker death. Returns None, counted ``dropped``,
        when the lane holds ``max_background`` jobs or the scheduler is draining or dead."""
        job = _Job(name, steps, Future())
        with self._cond:
            if self._dead is not None or self._draining or len(self._background) >= self.max_background:
                self._bg_counts["dropped"] += 1
                drop = True
            else:
                self._background.append(job)
                self._cond.notify()
                drop = False
        if drop:
            _close_quietly(job)
            return None
        return job.future

    def drain(self, timeout_s: float) -> None:
        """Stop accepting; drop background jobs; let queued and running requests finish for
        up to ``timeout_s``, then end the rest with DrainingError; stop the worker and flush
        the engine's background chunk writes. Blocks until done."""
        with self._cond:
            self._draining = True
            self._drain_until = time.perf_counter() + max(timeout_s, 0.0)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._end_all(DrainingError("the server shut down before this request ran"), "drained")
        self._drop_background()  # what a worker that never ran, or died, left
        self.engine.flush()

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the queue ahead, served max_running at a time."""
        waves = (len(self._waiting) + 1) / self.max_running
        return int(min(60, max(1, math.ceil(waves * self._service_s))))

    # -- the worker
    def _work(self) -> None:
        try:
            while self._next_turn():
                self._expire()
                self._admit_one()
                if self._running:
                    self._step()
                self._background_step()
        except BaseException as exc:  # noqa: BLE001 - the worker must report any death
            log.exception("model worker crashed")
            with self._cond:
                self._dead = f"{type(exc).__name__}: {exc}"
            self._end_all(WorkerDeadError("the model worker stopped on an internal error"), "worker_dead")
            self._drop_background()

    def _next_turn(self) -> bool:
        """Wait for work; False once draining has nothing left (or its time ran out).
        Draining drops the background lane at once."""
        with self._cond:
            while not self._running and not self._waiting and not self._background and not self._draining:
                self._cond.wait()
            draining = self._draining
        if draining:
            self._drop_background()
        with self._cond:
            past = self._drain_until is not None and time.perf_counter() >= self._drain_until
            if not self._draining or (not past and (self._running or self._waiting)):
                return True
        self._end_all(DrainingError("the server shut down before this request finished"), "drained")
        return False

    def _expire(self) -> None:
        """Drop cancelled and expired requests, queued or running."""
        now = time.perf_counter()
        with self._cond:
            gone = [h for h in self._waiting if h.cancelled or h.expired(now)]
            for h in gone:
                self._waiting.remove(h)
            left = [r for r in self._running if r.handle.cancelled or r.handle.expired(now)]
            self._running = [r for r in self._running if r not in left]
        for h in gone + [r.handle for r in left]:
            self._end_dropped(h)

    def _end_dropped(self, h: RequestHandle) -> None:
        if h.cancelled:
            self._end(h, "cancelled", None, RequestCancelledError(f"request {h.id} was cancelled"))
        else:
            self._end(h, "deadline", None, DeadlineExceededError(
                f"request {h.id} did not finish within its deadline of {h.deadline - h.submitted:.3g} s"))

    def _admit_one(self) -> None:
        with self._cond:
            if len(self._running) >= self.max_running or not self._waiting:
                return
            handle = self._waiting.popleft()
        handle.queue_s = time.perf_counter() - handle.submitted
        self._notify("on_admitted", handle)
        try:
            slot, event, stats = self._prefill(handle)
        except KvblendError as exc:
            self._end(handle, "error", None, exc)
            return
        except Exception:  # noqa: BLE001 - one request's internal failure ends that request only
            log.exception("request %s failed in prefill", handle.id)
            self._end(handle, "error", None, InternalRequestError(f"request {handle.id} failed on an internal error"))
            return
        handle.stats = stats._replace(ttft_s=time.perf_counter() - handle.submitted)
        self._emit(handle, event)
        handle._push(handle.stats)
        self._notify("on_first_token", handle, handle.stats)
        if event.finish_reason is not None:
            self._end(handle, "ok", event.finish_reason, None)
        else:
            with self._cond:
                self._running.append(_Running(handle, slot))

    def _prefill(self, handle: RequestHandle) -> tuple[DecodeSlot, StreamEvent, RequestStats]:
        """The request's prompt cache (by its method) and its first token."""
        prepared = self.engine.prepare(handle.request, handle.sampling.max_tokens)
        slot = DecodeSlot(self.engine.tokenizer, prepared.cache, handle.sampling, self.engine.loaded.eos_token_ids,
                          self.engine.model.cfg.context_length)
        return slot, slot.next_event(prepared.logits), prepared.stats

    def _step(self) -> None:
        """One batched decode step for every running request."""
        batch = list(self._running)
        t = time.perf_counter()
        logits = decode_batch(self.engine.model, [r.slot.last_token for r in batch], [r.slot.cache for r in batch])
        self._notify("on_step", len(batch), time.perf_counter() - t)
        finished = []
        for r, row in zip(batch, logits):  # row: (V,)
            event = r.slot.next_event(row)
            self._emit(r.handle, event)
            if event.finish_reason is not None:
                finished.append((r, event.finish_reason))
        if finished:
            with self._cond:
                done = {id(r) for r, _ in finished}
                self._running = [r for r in self._running if id(r) not in done]
            for r, reason in finished:
                self._end(r.handle, "ok", reason, None)

    def _background_step(self) -> None:
        """One step of the current background job, unless a request waits (or draining)."""
        with self._cond:
            if self._waiting or self._draining or not self._background:
                return
            job = self._background[0]
        try:
            next(job.steps)
            return
        except StopIteration as stop:
            outcome, value = "ok", stop.value
        except Exception as exc:  # noqa: BLE001 - a job's failure ends that job only
            log.exception("background job %s failed", job.name)
            outcome, value = "failed", exc
        with self._cond:
            self._background.popleft()
            self._bg_counts[outcome] += 1
        _settle(job.future, outcome, value)

    def _drop_background(self) -> None:
        """Drop every queued or running background job (drain, worker death)."""
        with self._cond:
            jobs = list(self._background)
            self._background.clear()
            self._bg_counts["dropped"] += len(jobs)
        for job in jobs:
            _close_quietly(job)
            job.future.cancel()

    def _emit(self, handle: RequestHandle, event: StreamEvent) -> None:
        handle.completion_tokens += 1
        handle._push(event)
        self._notify("on_token", handle, event, time.perf_counter())

    def _end(self, handle: RequestHandle, status: str, reason: str | None, error: Exception | None) -> None:
        e2e = time.perf_counter() - handle.submitted
        if status == "ok":
            self._service_s = 0.8 * self._service_s + 0.2 * (e2e - handle.queue_s)
        handle._push(_End(error))
        prompt = handle.stats.prompt_tokens if handle.stats else 0
        self._notify("on_finish", handle, Outcome(status, reason, prompt, handle.completion_tokens, handle.queue_s,
                                                  e2e, handle.stats, error))

    def _end_all(self, error: KvblendError, status: str) -> None:
        with self._cond:
            pending = list(self._waiting) + [r.handle for r in self._running]
            self._waiting.clear()
            self._running = []
        for h in pending:
            self._end(h, status, None, error)

    def _notify(self, hook: str, *args) -> None:
        try:
            getattr(self.observer, hook)(*args)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("scheduler observer %s failed", hook)


def _settle(future: Future, outcome: str, value: Any) -> None:
    """Resolve a background job's Future; a done-callback's error is logged by Future."""
    if outcome == "ok":
        future.set_result(value)
    else:
        future.set_exception(value)


def _close_quietly(job: _Job) -> None:
    """Close a dropped job's generator (its ``finally`` blocks run); never raises."""
    close = getattr(job.steps, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # noqa: BLE001 - a dropped job must not break drain
        log.exception("background job %s failed while being dropped", job.name)
