from __future__ import annotations

from kvblend.store.keys import chunk_key
from kvblend.store.policy import LFUPolicy, LRUPolicy, SightingsAdmission, make_policy

from tests.store.helpers import make_ctx


def keys(n: int, tenant: str = "default") -> list:
    return [chunk_key((i,), make_ctx(tenant)) for i in range(n)]


def test_lru_orders_by_last_use_per_tenant() -> None:
    policy = LRUPolicy()
    a, b, c = keys(3)
    other = keys(1, "bob")[0]
    for k in (a, b, c, other):
        policy.insert(k)
    policy.touch(a)
    assert list(policy.order("default")) == [b, c, a]
    assert list(policy.order("bob")) == [other]
    policy.remove(c)
    assert list(policy.order("default")) == [b, a] and list(policy.order("nobody")) == []


def test_lfu_orders_by_hits_then_age() -> None:
    policy = make_policy("lfu")
    assert isinstance(policy, LFUPolicy)
    a, b, c = keys(3)
    for k in (a, b, c):
        policy.insert(k)
    policy.touch(a)
    policy.touch(a)
    policy.touch(c)
    assert list(policy.order("default")) == [b, c, a]


def test_admission_counts_sightings_and_stays_bounded() -> None:
    admission = SightingsAdmission(2, max_tracked=2)
    a, b, c = keys(3)
    assert not admission.admit(a) and admission.admit(a)
    assert not admission.admit(a)  # counting starts over once admitted
    assert not admission.admit(b) and not admission.admit(c)  # tracks at most 2: a is forgotten
    assert not admission.admit(a) and admission.admit(c)
    assert all(SightingsAdmission(1).admit(k) for k in (a, b, c))


def test_a_sighting_admits_once_and_the_put_uses_it_up() -> None:
    admission = SightingsAdmission(3)
    a = keys(1)[0]
    assert [admission.sight(a) for _ in range(4)] == [False, False, True, True]  # stays admitted
    assert admission.admit(a)  # the put uses the admission up
    assert not admission.sight(a)  # counting starts over
