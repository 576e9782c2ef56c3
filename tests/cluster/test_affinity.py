"""Document affinity as pure logic: the resident summary, rendezvous hashing, the ranking."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from kvblend.cluster.affinity import (
    MAX_BITS,
    MAX_ROUTE_KEYS,
    ReplicaState,
    ResidentSummary,
    filter_size,
    load_cap,
    normalize_route_keys,
    rank_replicas,
    rendezvous_owner,
)
from kvblend.store.keys import KeyContext, chunk_key


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i:064x}" for i in range(n)]


# --- ResidentSummary ----------------------------------------------------------------


def test_summary_holds_every_key_it_was_built_from_and_estimates_their_count() -> None:
    held = keys("acme", 2000)
    s = ResidentSummary.from_keys(held + held[:100])  # repeats are one key
    assert all(k in s for k in held)
    assert abs(len(s) - 2000) < 100
    assert 1 not in s and None not in s


def test_false_positive_rate_stays_near_its_target() -> None:
    s = ResidentSummary.from_keys(keys("acme", 5000), fp_rate=0.01)
    probes = keys("other", 20000)
    rate = sum(k in s for k in probes) / len(probes)
    assert rate < 0.02  # target 1 %; 20k probes put the observed rate within ±0.3 %
    assert s.expected_fp_rate < 0.015


def test_summary_size_follows_the_key_count_and_is_bounded() -> None:
    small, big = filter_size(100, 0.01), filter_size(10_000, 0.01)
    assert small[0] < 1200 and 95_000 < big[0] < 97_000  # ~9.6 bits per key at 1 %
    assert small[1] == big[1] == 7
    assert filter_size(10**9, 0.01)[0] == MAX_BITS
    empty = ResidentSummary.from_keys([])
    assert len(empty) == 0 and "acme/x" not in empty


def test_summary_round_trips_through_json_and_pickle() -> None:
    s = ResidentSummary.from_keys(keys("acme", 300))
    back = ResidentSummary.from_dict(json.loads(json.dumps(s.to_dict())))
    again = ResidentSummary.from_dict(pickle.loads(pickle.dumps(s.to_dict())))
    assert back.bits == again.bits == s.bits and (back.m, back.k) == (s.m, s.k)
    assert all(k in back for k in keys("acme", 300))


def _malformed() -> list[object]:
    good = ResidentSummary.from_keys(keys("acme", 50)).to_dict()
    short = dict(good, bits=good["bits"][:-4])
    return [
        None, [], "bits", {}, dict(good, v=2), dict(good, v=True), dict(good, extra=1),
        {k: v for k, v in good.items() if k != "k"}, dict(good, m=good["m"] + 1), dict(good, m=8 * MAX_BITS),
        dict(good, m=str(good["m"])), dict(good, k=0), dict(good, k=99), dict(good, k=1.0), short,
        dict(good, bits="!" * len(good["bits"])), dict(good, bits=good["bits"].encode()),
        dict(good, bits=good["bits"][:-2] + "=="),  # right length, one byte short once decoded
    ]


@pytest.mark.parametrize("bad", _malformed())
def test_malformed_summaries_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        ResidentSummary.from_dict(bad)


def test_two_tenants_identical_documents_are_different_keys() -> None:
    ctx = dict(model_fingerprint="m", tokenizer_fingerprint="t", rope='{"rope_theta": 10000}', kv_dtype="fp16")
    doc = list(range(40))
    a = str(chunk_key(doc, KeyContext(tenant="acme", **ctx)))
    b = str(chunk_key(doc, KeyContext(tenant="globex", **ctx)))
    assert a != b and a.split("/")[1] != b.split("/")[1]  # the digest differs, not only the prefix
    held_by_acme = ResidentSummary.from_keys([a])
    assert a in held_by_acme and b not in held_by_acme
    # globex's request for the same text: acme's copy counts for nothing, placement alone decides
    replicas = [ReplicaState("r0", held_by_acme, 0), ReplicaState("r1", ResidentSummary.from_keys([]), 0)]
    r = rank_replicas(((b, 500),), replicas)
    assert r.first == rendezvous_owner(b, ["r0", "r1"]) and sorted(r.scores.values()) == [0, 500]


# --- rendezvous hashing -------------------------------------------------------------


def test_rendezvous_owner_ignores_order_and_moves_about_one_nth_of_keys() -> None:
    ks = keys("acme", 4000)
    four = ["r0", "r1", "r2", "r3"]
    before = {k: rendezvous_owner(k, four) for k in ks}
    assert before == {k: rendezvous_owner(k, list(reversed(four))) for k in ks}
    assert all(600 < sum(o == r for o in before.values()) < 1400 for r in four)

    five = {k: rendezvous_owner(k, four + ["r4"]) for k in ks}
    moved = [k for k in ks if five[k] != before[k]]
    assert all(five[k] == "r4" for k in moved)  # a newcomer only takes keys
    assert 0.15 < len(moved) / len(ks) < 0.25  # ~1/5

    three = {k: rendezvous_owner(k, ["r0", "r2", "r3"]) for k in ks}
    moved = [k for k in ks if three[k] != before[k]]
    assert {before[k] for k in moved} == {"r1"}  # only the leaver's keys move
    assert 0.2 < len(moved) / len(ks) < 0.3  # ~1/4
    assert rendezvous_owner("k", []) is None


# --- the ranking --------------------------------------------------------------------


def test_the_replica_holding_most_document_tokens_ranks_first() -> None:
    d1, d2, d3 = keys("acme", 3)
    replicas = [
        ReplicaState("a", ResidentSummary.from_keys([d1]), 0),
        ReplicaState("b", ResidentSummary.from_keys([d2, d3]), 0),
        ReplicaState("c", ResidentSummary.from_keys([]), 0),
    ]
    r = rank_replicas(((d1, 900), (d2, 200), (d3, 200)), replicas)
    assert (r.reason, r.first) == ("affinity", "a")
    assert r.scores == {"a": 900, "b": 400, "c": 0}
    assert r.ranks[1] == ("b", "c")
    r = rank_replicas(((d1, 100), (d2, 200), (d3, 200)), replicas)
    assert r.first == "b"


def test_unheld_documents_go_to_their_rendezvous_owner_weighted_by_tokens() -> None:
    ids = ["a", "b", "c"]
    empty = [ReplicaState(i, ResidentSummary.from_keys([]), 0) for i in ids]
    unheld = keys("acme", 60)
    for k in unheld:
        assert rank_replicas(((k, 300),), empty).first == rendezvous_owner(k, ids)
    # several unheld documents: the owner of the most tokens wins
    big, small1, small2 = next(
        (x, y, z) for x, y, z in zip(unheld, unheld[1:], unheld[2:])
        if rendezvous_owner(y, ids) == rendezvous_owner(z, ids) != rendezvous_owner(x, ids)
    )
    assert rank_replicas(((big, 1000), (small1, 300), (small2, 300)), empty).first == rendezvous_owner(big, ids)
    assert rank_replicas(((big, 500), (small1, 300), (small2, 300)), empty).first == rendezvous_owner(small1, ids)
    # replicas without stats still own their share: same placement as with empty summaries
    blind = [ReplicaState(i) for i in ids]
    assert all(rank_replicas(((k, 300),), blind).first == rendezvous_owner(k, ids) for k in unheld[:20])


def test_ties_are_broken_by_the_documents_not_by_load() -> None:
    ids = ["a", "b"]
    ks = keys("acme", 40)
    x, y = next((x, y) for x, y in zip(ks, ks[1:]) if rendezvous_owner(x, ids) != rendezvous_owner(y, ids))
    request = ((x, 256), (y, 256))  # 256 tokens placed on each replica: a tie
    firsts = {
        rank_replicas(request, [ReplicaState("a", None, load_a), ReplicaState("b", None, load_b)], load_factor=2.0).first
        for load_a, load_b in ((0, 1), (1, 0), (1, 1), (None, 1))  # all under the load bound
    }
    assert firsts == {rendezvous_owner(max(x, y), ids)}  # the same replica whatever the loads


def test_a_replica_at_the_load_bound_hands_the_request_to_the_next_in_affinity_order() -> None:
    d = keys("acme", 1)[0]
    e = keys("acme", 2)[1]
    holds, holds_e = ResidentSummary.from_keys([d]), ResidentSummary.from_keys([e])
    request = ((d, 100), (e, 50))  # affinity order: a (100 tokens held), b (50), c (none)

    def states(load_a: int, load_b: int = 1) -> list[ReplicaState]:
        return [ReplicaState("a", holds, load_a), ReplicaState("b", holds_e, load_b), ReplicaState("c", None, 0)]

    # 3 replicas, loads a + b + 0 (+1 this request): the bound is ceil(1.25 x (a + b + 1) / 3)
    assert load_cap(states(2), 1.25) == 2 and load_cap(states(1), 1.25) == 2
    r = rank_replicas(request, states(1), load_factor=1.25)
    assert (r.first, r.reason) == ("a", "affinity")  # 1 < 2: a takes it
    r = rank_replicas(request, states(2), load_factor=1.25)
    assert (r.reason, r.ranks) == ("load", (("b",), ("a", "c")))  # a at the bound: the next in order
    assert rank_replicas(request, states(2), load_factor=2.0).first == "a"  # ceil(2 x 4 / 3) = 3
    assert rank_replicas(request, states(3, load_b=3), load_factor=1.25).first == "c"  # cap ceil(1.25 x 7 / 3) = 3: a and b at it
    # unknown loads are never bounded, and no known load means no bound
    assert rank_replicas(((d, 100),), [ReplicaState("a", holds), ReplicaState("b", None, 0)]).first == "a"
    assert load_cap([ReplicaState("a", holds), ReplicaState("b")], 1.25) is None
    # 1.0: least loaded first, the affinity order deciding among the least
    assert rank_replicas(request, states(1), load_factor=1.0).first == "c"  # loads 1, 1, 0: cap ceil(3 / 3) = 1
    assert rank_replicas(request, states(0, load_b=0), load_factor=1.0).first == "a"


def test_the_least_loaded_replica_is_always_under_the_bound() -> None:
    rng = random.Random(5)
    ks = keys("acme", 8)
    for _ in range(300):
        n = rng.randint(1, 5)
        states = [ReplicaState(f"r{i}", ResidentSummary.from_keys(rng.sample(ks, 3)), rng.randint(0, 9)) for i in range(n)]
        factor = rng.choice((1.0, 1.25, 2.0))
        cap = load_cap(states, factor)
        assert min(s.load for s in states) < cap
        r = rank_replicas(((rng.choice(ks), 50),), states, load_factor=factor)
        chosen = next(s for s in states if s.id == r.first)
        assert chosen.load < cap
        if factor == 1.0 and n == 2:  # the bound is the mean: of two, the less loaded (ties: affinity)
            assert chosen.load == min(s.load for s in states)


def test_requests_without_usable_keys_go_by_load() -> None:
    replicas = [ReplicaState(i, None, load) for i, load in (("a", 3), ("b", 0), ("c", 7))]
    for bad in (None, (), "acme/x", (("acme/x",),), (("acme/x", -1),), (("acme/x", 1.5),), ((7, 10),), (("", 10),)):
        r = rank_replicas(bad, replicas, rng=random.Random(1))
        assert r.reason == "no-keys" and len(r.ranks) == 1 and len(r.ranks[0]) == 2
        loads = {s.id: s.load for s in replicas}
        assert loads[r.ranks[0][0]] <= loads[r.ranks[0][1]]
    assert rank_replicas((("acme/x", 0),), replicas).reason == "no-keys"  # zero tokens: nothing to score
    assert rank_replicas((("acme/x", 5),), []).ranks == ()


def test_saturated_summary_claims_nothing() -> None:
    d = keys("acme", 1)[0]
    full = ResidentSummary(b"\xff" * 8, 64, 3)
    assert d in full and full.expected_fp_rate == 1.0
    r = rank_replicas(((d, 100),), [ReplicaState("a", full, 0), ReplicaState("b", full, 0)])
    assert r.first == rendezvous_owner(d, ["a", "b"]) and sum(r.scores.values()) == 100


def test_route_keys_are_bounded_and_deduplicated() -> None:
    many = tuple((k, 1) for k in keys("acme", MAX_ROUTE_KEYS + 50))
    assert len(normalize_route_keys(many)) == MAX_ROUTE_KEYS
    assert normalize_route_keys([["acme/a", 3], ("acme/a", 9), ("acme/b", 1)]) == (("acme/a", 3), ("acme/b", 1))
    assert normalize_route_keys((("acme/a", True),)) is None
    assert normalize_route_keys((("x" * 600, 1),)) is None
