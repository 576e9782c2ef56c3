"""What crosses the hop between the ingress and a model replica (plain picklable data).

The first positional argument of every model-deployment method the ingress calls is a
``ModelCall``, a ``DocumentCall`` or a ``ShadowCall``; each carries ``route_keys``: one ``(chunk key string,
token count)`` per document (the key string is ``store.keys.ChunkKey``'s ``tenant/digest``,
so the tenant is part of it), which the request router reads
(``pending_request.args[0].route_keys``).

A streamed request answers ``Accepted`` once the replica's scheduler queued it, ``Started``
when it leaves that queue, ``Answering`` right before its first output, then the
scheduler's items (``StreamEvent``, ``RequestStats``) as they come, then ``Ended``; what
the replica charged its tenant (``Answering``: the prefill, then one decode token per
``StreamEvent`` after the first, ``Ended``: the totals) lets the ingress keep the
tenant's token rate across replicas (``engine.fair.TenantLedger``). A call cancelled
before its ``Ended`` (the client left) gets no more items: when the call names the
ingress's inbox, the replica sends the totals there as ``Settled`` (``cluster.settle``).
Errors never cross as exceptions: the replica sends a ``WireError`` (the error's class
name, message and Retry-After) and the ingress raises the same class again (``rebuild``),
so 429/503/504/400/500 keep their status and OpenAI shape across the hop.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvblend import errors as kvblend_errors
from kvblend.engine import scheduler as sched
from kvblend.engine.request import Request, Result
from kvblend.generation.sampling import SamplingParams

RouteKeys = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ModelCall:
    """A shaped chat/completion request for a replica's scheduler. ``reply_to``: the
    ingress's inbox for what the replica charged should the call be cancelled before its
    ``Ended`` (None: not wanted), and ``call`` its number there. ``avoid``: replica ids the
    router passes over while another runs (a call sent again after its replica was lost)."""

    route_keys: RouteKeys
    request: Request
    sampling: SamplingParams
    reply_to: str | None = None
    call: int = 0
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True)
class DocumentCall:
    """Document precompute: ``tenant``'s chunks (token ids) to compute after ``prefix`` on a
    replica's jobs lane and store (memory and the shared tiers). The replica keys them
    again (a key carries its model identities); ``route_keys`` are the ingress's keys."""

    route_keys: RouteKeys
    tenant: str
    chunks: tuple[tuple[int, ...], ...]
    prefix: tuple[int, ...]
    name: str


@dataclass(frozen=True)
class ShadowCall:
    """The quality guard's shadow check of a served request (``guard.shadow``), for a
    replica's background lane; routed by the request's documents, so it usually runs where
    they were served. ``served`` is the answer the client got; ``probe`` the blended request
    judged when the guard served full prefill instead."""

    route_keys: RouteKeys
    request: Request
    served: Result
    probe: Request | None
    background = True  # the router sends it to its documents whatever the loads, and does not count it


@dataclass(frozen=True)
class WireError:
    """An exception as data: its class name, message, Retry-After seconds (429s) and the
    request field at fault (a 400's ``param``)."""

    kind: str
    message: str
    retry_after_s: int | None = None
    field: str | None = None


@dataclass(frozen=True)
class Accepted:
    """The replica queued the request; ``replica`` is its Ray Serve replica id."""

    replica: str


@dataclass(frozen=True)
class Started:
    """The request left the replica's queue after ``queue_s`` seconds (sent then, so before
    its first output: a stream's last chunk reports it as one process's does)."""

    queue_s: float


@dataclass(frozen=True)
class Answering:
    """Sent right before the request's first output: its prefill is done, and its tenant
    was charged ``prefill_tokens`` for it (``FairQueue.charge``)."""

    prefill_tokens: float


@dataclass(frozen=True)
class Ended:
    """The request's end: the seconds it waited in the replica's queue, its error, and
    what its tenant was charged for it in all (prefill tokens, decode tokens); ``replica``:
    the replica's id on a refusal (sent instead of ``Accepted``)."""

    queue_s: float
    error: WireError | None = None
    prefill_tokens: float = 0.0
    decode_tokens: int = 0
    replica: str | None = None


@dataclass(frozen=True)
class Settled:
    """What the replica charged the tenant of call number ``call`` in all (``Ended``'s
    totals), once its request ended, for a call cancelled before its ``Ended``."""

    call: int
    prefill_tokens: float
    decode_tokens: int


# Errors rebuilt by class name; anything else is an internal error (a bare 500).
_KNOWN: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (
        sched.QueueFullError, sched.DrainingError, sched.DeadlineExceededError, sched.RequestCancelledError,
        sched.WorkerDeadError, sched.InternalRequestError, kvblend_errors.ContextLengthError,
        kvblend_errors.InvalidRequestError, kvblend_errors.NonFiniteLogitsError, kvblend_errors.EngineClosedError,
        kvblend_errors.ModelCheckError, kvblend_errors.UnsupportedModelError, kvblend_errors.KvblendError,
    )
}
INTERNAL = "InternalRequestError"


def to_wire(exc: BaseException) -> WireError:
    """``exc`` as data; an unexpected exception's message stays on the replica (the
    client gets the bare 500, as in one process). A subclass of a known error travels as
    the nearest known class (an ``InvalidRequestError`` of any kind stays a 400)."""
    kind = next((cls.__name__ for cls in type(exc).__mro__ if _KNOWN.get(cls.__name__) is cls), None)
    if kind is None:
        return WireError(INTERNAL, "internal server error (logged on the server)")
    retry = getattr(exc, "retry_after_s", None)
    field = getattr(exc, "field", None)
    return WireError(kind, str(exc), int(retry) if retry is not None else None,
                     field if isinstance(field, str) else None)


def rebuild(error: WireError) -> Exception:
    """The exception ``error`` describes, of the same class (``server.errors.from_exception``
    maps it to the same status as in one process)."""
    cls = _KNOWN.get(error.kind, sched.InternalRequestError)
    if cls is sched.QueueFullError:
        return sched.QueueFullError(error.message, error.retry_after_s or 1)
    if issubclass(cls, kvblend_errors.InvalidRequestError):
        return cls(error.message, error.field)
    return cls(error.message)


__all__ = ["Accepted", "Answering", "DocumentCall", "Ended", "ModelCall", "RouteKeys", "Settled", "ShadowCall", "Started",
           "WireError", "rebuild", "to_wire"]
