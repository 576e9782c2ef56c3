"""``engine.fair.TenantLedger``: a tenant's own queue cap and token rate, kept where its
requests enter (a Ray Serve ingress) while replicas compute them; the same rules and
messages as ``FairQueue``'s, no Ray needed."""

from __future__ import annotations

import pytest

import kvblend.engine.fair as fair
from kvblend.engine.fair import FairQueue, TenantLedger, TenantShare


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(fair.time, "monotonic", lambda: now[0])
    return now


def test_the_queue_cap_counts_requests_until_they_leave_the_queue() -> None:
    ledger = TenantLedger({"capped": TenantShare(max_queued=2)})
    for _ in range(2):
        assert ledger.check("capped") is None
        ledger.queued("capped")
    refusal = ledger.check("capped")
    assert refusal is not None and refusal.message == "tenant has 2 requests waiting, its limit"
    queue: FairQueue[str] = FairQueue(8, {"capped": TenantShare(max_queued=2)})
    queue.push("capped", "a")
    queue.push("capped", "b")
    assert refusal == queue.check("capped")  # what one process answers
    ledger.left("capped")  # one started on a replica: it no longer waits
    assert ledger.check("capped") is None
    assert ledger.check("anyone") is None and ledger.waiting("anyone") == 0  # no limits: not tracked


def test_a_request_that_ends_in_error_before_it_starts_frees_its_place() -> None:
    ledger = TenantLedger({"capped": TenantShare(max_queued=1)})
    ledger.queued("capped")
    assert ledger.check("capped") is not None
    ledger.left("capped")  # refused by the replica, failed or cancelled while waiting
    assert ledger.waiting("capped") == 0 and ledger.check("capped") is None
    ledger.left("capped")  # never below zero
    assert ledger.waiting("capped") == 0


def test_the_token_rate_refuses_with_the_fair_queues_message_and_retry_after(clock) -> None:
    ledger = TenantLedger({"metered": TenantShare(tokens_per_s=10.0)}, decode_weight=2.0)
    queue: FairQueue[str] = FairQueue(64, {"metered": TenantShare(tokens_per_s=10.0)}, decode_weight=2.0)
    assert ledger.check("metered") is None
    for limits in (ledger, queue):
        limits.charge("metered", prefill_tokens=130, decode_tokens=10)  # 150 against a 100-token burst
    refusal = ledger.check("metered")
    assert refusal == queue.check("metered")
    assert refusal.message == "tenant is over its token rate" and refusal.retry_after_s == pytest.approx(5.0)
    clock[0] += 6.0
    assert ledger.check("metered") is None


def test_each_of_several_ingresses_keeps_its_part_of_the_limits(clock) -> None:
    shares = {"t": TenantShare(weight=3.0, max_queued=3, tokens_per_s=10.0), "one": TenantShare(max_queued=1)}
    ledger = TenantLedger(shares, parts=2)
    assert ledger.share("t") == TenantShare(weight=3.0, max_queued=2, tokens_per_s=5.0)  # 3 / 2 rounded up
    assert ledger.share("one").max_queued == 1  # never below one
    ledger.charge("t", prefill_tokens=60)  # a 50-token burst (5 tokens/s over 10 s), 10 over
    assert ledger.check("t").retry_after_s == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [dict(max_queued=0), dict(tokens_per_s=float("inf"))])
def test_invalid_limits_and_parts_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        TenantLedger({"t": TenantShare(**bad)})
    with pytest.raises(ValueError):
        TenantLedger({}, parts=0)
