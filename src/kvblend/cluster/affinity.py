"""Document affinity: which replica should serve a request, from the documents it needs.

Pure logic (no Ray): the Ray Serve router (``kvblend.cluster.router``) feeds it what it
knows about each replica and maps the answer back onto Ray's replica objects.

- :class:`ResidentSummary` — a Bloom filter of a replica's resident chunk keys, sized from
  the key count for a target false-positive rate. A Bloom filter rather than the key set:
  a key is ``tenant/sha256hex`` (70+ bytes), a filter entry ~10 bits at 1 % false
  positives, and the summary travels from every replica through the Serve controller to
  every ingress every few seconds. A false positive costs one misrouted request (a miss
  on that replica, recomputed, never a wrong answer), so exactness buys nothing.
- :func:`rendezvous_owner` — highest-random-weight hashing of a key over replica ids:
  when a replica joins or leaves, only the keys it wins or held move (~1/N of them).
- :func:`rank_replicas` — the ranking. Each replica scores the document tokens it holds
  (per its summary) plus the tokens of the documents no replica holds whose rendezvous
  owner it is, so a document's first computation lands where later requests for it go:
  the *affinity order*. Loads are bounded as in consistent hashing with bounded loads
  (Mirrokni, Thorup and Zadimoghaddam, SODA '18): no replica takes a request that would
  put it above ``load_factor`` x the mean load (the router's measure, requests not
  answering yet; this one included; rounded up), so the request goes to the first
  replica in affinity order under that cap. A popular document then spills to the replica next in its order and is held by
  both, while the rest stay where they are: the memory tiers keep their split of the
  documents and no replica's queue grows past the bound. With nothing to score, the
  choice is power of two choices (two random replicas, the less loaded first).

Knobs: the summary's ``fp_rate`` (replica side) and the router's ``load_factor``. The
default 1.25, the paper's usual choice, lets a replica run one request or so ahead of the
mean, which keeps documents sticky and tolerates a load figure one request stale (a
router learns of answers from reports and ends, not at once). 1.0 sends a request to the
replica holding its documents only while no other replica has fewer requests waiting for
their first token: a shorter tail, fewer memory hits (docs/results.md, issue #22: with 2
replicas and 4 clients, 1.25 gave 1.3-1.7x Ray's router's memory hit rate and ~1.2x its
p95 TTFT; 1.0 gave 1.16x and 0.96x).
Keys carry the tenant (``store.keys.ChunkKey``: the tenant is hashed into the digest and
prefixes it), so two tenants' identical documents are different keys and routing one
tenant's request depends on nothing another tenant stored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

DEFAULT_FP_RATE = 0.01
MIN_BITS = 64
MAX_BITS = 1 << 23  # 1 MiB of filter: ~870k keys at 1 %; beyond that the false-positive rate rises
MAX_HASHES = 16
SUMMARY_VERSION = 1
# A summary whose measured fill says more than this fraction of random keys would test
# positive is treated as absent: a saturated filter would claim every document.
MAX_TRUSTED_FP = 0.25

DEFAULT_LOAD_FACTOR = 1.25
MAX_LOAD_FACTOR = 64.0
MAX_ROUTE_KEYS = 256  # documents considered per request (a request's document count is bounded before this)
MAX_KEY_CHARS = 512
MAX_DOC_TOKENS = 1 << 24


def _digest_pair(key: str) -> tuple[int, int]:
    """Two independent 64-bit hashes of ``key`` (double hashing gives the k probe positions)."""
    d = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16, person=b"kvblend-bloom").digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1


def filter_size(n: int, fp_rate: float) -> tuple[int, int]:
    """``(bits, hashes)`` of a Bloom filter for ``n`` keys at ``fp_rate``: m = -n ln p / ln²2,
    k = (m/n) ln 2; bits a multiple of 8 within ``[MIN_BITS, MAX_BITS]``."""
    if not 0.0 < fp_rate < 1.0:
        raise ValueError(f"fp_rate must be in (0, 1); got {fp_rate!r}")
    n = max(1, n)
    bits = math.ceil(-n * math.log(fp_rate) / math.log(2) ** 2)
    bits = min(MAX_BITS, max(MIN_BITS, -(-bits // 8) * 8))
    hashes = min(MAX_HASHES, max(1, round(bits / n * math.log(2))))
    return bits, hashes


@dataclass(frozen=True, eq=False)
class ResidentSummary:
    """A Bloom filter of chunk keys: ``key in s`` is never False for a key it was built
    from, and True for another key with probability about ``expected_fp_rate``.

    Immutable once built; ``to_dict`` / ``from_dict`` round-trip it through JSON or
    pickle (``{"v", "m", "k", "bits"}``, bits base64, at most ``MAX_BITS / 8`` bytes).
    """

    bits: bytes
    m: int
    k: int
    _ones: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (MIN_BITS <= self.m <= MAX_BITS and self.m % 8 == 0) or len(self.bits) != self.m // 8:
            raise ValueError(f"a summary needs {MIN_BITS}..{MAX_BITS} bits, a multiple of 8, as m/8 bytes")
        if not 1 <= self.k <= MAX_HASHES:
            raise ValueError(f"a summary uses 1..{MAX_HASHES} hashes; got {self.k}")
        object.__setattr__(self, "_ones", int.from_bytes(self.bits, "little").bit_count())

    @classmethod
    def from_keys(cls, keys: Iterable[str], *, fp_rate: float = DEFAULT_FP_RATE) -> ResidentSummary:
        """The summary of ``keys`` (deduplicated), sized for their count at ``fp_rate``."""
        distinct = set(keys)
        m, k = filter_size(len(distinct), fp_rate)
        buf = bytearray(m // 8)
        for key in distinct:
            for pos in _positions(key, m, k):
                buf[pos >> 3] |= 1 << (pos & 7)
        return cls(bytes(buf), m, k)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return all(self.bits[pos >> 3] >> (pos & 7) & 1 for pos in _positions(key, self.m, self.k))

    def __len__(self) -> int:
        """Estimated number of distinct keys, from the fill: n ≈ -(m/k) ln(1 - ones/m)."""
        if self._ones >= self.m:
            return self.m
        return round(-self.m / self.k * math.log1p(-self._ones / self.m))

    @property
    def expected_fp_rate(self) -> float:
        """Probability that a key never added tests positive, from the measured fill."""
        return (self._ones / self.m) ** self.k

    def to_dict(self) -> dict[str, object]:
        return {"v": SUMMARY_VERSION, "m": self.m, "k": self.k, "bits": base64.b64encode(self.bits).decode("ascii")}

    @classmethod
    def from_dict(cls, d: object) -> ResidentSummary:
        """Inverse of ``to_dict``; ValueError for anything else (wrong version, sizes, bits)."""
        if not isinstance(d, Mapping) or set(d) != {"v", "m", "k", "bits"}:
            raise ValueError("a summary is a mapping with exactly v, m, k, bits")
        v, m, k, text = d["v"], d["m"], d["k"], d["bits"]
        if v != SUMMARY_VERSION or type(v) is not int:
            raise ValueError(f"unknown summary version {v!r}")
        if type(m) is not int or type(k) is not int:
            raise ValueError("m and k must be integers")
        if not isinstance(text, str) or not MIN_BITS <= m <= MAX_BITS or len(text) != 4 * -(-m // 24):
            raise ValueError("bits must be the base64 of m/8 bytes")
        try:
            raw = base64.b64decode(text, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"bits are not base64: {exc}") from None
        return cls(raw, m, k)


def _positions(key: str, m: int, k: int) -> Iterable[int]:
    h1, h2 = _digest_pair(key)
    return ((h1 + i * h2) % m for i in range(k))


def rendezvous_weight(key: str, replica: str) -> int:
    """The 64-bit weight of ``replica`` for ``key``; the owner is the replica of highest weight."""
    data = key.encode("utf-8", "surrogatepass") + b"\0" + replica.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"kvblend-hrw").digest(), "little")


def rendezvous_owner(key: str, replicas: Iterable[str]) -> str | None:
    """The replica that owns ``key`` among ``replicas`` (None when there are none).

    Deterministic for a given set whatever its order: every router agrees without
    talking, and removing a replica moves only the keys it owned."""
    return max(replicas, key=lambda r: (rendezvous_weight(key, r), r), default=None)


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica: ``summary`` None when its stats are missing or
    unusable; ``load`` the requests it has not started answering (or, without a report of
    those, its requests in flight), None when unknown."""

    id: str
    summary: ResidentSummary | None = None
    load: int | None = None


@dataclass(frozen=True)
class Ranking:
    """Replica ids in ranks, most preferred first (the router tries rank 0, then rank 1,
    ...; within a rank Ray takes the least loaded). ``reason``: ``affinity`` (document
    tokens decided), ``load`` (the load bound sent it past the affinity order's first),
    ``no-keys`` (nothing to score), ``empty`` (no replicas). ``scores``: document tokens
    per replica id."""

    ranks: tuple[tuple[str, ...], ...]
    reason: str
    scores: Mapping[str, int] = field(default_factory=dict)

    @property
    def first(self) -> str | None:
        return self.ranks[0][0] if self.ranks and self.ranks[0] else None


def normalize_route_keys(route_keys: object) -> tuple[tuple[str, int], ...] | None:
    """``route_keys`` as ``((key, tokens), ...)`` with repeated keys merged (first kept), or
    None if it is not a sequence of (non-empty str ≤ MAX_KEY_CHARS, int 0..MAX_DOC_TOKENS)
    pairs. Only the first ``MAX_ROUTE_KEYS`` distinct documents are kept."""
    if not isinstance(route_keys, (tuple, list)):
        return None
    out: dict[str, int] = {}
    for item in route_keys:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            return None
        key, tokens = item
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            return None
        if type(tokens) is not int or not 0 <= tokens <= MAX_DOC_TOKENS:
            return None
        if key not in out and len(out) < MAX_ROUTE_KEYS:
            out[key] = tokens
    return tuple(out.items())


def document_scores(
    route_keys: Sequence[tuple[str, int]], replicas: Sequence[ReplicaState]
) -> tuple[dict[str, int], dict[str, int]]:
    """``(scores, held)`` per replica id: ``held`` the tokens of the documents in its
    summary; ``scores`` those plus the tokens of documents no summary holds and whose
    rendezvous owner it is."""
    ids = [r.id for r in replicas]
    held = dict.fromkeys(ids, 0)
    scores = dict.fromkeys(ids, 0)
    usable = [r for r in replicas if r.summary is not None and r.summary.expected_fp_rate <= MAX_TRUSTED_FP]
    for key, tokens in route_keys:
        holders = [r.id for r in usable if key in r.summary]  # type: ignore[operator]
        for rid in holders:
            held[rid] += tokens
            scores[rid] += tokens
        if not holders:
            owner = rendezvous_owner(key, ids)
            scores[owner] += tokens  # type: ignore[index]
    return scores, held


def power_of_two(replicas: Sequence[ReplicaState], rng: random.Random | None = None) -> tuple[str, ...]:
    """Two distinct random replicas (one if there is one), the less loaded first (unknown
    load counts as 0: Ray probes it)."""
    rng = rng or random
    pair = rng.sample(list(replicas), min(2, len(replicas)))
    pair.sort(key=lambda r: r.load or 0)
    return tuple(r.id for r in pair)


def rank_replicas(
    route_keys: object,
    replicas: Sequence[ReplicaState],
    *,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    rng: random.Random | None = None,
) -> Ranking:
    """Rank ``replicas`` for a request needing ``route_keys`` (see the module docstring).

    Affinity order: highest score first (ties: more tokens held, then the rendezvous
    weight of the request's largest document: never load, so that the same documents
    choose the same replica every time). Rank 0 is the first replica in that order whose
    load is under ``load_cap`` (a replica of unknown load is under it), rank 1 the next
    two in that order. Power of two choices when ``route_keys`` is absent or malformed or
    every score is 0. Never raises on what the replicas report."""
    if not replicas:
        return Ranking((), "empty")
    keys = normalize_route_keys(route_keys)
    if not keys:
        return Ranking((power_of_two(replicas, rng),), "no-keys")
    scores, held = document_scores(keys, replicas)
    anchor = max(keys, key=lambda kt: (kt[1], kt[0]))[0]
    order = sorted(replicas, key=lambda r: (-scores[r.id], -held[r.id], -rendezvous_weight(anchor, r.id), r.id))
    if scores[order[0].id] == 0:
        return Ranking((power_of_two(replicas, rng),), "no-keys", scores)
    cap = load_cap(replicas, load_factor)
    chosen = next((r for r in order if cap is None or r.load is None or r.load < cap), None)
    if chosen is None:  # unreachable (the least loaded is under the mean), kept for safety
        return Ranking((power_of_two(replicas, rng),), "load", scores)
    rest = tuple(r.id for r in order if r is not chosen)[:2]
    reason = "affinity" if chosen is order[0] else "load"
    return Ranking(((chosen.id,), rest) if rest else ((chosen.id,),), reason, scores)


def load_cap(replicas: Sequence[ReplicaState], load_factor: float) -> int | None:
    """The most requests a replica may hold before taking one more: it takes the request
    only while its load + 1 <= ceil(load_factor x (the known loads + 1) / replicas), i.e.
    load < that bound. None when no load is known (no bound). ``load_factor`` >= 1, so the
    least loaded replica is always under it."""
    known = [r.load for r in replicas if r.load is not None]
    if not known:
        return None
    return math.ceil(load_factor * (sum(known) + 1) / len(replicas))
