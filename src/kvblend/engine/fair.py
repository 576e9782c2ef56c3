"""Fair shares of the model worker between tenants: per-tenant queues served by a Virtual
Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24).

Each tenant has a counter of the service it received: the tokens the model computed for
it, prefill and decode, each divided by the tenant's weight (a decode token counts
``decode_weight`` prefill tokens). Reused input tokens are charged by what they cost:
only the tokens fusion recomputed count, so a blended request's cached documents are
nearly free. The next request to start is the head of the backlogged tenant with the
smallest counter, so two backlogged tenants' service never drifts apart by more than
about one request's worth (the paper's bound), and a tenant alone gets everything
(work-conserving). A tenant that becomes backlogged again is lifted to the smallest
counter of the tenants being served, so being idle earns no credit to starve others later.

Admission (``check``) bounds each tenant's queue (its ``max_queued``) and the total
(``max_queued`` of the scheduler) — but a tenant below its fair part of the total
(total / tenants waiting) is still admitted when the total is full, so a tenant that
floods gets the 429s and the others do not. An optional token rate per tenant refuses a
tenant whose bucket is empty until it refills.

``TenantLedger`` keeps a tenant's own two limits (its ``max_queued`` and ``tokens_per_s``)
where every request enters but none is computed: a Ray Serve ingress in front of several
model replicas (``cluster.remote``), each of which has a ``FairQueue`` seeing only its own
part of a tenant's requests. It applies the same rules, with the same messages, to the
requests it was told of: queued until a replica starts them, and charged what the
replicas computed for them.

Not thread-safe: the scheduler holds its lock around every call.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")
BURST_S = 10.0  # a token bucket holds this many seconds of its rate


class TenantShare(NamedTuple):
    """One tenant's terms: relative ``weight`` (> 0), its own queue cap (None: the
    scheduler's), and a rate of computed tokens per second (None: unlimited)."""

    weight: float = 1.0
    max_queued: int | None = None
    tokens_per_s: float | None = None


class Refusal(NamedTuple):
    """Why a tenant's request is not queued, and when to retry (seconds)."""

    message: str
    retry_after_s: float


@dataclass
class _Tenant(Generic[T]):
    share: TenantShare
    waiting: deque = field(default_factory=deque)
    counter: float = 0.0
    active: int = 0  # requests started and not yet ended
    bucket: float = 0.0
    refilled: float = field(default_factory=lambda: time.monotonic())


class FairQueue(Generic[T]):
    """Waiting items per tenant, started in Virtual Token Counter order (module docstring)."""

    def __init__(self, max_queued: int, shares: dict[str, TenantShare] | None = None,
                 decode_weight: float = 2.0) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if decode_weight <= 0:
            raise ValueError(f"decode_weight must be > 0, got {decode_weight}")
        for name, share in (shares or {}).items():
            _check_share(name, share)
        self.max_queued = max_queued
        self.decode_weight = decode_weight
        self._shares = dict(shares or {})
        self._tenants: dict[str, _Tenant[T]] = {}
        self._floor = 0.0  # where a tenant re-enters when nobody is busy: the last level served

    # -- state
    def __len__(self) -> int:
        return sum(len(t.waiting) for t in self._tenants.values())

    def __iter__(self):
        for t in self._tenants.values():
            yield from t.waiting

    def waiting(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return len(t.waiting) if t else 0

    def counter(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return t.counter if t else 0.0

    def active(self, tenant: str) -> int:
        """The tenant's requests started and not yet ended."""
        t = self._tenants.get(tenant)
        return t.active if t else 0

    def weight(self, tenant: str) -> float:
        """The tenant's relative weight (its ``TenantShare``; 1 when it has none)."""
        return self._shares.get(tenant, TenantShare()).weight

    def backlogged(self) -> list[str]:
        """The tenants with requests waiting."""
        return [name for name, t in self._tenants.items() if t.waiting]

    # -- admission
    def check(self, tenant: str) -> Refusal | None:
        """Why a new request of ``tenant`` cannot wait now (None: it can)."""
        t = self._tenant(tenant)
        cap = t.share.max_queued if t.share.max_queued is not None else self.max_queued
        if len(t.waiting) >= cap:
            return _queue_full(len(t.waiting))
        total = len(self)
        if total >= self.max_queued:
            backlogged = sum(1 for x in self._tenants.values() if x.waiting) + (0 if t.waiting else 1)
            if len(t.waiting) >= self.max_queued / backlogged:
                return Refusal(f"the server is busy: {total} requests are already waiting", 1.0)
        return _over_rate(t)

    def push(self, tenant: str, item: T) -> None:
        """Queue ``item`` (after ``check`` said yes); lifts a tenant that was idle."""
        t = self._tenant(tenant)
        if not t.waiting and not t.active:
            t.counter = max(t.counter, self._lowest_busy(default=self._floor))
        t.waiting.append(item)

    def head(self) -> str | None:
        """The tenant ``pop`` would serve next (None when nothing waits)."""
        best = None
        for name, t in self._tenants.items():
            if t.waiting and (best is None or (t.counter, t.active > 0) < (self._tenants[best].counter,
                                                                           self._tenants[best].active > 0)):
                best = name
        return best

    def pop(self) -> tuple[str, T] | None:
        """The next item to start: the head of the backlogged tenant with the smallest
        counter (ties: one with nothing in flight, as a tenant arriving is lifted to the
        least-served busy tenant's level and would otherwise wait behind it; then the one
        first seen). None when nothing waits."""
        best = self.head()
        if best is None:
            return None
        t = self._tenants[best]
        t.active += 1
        self._floor = t.counter
        return best, t.waiting.popleft()

    def remove(self, tenant: str, item: T) -> bool:
        """Take a waiting item out (cancelled, expired); False when it is not waiting."""
        t = self._tenants.get(tenant)
        if t is None or item not in t.waiting:
            return False
        t.waiting.remove(item)
        return True

    def drain_all(self) -> list[T]:
        """Every waiting item, removed."""
        out = [item for t in self._tenants.values() for item in t.waiting]
        for t in self._tenants.values():
            t.waiting.clear()
        return out

    # -- accounting
    def charge(self, tenant: str, prefill_tokens: float = 0.0, decode_tokens: int = 0) -> None:
        """Count service given to ``tenant``: tokens computed for its prompts (recomputed
        token-layers over the layer count, for fusion) and tokens it decoded."""
        t = self._tenant(tenant)
        cost = _cost(prefill_tokens, decode_tokens, self.decode_weight)
        t.counter += cost / t.share.weight
        _spend(t, cost)

    def ended(self, tenant: str) -> None:
        """One started request of ``tenant`` ended."""
        t = self._tenant(tenant)
        t.active = max(0, t.active - 1)
        if not t.active and not t.waiting:  # idle now: whoever arrives next starts no lower
            self._floor = max(self._floor, t.counter)

    # -- helpers
    def _tenant(self, name: str) -> _Tenant[T]:
        t = self._tenants.get(name)
        if t is None:
            share = self._shares.get(name, TenantShare())
            t = self._tenants[name] = _Tenant(share, bucket=_burst(share))
        return t

    def _lowest_busy(self, default: float) -> float:
        busy = [t.counter for t in self._tenants.values() if t.waiting or t.active]
        return min(busy, default=default)


@dataclass
class _Account:
    """A tenant's state in a ``TenantLedger``: its requests waiting and its token bucket."""

    share: TenantShare
    waiting: int = 0
    bucket: float = 0.0
    refilled: float = field(default_factory=lambda: time.monotonic())


class TenantLedger:
    """Each tenant's own queue cap and token rate over requests computed elsewhere (see
    the module docstring). For every request: ``check`` (a ``Refusal``, or None: send it),
    then ``queued``; ``left`` once, when it leaves the queue (started, or ended without
    starting); ``charge`` with what was computed for it, as ``FairQueue.charge`` is.

    ``parts``: how many ledgers share the tenants' limits (one per ingress, each seeing
    its own part of the traffic): each keeps ``max_queued / parts`` (rounded up, at least
    1) and ``tokens_per_s / parts``. Tenants with neither limit are not tracked. Not
    thread-safe: the caller holds a lock around every call."""

    def __init__(self, shares: dict[str, TenantShare] | None = None, decode_weight: float = 2.0,
                 parts: int = 1) -> None:
        if decode_weight <= 0:
            raise ValueError(f"decode_weight must be > 0, got {decode_weight}")
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        self.decode_weight = decode_weight
        self.parts = parts
        self._accounts: dict[str, _Account] = {}
        for name, share in (shares or {}).items():
            _check_share(name, share)
            if share.max_queued is None and share.tokens_per_s is None:
                continue
            mine = share._replace(
                max_queued=None if share.max_queued is None else max(1, math.ceil(share.max_queued / parts)),
                tokens_per_s=None if share.tokens_per_s is None else share.tokens_per_s / parts)
            self._accounts[name] = _Account(mine, bucket=_burst(mine))

    def share(self, tenant: str) -> TenantShare | None:
        """The limits this ledger keeps for ``tenant`` (its part of them); None: none."""
        a = self._accounts.get(tenant)
        return a.share if a else None

    def waiting(self, tenant: str) -> int:
        a = self._accounts.get(tenant)
        return a.waiting if a else 0

    def check(self, tenant: str) -> Refusal | None:
        """Why a new request of ``tenant`` cannot be sent now (None: it can)."""
        a = self._accounts.get(tenant)
        if a is None:
            return None
        if a.share.max_queued is not None and a.waiting >= a.share.max_queued:
            return _queue_full(a.waiting)
        return _over_rate(a)

    def queued(self, tenant: str) -> None:
        """A request of ``tenant`` was sent (after ``check`` said yes): it waits."""
        a = self._accounts.get(tenant)
        if a is not None:
            a.waiting += 1

    def left(self, tenant: str) -> None:
        """A request of ``tenant`` left the queue: started, or ended (refused, failed,
        cancelled) before it started. Once per ``queued``."""
        a = self._accounts.get(tenant)
        if a is not None:
            a.waiting = max(0, a.waiting - 1)

    def charge(self, tenant: str, prefill_tokens: float = 0.0, decode_tokens: int = 0) -> None:
        """Take what was computed for ``tenant`` from its bucket (``FairQueue.charge``'s cost)."""
        a = self._accounts.get(tenant)
        if a is not None:
            _spend(a, _cost(prefill_tokens, decode_tokens, self.decode_weight))


def _cost(prefill_tokens: float, decode_tokens: int, decode_weight: float) -> float:
    return prefill_tokens + decode_weight * decode_tokens


def _queue_full(waiting: int) -> Refusal:
    return Refusal(f"tenant has {waiting} requests waiting, its limit", 1.0)


def _over_rate(t: _Tenant | _Account) -> Refusal | None:
    """A tenant's refusal while its bucket is below zero (None without a rate)."""
    rate = t.share.tokens_per_s
    if rate is not None:
        _refill(t, rate)
        if t.bucket < 0:
            return Refusal("tenant is over its token rate", -t.bucket / rate)
    return None


def _spend(t: _Tenant | _Account, cost: float) -> None:
    if t.share.tokens_per_s is not None:
        _refill(t, t.share.tokens_per_s)
        t.bucket -= cost


def _refill(t: _Tenant | _Account, rate: float) -> None:
    now = time.monotonic()
    t.bucket = min(rate * BURST_S, t.bucket + max(0.0, now - t.refilled) * rate)
    t.refilled = now


def _burst(share: TenantShare) -> float:
    return 0.0 if share.tokens_per_s is None else share.tokens_per_s * BURST_S


def _check_share(name: str, share: TenantShare) -> None:
    if not (share.weight > 0 and math.isfinite(share.weight)):
        raise ValueError(f"tenant {name!r}: weight must be a finite number > 0, got {share.weight}")
    if share.max_queued is not None and share.max_queued < 1:
        raise ValueError(f"tenant {name!r}: max_queued must be >= 1, got {share.max_queued}")
    if share.tokens_per_s is not None and not (share.tokens_per_s > 0 and math.isfinite(share.tokens_per_s)):
        raise ValueError(f"tenant {name!r}: tokens_per_s must be a finite number > 0, got {share.tokens_per_s}")


__all__ = ["FairQueue", "Refusal", "TenantLedger", "TenantShare"]
