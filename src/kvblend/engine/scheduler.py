"""Continuous batching: one worker thread owns the model and serves many requests.

Contract (the HTTP server builds on exactly this)::

    sched = Scheduler(engine, max_running=8, max_queued=64, deadline_s=None, observer=None,
                      prefill_chunk_tokens=128, shares={tenant: TenantShare(...)})
    sched.start()                                # starts the single model-worker thread
    handle = sched.submit(request, sampling)     # QueueFullError (-> 429 + Retry-After),
                                                 # DrainingError (-> 503), WorkerDeadError (-> 503)
    for item in handle.events(): ...             # RequestStats, then StreamEvent...
                                                 # token's event; raises the request's error
    async for item in handle.aevents(): ...      # the same, for asyncio
    handle.cancel()                              # client gone: slot freed within one step
    handle.on_end(fn)                            # fn(handle) once it ended, its charges final
    future = sched.submit_job(steps, name)       # model work of the jobs lane (documents,
                                                 # write-back): QueueFullError when it is full
    job = sched.submit_background(steps)         # low-priority lane (shadow checks): a Future,
                                                 # or None when the lane is full (counted dropped)
    sched.drain(timeout_s)                       # stop accepting, finish, flush write-back
    sched.alive, sched.draining, sched.num_running, sched.num_waiting, sched.num_jobs,
    sched.num_background, sched.restarts

The worker is the model's one owner: requests, document precompute, write-back's chunk
KV and shadow checks all run on it, as step generators (``generation.chunked``). Each
loop turn:

* starts at most one request's prefill when fewer than ``max_running`` decode: the head
  of the tenant the fair queue picks (``engine.fair``: per-tenant queues, Virtual Token
  Counter, per-tenant caps and optional token rates). A prefill in progress is paused
  (its step generator simply not advanced; nothing is recomputed) when another tenant
  with no more service and nothing in flight waits (or one behind by over
  ``PAUSE_QUANTUM_TOKENS``), so a light tenant never waits for a heavy one's long prompt;
  a paused prefill resumes, in fair order, once no prefill runs. *Fair parts of the
  slots*: each active tenant is owed ``max_running`` x its weight / the active tenants'
  weights. When every slot is taken and the queue's next tenant is owed one, the tenant
  furthest over its part *parks* its newest decode (set aside with its cache and decode
  state; nothing recomputed) and the slot goes to the waiting tenant; parked decodes
  rejoin the batch, oldest first, as slots free up;
* runs one *slice* of model work, in this order of priority — the request being
  prefilled, the jobs lane, the background lane (only while no request waits). A full
  prefill's slice (``slice_tokens()``) is a ``Forward`` of ``prefill_chunk_tokens`` while
  nothing decodes (or only streams of tenants over their part of the slots or with
  requests waiting, and the prefill's tenant is within its part with none); beside
  streams it keeps their pace, so that a turn takes about ``stall_steps`` of their decode
  steps (measured), in one of two ways (``interleave``): a small ``Forward`` riding in the
  decode step's pass (slices), or an ``InPlace`` chunk run here layer by layer until the
  turn's time is spent (layers, the CPU's choice: a pass there has a large fixed cost that
  small slices never amortise). A fusion's slice is a group of its layers, bounded alike;
  a job's step the same; the jobs lane gets every fourth slice even while requests
  prefill, so it is never starved;
* runs ONE batched forward (``generation.batch.forward_batch``) over the decode token
  of every running request and the slice's ``Forward``, if any (slices: chunked prefill
  piggybacking decodes, Sarathi-Serve; with packed decode weights the decode tokens run as
  a pass of their own inside it, so that no token depends on what shares its step; layers:
  a decode-only step after the layers run in place), so a long prompt delays running
  streams by one turn, never by its whole prefill;
* samples each running request's next token (``DecodeSlot``: the same rules as
  ``Engine.stream``). A request of ``n`` choices is prefilled once and decodes as ``n``
  rows of the batch (choice 0 in the prepared cache, the others in forks that read its
  prompt positions in place, ``slot.fork_cache``), each row counting towards ``max_running`` (the server
  refuses an ``n`` above it); it ends
  with its last choice, or with the first choice that fails.

Faults stay with their request. Whatever one request raises — preparing (layout,
lookups, fusion), its part of a batched forward, sampling, stop handling — ends that
request alone with its KvblendError or an ``InternalRequestError`` (HTTP 500), counted by
stage in ``Outcome.stage``; a failed batched forward is run again member by member, so the
others get the tokens they would have got alone. A job that raises ends alone. If the
worker loop itself fails, a supervisor restarts it (``restarts``; the requests that were
running or prefilling end as internal errors, queued ones wait); after ``MAX_RESTARTS``
within ``RESTART_WINDOW_S`` it gives up: ``alive`` turns False and every pending request
gets ``WorkerDeadError``.

A cancelled request leaves the queue at once, or the batch before the next step; a
request past its deadline (queued time included) ends with ``DeadlineExceededError``.
Drain stops accepting, lets requests and the jobs lane (and the write-back computations
still pending) finish within its timeout, drops the background lane, then stops.

Observers (metrics) get callbacks on the worker thread; they must be quick and
thread-safe, and an exception they raise is logged and ignored.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import CancelledError, Future
from typing import Any, NamedTuple

import torch

from kvblend.engine.engine import Engine
from kvblend.engine.fair import FairQueue, TenantShare
from kvblend.engine.request import Request, RequestStats, Result, result_of
from kvblend.errors import InvalidRequestError, KvblendError
from kvblend.generation.batch import DecodeSlot, forward_batch
from kvblend.generation.slot import fork_cache
from kvblend.generation.chunked import Forward, InPlace, Steps
from kvblend.generation.sampling import SamplingParams
from kvblend.generation.stream import StreamEvent
from kvblend.models.transformer import LayerDone
from kvblend.store.writeback import ComputeRefused

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
    ``stats`` is None when the request never got its first token. ``stage`` names where an
    "error" happened: "prepare" (layout, lookups, prefill, fusion), "decode" (its part of a
    batched forward), "sample" (sampling, stop strings, EOS) or "worker" (the worker loop
    failed while the request ran)."""

    status: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    e2e_s: float  # submit -> end
    stats: RequestStats | None
    error: Exception | None
    stage: str | None = None


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

    def on_restart(self, error: BaseException) -> None:
        """The worker loop failed on ``error`` and the supervisor restarted it."""

    def on_job(self, lane: str, outcome: str) -> None:
        """A job of ``lane`` ("jobs" or "background") ended: "ok", "failed" or "dropped"."""

    def on_preempt(self, handle: RequestHandle) -> None:
        """The decoding request was parked to give its slot to a tenant owed one."""


# ----- handle -------------------------------------------------------------------------------
class _End(NamedTuple):
    error: Exception | None


class Admitted(NamedTuple):
    """The request left the queue after ``queue_s`` seconds: an item of
    ``aevents(admissions=True)`` only (a model replica tells its ingress: ``cluster.model``)."""

    queue_s: float


_ids = itertools.count(1)


class RequestHandle:
    """One submitted request: read its events, or cancel it.

    ``events()`` / ``aevents()`` may be read by one consumer, once. Items arrive as the
    worker produces them: the request's RequestStats right before the first token's
    event, then StreamEvents. The stream ends after the event with a ``finish_reason``, or
    raises the request's KvblendError (deadline, cancel, drain, worker death, invalid).
    ``replica`` names the model replica serving it: None here, in one process (the Ray
    Serve stand-in's handles set it). ``charged_prefill`` and ``charged_decode``: what its
    tenant was charged for it so far (``FairQueue.charge``), final once it ended
    (``on_end``: a callback then, for a caller that stopped reading).
    """

    replica: str | None = None

    def __init__(self, request: Request, sampling: SamplingParams, deadline_s: float | None) -> None:
        self.id = f"req-{next(_ids)}"
        self.request = request
        self.sampling = sampling
        self.submitted = time.perf_counter()
        self.deadline = None if deadline_s is None else self.submitted + deadline_s
        self.queue_s = 0.0  # set when the worker admits it
        self.completion_tokens = 0  # every choice's tokens
        self.choices_left = sampling.n  # choices still decoding (the worker's count)
        self.charged_prefill = 0.0
        self.charged_decode = 0
        self.stats: RequestStats | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aitems: asyncio.Queue | None = None
        self._ended = False
        self._on_end: list[Callable[[RequestHandle], None]] = []

    @property
    def tenant(self) -> str:
        return self.request.tenant

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

    def on_end(self, fn: Callable[[RequestHandle], None]) -> None:
        """Call ``fn(self)`` once the request has ended, its charges final: now if it has,
        else on the worker thread as it ends (keep ``fn`` short; what it raises is logged)."""
        with self._lock:
            if not self._ended:
                self._on_end.append(fn)
                return
        _call_logged(fn, self)

    # -- the worker side
    def _push(self, item: StreamEvent | RequestStats | _End) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = isinstance(item, _End)
            ended: list[Callable[[RequestHandle], None]] = []
            if self._ended:
                ended, self._on_end = self._on_end, []
            loop, aitems = self._loop, self._aitems
            if loop is None:
                self._items.put(item)
        if loop is not None:
            try:
                loop.call_soon_threadsafe(aitems.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody will read this
                self._cancelled.set()
        for fn in ended:
            _call_logged(fn, self)

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
            if not isinstance(item, Admitted):
                yield item

    async def aevents(self, admissions: bool = False) -> AsyncIterator[StreamEvent | RequestStats | Admitted]:
        """``events()`` for asyncio: the worker hands items to this loop thread-safely.
        ``admissions``: also an ``Admitted`` when the request leaves the queue."""
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
            if admissions or not isinstance(item, Admitted):
                yield item

    def result(self) -> Result:
        """Block until the request ends and return it whole (raises its error)."""
        return result_of(self.events())


def _call_logged(fn: Callable[[RequestHandle], None], handle: RequestHandle) -> None:
    try:
        fn(handle)
    except Exception:  # noqa: BLE001 - a caller's callback must not break the worker
        log.exception("a callback at the end of request %s failed", handle.id)


class _Running(NamedTuple):
    handle: RequestHandle
    slot: DecodeSlot
    prepared: Any  # the engine's ``Prepared``: its cache is the slot's


class _Task:
    """A step generator being run a slice at a time (``_Scheduler._slice``): ``reply`` is
    what its last step gets back, ``held`` a Forward it asked for that waits for the next
    turn (a slice that already did work in place does not also run a forward), ``done`` the
    tokens' worth of in-place work (token-layers over layers) not charged yet."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.reply: Any = None
        self.held: Forward | None = None
        self.done = 0.0

    def close(self) -> None:
        """Stop the generator (its ``finally`` blocks run); never raises."""
        try:
            self.steps.close()
        except Exception:  # noqa: BLE001 - a dropped task must not break the worker
            log.exception("closing a step generator failed")


class _Prefill(_Task):
    """A request between admission and its first token."""

    def __init__(self, handle: RequestHandle, steps: Steps) -> None:
        super().__init__(steps)
        self.handle = handle


class _Job(_Task):
    """A unit of model work in a lane, resolving ``future`` with its return value."""

    def __init__(self, name: str, steps: Steps, lane: str) -> None:
        super().__init__(steps)
        self.name = name
        self.lane = lane
        self.future: Future = Future()


class BackgroundStats(NamedTuple):
    """A lane's counters since the scheduler was made: jobs queued or running now, and jobs
    ended by outcome (ok; failed: the job raised; dropped: the lane was full, or drain or
    worker death dropped it)."""

    pending: int
    ok: int
    failed: int
    dropped: int


class _Lane:
    """A bounded FIFO of jobs; the head is the one being run."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.jobs: deque[_Job] = deque()
        self.counts = {"ok": 0, "failed": 0, "dropped": 0}

    def stats(self) -> BackgroundStats:
        return BackgroundStats(len(self.jobs), **self.counts)


MAX_RESTARTS = 5  # the supervisor gives up after this many loop failures ...
RESTART_WINDOW_S = 60.0  # ... within this many seconds
JOB_EVERY = 4  # the jobs lane gets at least every JOB_EVERY-th slice while requests prefill
DEFAULT_CHUNK_TOKENS = 1024  # nothing decodes: slices only bound how long a cancel or a job waits
FIRST_SLICE_TOKENS = 64  # streams decode but no step was measured yet
FIRST_LAYERED_TOKENS = 256  # an in-place chunk beside streams before a layer of one was measured
MIN_SLICE_TOKENS = 16  # below this a slice costs more in passes over the weights than it saves
# a prefill in progress steps aside for a tenant with work in flight only once that tenant
# is this many (weighted) tokens behind: VTC's own fairness bound is a batch's worth of tokens
PAUSE_QUANTUM_TOKENS = 1024.0
INTERLEAVE_MODES = ("auto", "layers", "slices")
# an in-place chunk is sized so that about this many of its layers fill a turn: smaller
# layers overshoot the turn less (in-process, 4k tokens beside a stream: max gap 254-279 ms
# at 3, 242-250 ms at 5)
UNITS_PER_TURN = 5
_clock = time.perf_counter  # the in-place budget's clock (tests drive it)
DEFAULT_STALL_STEPS = 3.0  # while streams decode, a turn with prefill work takes about this many decode steps
EWMA = 0.3


# ----- scheduler ------------------------------------------------------------------------------
class Scheduler:
    """Owns the engine's model on one worker thread; see the module docstring.

    ``deadline_s``: default per-request deadline in seconds (None: no deadline);
    ``max_queued``: waiting requests in all (a tenant below its fair part of it is still
    admitted: ``engine.fair``); ``shares``: per-tenant weight, queue cap and token rate;
    ``decode_weight``: what a decoded token counts in the fair queue, prefill tokens 1;
    ``prefill_chunk_tokens``: the largest prefill slice or in-place chunk (None: whole
    prefills, no interleaving); ``stall_steps``: while streams decode, a turn that carries
    prefill work takes about this many of their decode steps (> 1; longer turns finish a
    long prefill sooner and stall the streams longer: see ``slice_tokens``);
    ``interleave``: how that work keeps the streams' pace ("auto", "layers", "slices"; see
    ``slice_tokens``); ``max_jobs``/``max_background``: jobs queued or running at most in
    the jobs lane (more are refused) and the background lane (more are dropped)."""

    def __init__(self, engine: Engine, max_running: int = 8, max_queued: int = 64, deadline_s: float | None = None,
                 observer: SchedulerObserver | None = None, max_background: int = 16, *,
                 prefill_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, max_jobs: int = 32,
                 shares: dict[str, TenantShare] | None = None, decode_weight: float = 2.0,
                 stall_steps: float = DEFAULT_STALL_STEPS, interleave: str = "auto") -> None:
        _check_limits(max_running, max_queued, max_background, max_jobs, deadline_s, prefill_chunk_tokens)
        if not 1.0 < stall_steps < float("inf"):
            raise ValueError(f"stall_steps must be a number > 1, got {stall_steps}")
        self.stall_steps = stall_steps
        if interleave not in INTERLEAVE_MODES:
            raise ValueError(f"interleave must be one of {', '.join(INTERLEAVE_MODES)}, got {interleave!r}")
        self.in_place = interleave == "layers" or (interleave == "auto" and engine.model.device.type == "cpu")
        self._sync = engine.model.device.type == "cuda"
        self.engine = engine
        self.max_running = max_running
        self.max_queued = max_queued
        self.deadline_s = deadline_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.observer = observer or SchedulerObserver()
        self._cond = threading.Condition()
        self._queue: FairQueue[RequestHandle] = FairQueue(max_queued, shares, decode_weight)
        self._prefill: _Prefill | None = None
        self._paused: list[_Prefill] = []  # prefills set aside for a tenant with less service
        self._running: list[_Running] = []
        self._parked: list[_Running] = []  # decodes set aside for a tenant owed a slot (cache kept)
        self._thread: threading.Thread | None = None
        self._draining = False
        self._stopped = False  # the worker ended after a drain
        self._drain_until: float | None = None
        self._dead: str | None = None
        self._service_s = 1.0  # moving average of a request's time in the worker, for Retry-After
        self.max_background = max_background
        self._jobs = _Lane("jobs", max_jobs)
        self._background = _Lane("background", max_background)
        self._slices_since_job = 0
        self._failures: deque[float] = deque()  # when the worker loop failed, for the supervisor
        self.restarts = 0
        self._decode_s: float | None = None  # moving average of a decode-only step
        self._token_s: float | None = None  # moving average of a prefill slice's seconds per token
        self._last_slice = FIRST_SLICE_TOKENS  # tokens of the last slice run beside decoding streams
        self._layer_s: float | None = None  # moving average of an in-place prefill layer's seconds per token

    # -- state
    @property
    def alive(self) -> bool:
        """The worker thread runs and has not given up."""
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
        """Requests decoding or being prefilled (paused prefills included)."""
        return len(self._running) + (self._prefill is not None) + len(self._paused)

    @property
    def num_parked(self) -> int:
        """Decoding requests set aside (their cache kept) so another tenant gets its part of the slots."""
        return len(self._parked)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_jobs(self) -> int:
        """Jobs of the jobs lane (documents, write-back) queued or running now."""
        return len(self._jobs.jobs)

    @property
    def num_background(self) -> int:
        """Background jobs queued or running now."""
        return len(self._background.jobs)

    def background_stats(self) -> BackgroundStats:
        with self._cond:
            return self._background.stats()

    def job_stats(self) -> BackgroundStats:
        with self._cond:
            return self._jobs.stats()

    def tenant_counter(self, tenant: str) -> float:
        """The fair queue's service counter of ``tenant`` (weighted tokens)."""
        with self._cond:
            return self._queue.counter(tenant)

    # -- the caller side
    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the scheduler was already started")
        # from now on write-back's chunk KV is a job of the worker (not before: a scheduler that
        # never starts must not leave the engine's write-back waiting for it)
        self.engine.model_owner = self.run_job
        self.engine.slice_tokens = self.slice_tokens
        self._thread = threading.Thread(target=self._work, name="kvblend-worker", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sampling: SamplingParams, deadline_s: float | None = None) -> RequestHandle:
        """Queue a request; returns at once. ``deadline_s`` overrides the default deadline."""
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidRequestError(f"the deadline must be > 0 s, got {deadline_s}")
        handle = RequestHandle(request, sampling, deadline_s if deadline_s is not None else self.deadline_s)
        with self._cond:
            self._check_open()
            refusal = self._queue.check(request.tenant)
            if refusal is not None:
                raise QueueFullError(refusal.message, max(self._retry_after(), math.ceil(refusal.retry_after_s)))
            self._queue.push(request.tenant, handle)
            self._notify("on_queued", handle)  # before the worker can see it
            self._cond.notify()
        return handle

    def submit_job(self, steps: Steps, name: str = "job") -> Future:
        """Queue model work in the jobs lane, below requests and above the background lane
        (document precompute, write-back); returns at once. The Future resolves on the
        worker thread to the work's value, holds its exception, or is cancelled if drain
        or worker death drops it. QueueFullError when the lane holds ``max_jobs`` jobs;
        DrainingError / WorkerDeadError as ``submit``."""
        job = _Job(name, steps, "jobs")
        with self._cond:
            self._check_open(draining_ok=True)  # write-back still computes while a drain flushes it
            if len(self._jobs.jobs) >= self._jobs.limit:
                self._jobs.counts["dropped"] += 1
                refused = True
            else:
                self._jobs.jobs.append(job)
                self._cond.notify()
                refused = False
        if refused:
            job.close()
            self._notify("on_job", "jobs", "dropped")
            raise QueueFullError(f"the server is busy: {self._jobs.limit} model jobs are already waiting",
                                 self._retry_after())
        return job.future

    def run_job(self, steps: Steps, name: str = "job") -> Any:
        """``submit_job`` and wait for its value here (not on the worker thread); raises
        ComputeRefused when the lane refuses or drops it (the engine's write-back counts
        that chunk dropped), and whatever the job raised."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("run_job would wait for the worker on the worker itself")
        try:
            future = self.submit_job(steps, name)
        except (QueueFullError, DrainingError, WorkerDeadError) as exc:
            raise ComputeRefused(str(exc)) from None
        try:
            return future.result()
        except CancelledError:
            raise ComputeRefused(f"{name} was dropped by the model worker") from None

    def submit_background(self, steps: Steps, name: str = "background") -> Future | None:
        """Queue a low-priority job (shadow checks); returns at once. Like ``submit_job``,
        but it runs only while no request waits, and returns None, counted ``dropped``,
        when the lane holds ``max_background`` jobs or the scheduler is draining or dead."""
        job = _Job(name, steps, "background")
        with self._cond:
            drop = self._dead is not None or self._draining or len(self._background.jobs) >= self.max_background
            if drop:
                self._background.counts["dropped"] += 1
            else:
                self._background.jobs.append(job)
                self._cond.notify()
        if drop:
            job.close()
            self._notify("on_job", "background", "dropped")
            return None
        return job.future

    def drain(self, timeout_s: float) -> None:
        """Stop accepting; drop background jobs; let queued and running requests, the jobs
        lane and pending write-back finish for up to ``timeout_s``, then end the rest with
        DrainingError; stop the worker and flush the engine's chunk writes. Blocks."""
        with self._cond:
            self._draining = True
            self._drain_until = time.perf_counter() + max(timeout_s, 0.0)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._end_all(DrainingError("the server shut down before this request ran"), "drained")
        self._drop_lane(self._jobs)  # what a worker that never ran, or died, left
        self._drop_lane(self._background)
        self.engine.flush()

    def _check_open(self, draining_ok: bool = False) -> None:
        if self._dead is not None:
            raise WorkerDeadError("the model worker has stopped; this server cannot serve requests")
        if self._stopped or (self._draining and not draining_ok):
            raise DrainingError("the server is shutting down and takes no new requests")

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the queue ahead, served max_running at a time."""
        waves = (len(self._queue) + 1) / self.max_running
        return int(min(60, max(1, math.ceil(waves * self._service_s))))

    # -- the worker and its supervisor
    def _work(self) -> None:
        while True:
            try:
                self._loop()
                break
            except BaseException as exc:  # noqa: BLE001 - the supervisor must see any failure
                if not self._recover(exc):
                    break
        with self._cond:
            self._stopped = True
        if self.engine.model_owner == self.run_job:  # nobody owns the model now: the engine computes inline again
            self.engine.model_owner = None
        self._drop_lane(self._jobs)

    def _loop(self) -> None:
        while self._next_turn():
            self._turn()

    def _turn(self) -> None:
        self._expire()
        self._admit()
        forward, owner = self._slice()
        self._step(forward, owner)

    def _recover(self, exc: BaseException) -> bool:
        """After the loop failed: end what was in flight, and restart (True) unless it
        failed too often or was not an ordinary error; then the worker is dead."""
        log.exception("model worker loop failed")
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > RESTART_WINDOW_S:
            self._failures.popleft()
        self._end_in_flight(InternalRequestError("the model worker failed while serving this request"), "worker")
        if isinstance(exc, Exception) and len(self._failures) <= MAX_RESTARTS:
            self.restarts += 1
            self._notify("on_restart", exc)
            return True
        with self._cond:
            self._dead = f"{type(exc).__name__}: {exc}"
        self._end_all(WorkerDeadError("the model worker stopped on an internal error"), "worker_dead")
        self._drop_lane(self._jobs)
        self._drop_lane(self._background)
        return False

    def _next_turn(self) -> bool:
        """Wait for work; False once draining has nothing left (or its time ran out).
        Draining drops the background lane at once."""
        with self._cond:
            while not self._has_work() and not self._draining:
                self._cond.wait()
            draining = self._draining
        if draining:
            self._drop_lane(self._background)
        with self._cond:
            if not self._draining:
                return True
            past = self._drain_until is not None and time.perf_counter() >= self._drain_until
            if not past and (self._has_work() or self.engine.writeback_stats().pending):
                if not self._has_work():  # write-back is computing outside: let it hand us its job
                    self._cond.wait(0.01)
                return True
        self._end_all(DrainingError("the server shut down before this request finished"), "drained")
        return False

    def _has_work(self) -> bool:
        return bool(self._running or self._prefill or self._paused or self._parked or len(self._queue)
                    or self._jobs.jobs or self._background.jobs)

    def _expire(self) -> None:
        """Drop cancelled and expired requests: queued, prefilling or running."""
        now = time.perf_counter()
        with self._cond:
            gone = [h for h in self._queue if h.cancelled or h.expired(now)]
            for h in gone:
                self._queue.remove(h.tenant, h)
            left = [r for r in (*self._running, *self._parked) if r.handle.cancelled or r.handle.expired(now)]
            self._running = [r for r in self._running if r not in left]
            self._parked = [r for r in self._parked if r not in left]
            prefills = [p for p in (self._prefill, *self._paused)
                        if p is not None and (p.handle.cancelled or p.handle.expired(now))]
            if self._prefill in prefills:
                self._prefill = None
            self._paused = [p for p in self._paused if p not in prefills]
        for prefill in prefills:
            prefill.close()
            self._end_dropped(prefill.handle, started=True)
        for h in gone:
            self._end_dropped(h, started=False)
        for h in dict.fromkeys(r.handle for r in left):  # a request's choices end once
            self._end_dropped(h, started=True)

    def _end_dropped(self, h: RequestHandle, started: bool) -> None:
        if h.cancelled:
            self._end(h, "cancelled", None, RequestCancelledError(f"request {h.id} was cancelled"), started=started)
        else:
            self._end(h, "deadline", None, DeadlineExceededError(
                f"request {h.id} did not finish within its deadline of {h.deadline - h.submitted:.3g} s"),
                started=started)

    def _admit(self) -> None:
        """Start the next request's prefill (fair order) when a slot is free: pausing the
        prefill in progress when another tenant with less service waits (or one owed a part
        of the slots, while the prefill's tenant holds more than its part), resuming a paused
        one (fair order among them and the queue) when none is in progress. Parked decodes
        go back into the batch first, unless the slot is owed to a waiting tenant; when every
        slot is taken, a tenant over its part gives one up to a waiting tenant under its own
        (``_park``)."""
        with self._cond:
            self._unpark()
            if self.num_running >= self.max_running and not self._park():
                if self._prefill is None and self._paused:  # slots all taken: finish what was set aside
                    self._prefill = self._resumed()
                return
            head = self._queue.head()
            if self._prefill is not None:
                if head is None or not self._preempts(head, self._prefill.handle.tenant):
                    return
                self._paused.append(self._prefill)  # another tenant with less service waits
                self._prefill = None
            elif self._paused:
                lowest = min(self._paused, key=lambda p: self._queue.counter(p.handle.tenant)).handle.tenant
                if head is None or not self._preempts(head, lowest):
                    self._prefill = self._resumed()
                    return
            picked = self._queue.pop()
            if picked is None:
                return
            handle = picked[1]
            steps = self.engine.prepare_steps(handle.request, handle.sampling.max_tokens,
                                              functools.partial(self.slice_tokens, handle.tenant))
            self._prefill = _Prefill(handle, steps)
        handle.queue_s = time.perf_counter() - handle.submitted
        handle._push(Admitted(handle.queue_s))
        self._notify("on_admitted", handle)

    # -- fair parts of the slots
    def _slots(self) -> tuple[Counter, dict[str, float]]:
        """Slots held per tenant (decoding, prefilling or paused; parked decodes hold none)
        and each active tenant's fair part of ``max_running`` by weight (active: holding a
        slot, parked or waiting). Call with the lock held."""
        held = Counter(r.handle.tenant for r in self._running)
        held.update(p.handle.tenant for p in (self._prefill, *self._paused) if p is not None)
        active = {*held, *(r.handle.tenant for r in self._parked), *self._queue.backlogged()}
        total = sum(self._queue.weight(t) for t in active) or 1.0
        return held, {t: self.max_running * self._queue.weight(t) / total for t in active}

    def _owed(self, tenant: str, held: Counter, parts: dict[str, float]) -> bool:
        """One more slot keeps ``tenant`` within its fair part."""
        return held[tenant] + 1 <= parts.get(tenant, 0.0)

    def _preempts(self, waiting: str, holder: str) -> bool:
        """A request of tenant ``waiting`` goes before ``holder``'s prefill: ``waiting`` has had
        no more service and nothing in flight (a newcomer is lifted to the least-served busy
        tenant's level, so it ties), or less service by over PAUSE_QUANTUM_TOKENS (two
        tenants' prefills would otherwise take turns slice by slice, each finishing in
        twice its time), or it is owed a slot while ``holder`` holds more than its part."""
        waiting_at, holder_at = self._queue.counter(waiting), self._queue.counter(holder)
        newcomer = not self._queue.active(waiting) and waiting_at <= holder_at
        if newcomer or waiting_at + PAUSE_QUANTUM_TOKENS < holder_at:
            return True
        held, parts = self._slots()
        return waiting != holder and self._owed(waiting, held, parts) and held[holder] > parts.get(holder, 0.0)

    def _park(self) -> bool:
        """Every slot is taken: when the tenant the fair queue serves next is owed a slot, set
        aside the newest decode of the tenant furthest over its part (its cache and decode
        state kept, nothing recomputed), freeing a slot; True when one was freed."""
        head = self._queue.head()
        if head is None or self._prefill is not None:
            return False
        held, parts = self._slots()
        if not self._owed(head, held, parts):
            return False
        over = [t for t in held if t != head and held[t] > parts.get(t, 0.0)]
        if not over:
            return False
        tenant = max(over, key=lambda t: held[t] - parts[t])
        victim = next((r for r in reversed(self._running) if r.handle.tenant == tenant), None)
        if victim is None:
            return False
        self._running.remove(victim)
        self._parked.append(victim)
        self._notify("on_preempt", victim.handle)
        return True

    def _unpark(self) -> None:
        """Put parked decodes back into the batch (oldest first) while slots are free, unless
        the fair queue's next tenant is owed the slot and the parked one's tenant is not."""
        while self._parked and self.num_running < self.max_running:
            parked = self._parked[0].handle.tenant
            head = self._queue.head()
            if head is not None and head != parked:
                held, parts = self._slots()
                if self._owed(head, held, parts) and not self._owed(parked, held, parts):
                    return
            self._running.append(self._parked.pop(0))

    def _resumed(self) -> _Prefill:
        """Take the paused prefill whose tenant has had the least service (the oldest among
        equals). Call with the lock held and ``_paused`` non-empty."""
        best = min(range(len(self._paused)), key=lambda i: self._queue.counter(self._paused[i].handle.tenant))
        return self._paused.pop(best)

    # -- slices
    def _slice(self) -> tuple[Forward | None, _Task | None]:
        """Run one slice of the most urgent model work; the Forward it asks for, to run in
        this turn's batch, and its task."""
        task = self._pick()
        if task is None:
            return None, None
        try:
            forward = self._advance(task)
        except StopIteration as stop:
            self._charge_work(task, None)
            self._completed(task, stop.value)
            return None, None
        except Exception as exc:  # noqa: BLE001 - one task's failure ends that task only
            self._failed(task, exc)
            return None, None
        self._charge_work(task, forward)
        return forward, task

    def _charge_work(self, task: _Task, forward: Forward | None) -> None:
        """Charge a prefill's tenant for this turn's work: what it did in place (to the
        fraction of a token) and the forward it asks for."""
        work, task.done = task.done, 0.0
        if isinstance(task, _Prefill):
            self._charge(task.handle, prefill=work + (forward.ids.shape[0] if forward is not None else 0))

    def _pick(self) -> _Task | None:
        """The task that gets this turn's slice: the request being prefilled, except that
        the jobs lane gets every JOB_EVERY-th slice; then the jobs lane; then, when no
        request waits, the background lane."""
        with self._cond:
            jobs = self._jobs.jobs[0] if self._jobs.jobs else None
            if self._prefill is not None and (jobs is None or self._slices_since_job < JOB_EVERY - 1):
                self._slices_since_job += 1
                return self._prefill
            self._slices_since_job = 0
            if jobs is not None:
                return jobs
            if self._background.jobs and not len(self._queue) and not self._draining:
                return self._background.jobs[0]
        return None

    def _advance(self, task: _Task) -> Forward | None:
        """Step ``task`` until it asks for a forward, or its in-place work reaches the turn's
        budget; the forward (None: none). The in-place work adds to ``task.done``. Raises
        StopIteration with the task's value when it ends.

        The budget: while streams decode at a pace this task must keep (``_paced``), in-place
        work stops before the next step would pass ``stall_steps - 1`` decode steps (each
        step is predicted to take what the last one did), so the turn with the decode step
        after it takes about ``stall_steps`` (until a decode step is measured,
        FIRST_SLICE_TOKENS token-layers per layer); otherwise ``prefill_chunk_tokens``
        token-layers per layer bound how long a cancel or a job waits."""
        if task.held is not None:
            forward, task.held = task.held, None
            return forward
        layers = len(self.engine.model.layers)
        tenant = task.handle.tenant if isinstance(task, _Prefill) else None
        limit_s = self._turn_limit_s(tenant)
        paced_unmeasured = self._paced(tenant) and limit_s is None
        budget = (FIRST_SLICE_TOKENS if paced_unmeasured else (self.prefill_chunk_tokens or 1 << 62)) * layers
        done, spent = 0, 0.0
        while True:
            t = self._now()
            step = task.steps.send(task.reply)
            took = self._now() - t
            task.reply = None
            if isinstance(step, Forward):
                if done:
                    task.held = step
                    return None
                return step
            if step is None:
                return None
            done += int(step)
            task.done += int(step) / layers
            spent += took
            if isinstance(step, LayerDone) and step.inner and step > 0:
                self._layer_s = _ewma(self._layer_s, took / int(step))
            if done >= budget or (limit_s is not None and spent + took > limit_s):
                return None

    def _now(self) -> float:
        """The clock that times in-place work: on an accelerator, after the queued kernels
        ran (else it would time their launch)."""
        if self._sync:
            torch.cuda.synchronize(self.engine.model.device)
        return _clock()

    def _turn_limit_s(self, tenant: str | None) -> float | None:
        """Seconds of in-place work one turn may take beside streams that ``tenant``'s work
        must keep pace with (None: no limit, or no decode step measured yet)."""
        if self._decode_s is None or not self._paced(tenant):
            return None
        return (self.stall_steps - 1.0) * self._decode_s

    def _completed(self, task: _Task, value: Any) -> None:
        if isinstance(task, _Prefill):
            self._prefilled(task, value)
        else:
            self._job_done(task, "ok", value)

    def _failed(self, task: _Task, exc: Exception) -> None:
        """``task`` raised ``exc`` (or its forward did): it ends alone."""
        task.close()
        if isinstance(task, _Prefill):
            with self._cond:
                if self._prefill is task:
                    self._prefill = None
            self._end_failed(task.handle, exc, "prepare")
            return
        if not isinstance(exc, KvblendError):
            log.error("%s job %s failed", task.lane, task.name, exc_info=exc)
        self._job_done(task, "failed", exc)

    def _prefilled(self, task: _Prefill, prepared: Any) -> None:
        """The prompt is ready: sample the first token, and decode from the next turn."""
        handle = task.handle
        with self._cond:
            self._prefill = None
        try:
            slots = self._choices(handle, prepared)
            events = [slot.next_event(prepared.logits) for slot in slots]
        except Exception as exc:  # noqa: BLE001 - this request's sampling failed: it alone ends
            self._end_failed(handle, exc, "sample", started=True)
            return
        handle.stats = prepared.stats._replace(ttft_s=time.perf_counter() - handle.submitted, choices=len(slots))
        handle._push(handle.stats)  # before the first token: its sender knows the usage
        for event in events:
            self._emit(handle, event)
        self._notify("on_first_token", handle, handle.stats)
        going = [_Running(handle, slot, prepared) for slot, event in zip(slots, events) if event.finish_reason is None]
        handle.choices_left = len(going)
        if not going:
            self._end(handle, "ok", events[0].finish_reason, None)
        else:
            with self._cond:
                self._running.extend(going)

    def _choices(self, handle: RequestHandle, prepared: Any) -> list[DecodeSlot]:
        """One ``DecodeSlot`` per choice of the request (``sampling.n``) after its one
        prefill: choice 0 decodes in the prepared cache, each other in a fork that reads its
        prompt positions in place (``fork_cache``: no copy of the prompt's KV)."""
        sampling, ids = handle.sampling, prepared.layout.ids
        room = sampling.max_tokens + 1
        caches = [prepared.cache] + [fork_cache(prepared.cache, room) for _ in range(sampling.n - 1)]
        return [DecodeSlot(self.engine.tokenizer, cache, sampling, self.engine.loaded.eos_token_ids,
                           self.engine.model.cfg.context_length, ids, index=i) for i, cache in enumerate(caches)]

    def _job_done(self, job: _Job, outcome: str, value: Any) -> None:
        lane = self._jobs if job.lane == "jobs" else self._background
        with self._cond:
            if lane.jobs and lane.jobs[0] is job:
                lane.jobs.popleft()
            lane.counts[outcome] += 1
        _settle(job.future, outcome, value)
        self._notify("on_job", job.lane, outcome)

    # -- the batched step
    def _step(self, forward: Forward | None, owner: _Task | None) -> None:
        """One forward over every running request's next token and ``forward`` (owner's
        slice), then one sampled token per running request."""
        batch = list(self._running)
        members = [Forward(torch.tensor([r.slot.last_token], device=self.engine.model.device), r.slot.cache)
                   for r in batch]
        if forward is not None:
            members.append(forward)
        if not members:
            return
        t = time.perf_counter()
        outs = self._forward(members)
        elapsed = time.perf_counter() - t
        self._measure(elapsed, len(batch), forward)
        if batch:
            self._notify("on_step", len(batch), elapsed)
        if forward is not None:
            self._deliver(owner, outs[-1])
        finished = []
        for r, out in zip(batch, outs):
            reason = self._sample(r, out)
            if reason is not None:
                finished.append((r, reason))
        if finished:
            with self._cond:
                done = {id(r) for r, _ in finished}
                self._running = [r for r in self._running if id(r) not in done and not r.handle.done]
                self._parked = [r for r in self._parked if not r.handle.done]  # a failed choice's siblings
            for r, reason in finished:
                if reason == "failed" or r.handle.done:
                    continue
                if r.slot.index == 0:  # its prompt and answer enter the prefix cache: a chat's next turn reuses both
                    self.engine.remember_answer(r.handle.request, r.prepared, r.slot.tokens)
                r.handle.choices_left -= 1
                if r.handle.choices_left == 0:  # the request ends with its last choice
                    self._end(r.handle, "ok", reason, None)

    def _forward(self, members: list[Forward]) -> list[torch.Tensor | Exception]:
        """``forward_batch`` over the members; when it fails, each member alone, so that a
        failure stays with the member that causes it (its exception in its place). A
        failed batch changed no cache's length, so each member runs from where it was."""
        try:
            return forward_batch(self.engine.model, members)
        except Exception:  # noqa: BLE001 - isolate below
            log.warning("a batched forward of %d members failed; running them one by one", len(members),
                        exc_info=True)
        outs: list[torch.Tensor | Exception] = []
        for m in members:
            try:
                outs.append(forward_batch(self.engine.model, [m])[0])
            except Exception as exc:  # noqa: BLE001 - this member's own failure
                outs.append(exc)
        return outs

    def slice_tokens(self, tenant: str | None = None) -> int | InPlace | None:
        """The next prefill slice (of ``tenant``'s request; None: other model work), as
        ``forward_chunks`` asks: ``prefill_chunk_tokens`` while nothing decodes (large: small
        slices cost a pass over the weights each, and would only slow it), or while every
        decoding stream belongs to a tenant holding more than its fair part of the slots or
        with requests waiting, and ``tenant`` holds no more than its own and has none waiting
        (``_unguarded``: the streams of a tenant asking for more than its share do not slow
        down one within it). Else the prefill keeps the streams' pace: a step (or a turn)
        that carries it takes about ``stall_steps`` of their decode steps, so a running
        stream's gaps stay that multiple of its steady pace whatever the device. None: no
        slicing.

        Two ways to keep the pace, by ``interleave``. *Slices* (Sarathi-Serve; "slices", and
        "auto" off the CPU): a ``Forward`` of as many tokens as fit, run in the same pass as
        the decode tokens. A step costs about a decode step d plus c per slice token, so a
        gap of g decode steps allows (g - 1) d / c tokens. *In place* ("layers", and "auto"
        on a CPU): ``InPlace`` chunks sized so that a layer of one takes about a fifth of
        the turn, run layer by layer until the turn's time is spent (``_advance``), then a
        decode-only step. On a CPU a pass costs a fixed ~d (the weights, once per forward:
        measured 84-87 ms for 1 token, 171-180 ms for 16 at 2k-6k tokens of context, for
        82 ms per decode step) plus the tokens' work, and a small slice never amortises it:
        16-token slices ran at 1.7x the per-token cost of a 256-token chunk. Either way an
        N-token prefill beside streams takes about g / (g - 1) its time alone at best
        (``benchmarks/interference.py --stall-steps`` measures both)."""
        top = self.prefill_chunk_tokens
        if not self._paced(tenant):
            return top
        if self.in_place:
            limit_s = self._turn_limit_s(tenant)
            if limit_s is None or self._layer_s is None:  # not measured yet
                return InPlace(min(top, FIRST_LAYERED_TOKENS))
            fit = int(limit_s / (UNITS_PER_TURN * max(self._layer_s, 1e-9)))
            return InPlace(max(min(MIN_SLICE_TOKENS, top), min(top, fit)))
        if self._decode_s is None or self._token_s is None:  # not measured yet: stay small
            return min(top, FIRST_SLICE_TOKENS)
        fit = int((self.stall_steps - 1.0) * self._decode_s / max(self._token_s, 1e-9))
        fit = min(fit, 2 * self._last_slice)  # grow at most 2x a slice: one noisy measure cannot make a long stall
        return max(min(MIN_SLICE_TOKENS, top), min(top, fit))

    def _paced(self, tenant: str | None) -> bool:
        """Streams decode, and ``tenant``'s work (None: a job's) must keep their pace."""
        return self.prefill_chunk_tokens is not None and bool(self._running) and not self._unguarded(tenant)

    def _unguarded(self, tenant: str | None) -> bool:
        """``tenant``'s prefill need not keep the running streams' pace: it holds no more
        than its fair part of the slots and has nothing waiting, and every stream's tenant
        holds more than its own part or has requests waiting (it asks for more than it is
        served: its streams' pace yields to a tenant within its share, for at most one
        ``prefill_chunk_tokens`` step at a time)."""
        if tenant is None:
            return False
        with self._cond:
            held, parts = self._slots()
            streams = {r.handle.tenant for r in self._running}
            waiting = {t for t in streams | {tenant} if self._queue.waiting(t)}
        return (tenant not in streams and tenant not in waiting and held[tenant] <= parts.get(tenant, 0.0)
                and all(held[t] > parts.get(t, 0.0) or t in waiting for t in streams))

    def _measure(self, elapsed: float, decoding: int, forward: Forward | None) -> None:
        """Update the moving averages that size slices: a decode-only step's time, and a
        slice's time per token (its step less the decode part)."""
        if forward is None:
            if decoding:
                self._decode_s = _ewma(self._decode_s, elapsed)
            return
        tokens = int(forward.ids.shape[0])
        if decoding:
            self._last_slice = tokens
        if tokens >= MIN_SLICE_TOKENS:
            own = elapsed - (self._decode_s or 0.0) if decoding else elapsed
            self._token_s = _ewma(self._token_s, max(own, 0.0) / tokens)

    def _deliver(self, owner: _Task | None, out: torch.Tensor | Exception) -> None:
        """Hand a slice's logits to its task (or fail the task on its forward's error)."""
        if owner is None:
            return
        if isinstance(out, Exception):
            self._failed(owner, out)
            return
        owner.reply = out

    def _sample(self, r: _Running, out: torch.Tensor | Exception) -> str | None:
        """Sample ``r``'s next token from its logits; its finish reason, "failed" when it
        ended on an error (ended here), None while it goes on."""
        if isinstance(out, Exception):
            self._end_failed(r.handle, out, "decode", started=True)
            return "failed"
        try:
            event = r.slot.next_event(out[0])
        except Exception as exc:  # noqa: BLE001 - sampling or stop handling failed for this request
            self._end_failed(r.handle, exc, "sample", started=True)
            return "failed"
        self._emit(r.handle, event)
        self._charge(r.handle, decode=1)
        return event.finish_reason

    # -- endings
    def _drop_lane(self, lane: _Lane) -> None:
        """Drop every queued or running job of ``lane`` (drain, worker death)."""
        with self._cond:
            jobs = list(lane.jobs)
            lane.jobs.clear()
            lane.counts["dropped"] += len(jobs)
        for job in jobs:
            job.close()
            job.future.cancel()
            self._notify("on_job", lane.name, "dropped")

    def _emit(self, handle: RequestHandle, event: StreamEvent) -> None:
        handle.completion_tokens += 1
        handle._push(event)
        self._notify("on_token", handle, event, time.perf_counter())

    def _charge(self, handle: RequestHandle, prefill: float = 0.0, decode: int = 0) -> None:
        handle.charged_prefill += prefill
        handle.charged_decode += decode
        with self._cond:
            self._queue.charge(handle.tenant, prefill, decode)

    def _end_failed(self, handle: RequestHandle, exc: Exception, stage: str, started: bool = True) -> None:
        """End a request on its own error: a KvblendError as it is, anything else as an
        InternalRequestError (the cause logged, never sent)."""
        if not isinstance(exc, KvblendError):
            log.error("request %s failed in %s", handle.id, stage, exc_info=exc)
            exc = InternalRequestError(f"request {handle.id} failed on an internal error")
        self._end(handle, "error", None, exc, stage=stage, started=started)

    def _end(self, handle: RequestHandle, status: str, reason: str | None, error: Exception | None,
             stage: str | None = None, started: bool = True) -> None:
        e2e = time.perf_counter() - handle.submitted
        if status == "ok":
            self._service_s = 0.8 * self._service_s + 0.2 * (e2e - handle.queue_s)
        if started:
            with self._cond:
                self._queue.ended(handle.tenant)
        handle._push(_End(error))
        prompt = handle.stats.prompt_tokens if handle.stats else 0
        self._notify("on_finish", handle, Outcome(status, reason, prompt, handle.completion_tokens, handle.queue_s,
                                                  e2e, handle.stats, error, stage))

    def _take_in_flight(self) -> list[RequestHandle]:
        """Remove and return the requests running or being prefilled (their generator closed)."""
        with self._cond:
            handles = list(dict.fromkeys(r.handle for r in (*self._running, *self._parked)))  # choices: once
            prefills = [p for p in (self._prefill, *self._paused) if p is not None]
            self._prefill, self._paused, self._running, self._parked = None, [], [], []
        for prefill in prefills:
            prefill.close()
            handles.append(prefill.handle)
        return handles

    def _end_in_flight(self, error: Exception, stage: str) -> None:
        """End the requests running or being prefilled (the worker loop failed under them)."""
        for h in self._take_in_flight():
            self._end(h, "error", None, error, stage=stage)

    def _end_all(self, error: KvblendError, status: str) -> None:
        with self._cond:
            waiting = self._queue.drain_all()
        for h in waiting:
            self._end(h, status, None, error, started=False)
        for h in self._take_in_flight():
            self._end(h, status, None, error)

    def _notify(self, hook: str, *args) -> None:
        try:
            getattr(self.observer, hook)(*args)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("scheduler observer %s failed", hook)


def _check_limits(max_running: int, max_queued: int, max_background: int, max_jobs: int,
                  deadline_s: float | None, prefill_chunk_tokens: int | None) -> None:
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    if max_queued < 1:
        raise ValueError(f"max_queued must be >= 1, got {max_queued}")
    if max_background < 0:
        raise ValueError(f"max_background must be >= 0, got {max_background}")
    if max_jobs < 1:
        raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
        raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


def _settle(future: Future, outcome: str, value: Any) -> None:
    """Resolve a job's Future; a done-callback's error is logged by Future."""
    if future.done():
        return
    if outcome == "ok":
        future.set_result(value)
    else:
        future.set_exception(value)
