"""Remote tier on Redis/Valkey, one server or a Redis Cluster, shared by several serving machines.

Each entry is a Redis hash: ``format``/``header``/``header_xxh3`` plus one field per
tensor (``k.3``, ``v.3``, ...), so one layer is fetched alone with HMGET. Entries and
their accounting live in *groups*; a group holds, under one key base, per tenant a sorted
set ordering entries by last use and a hash of their sizes, a sorted set (``usage``) of the
bytes each tenant holds there, and counters of all its bytes and entries. Puts, deletes and
evictions run as Lua scripts on one group, so caps and accounting stay exact with many
clients, and every script touches only the entries it removes (pops from the front of a
sorted set): a put never scans the store. Capacity is shared fairly, as in the local tiers
(``kvblend.store.index.ByteIndex``): when the group's cap binds, a put evicts its tenant's
least recently used entries while that tenant would exceed its fair share (the group's cap
/ tenants in ``usage``), else those of the tenant holding the most, and never those of a
tenant within its share; a tenant over its cap loses its own first. An optional TTL expires
entries; a sorted set by expiry time lets a put that is short of room drop their index rows
first.

**One server** (``cluster=False``): one group whose key base is the prefix (keys
``PREFIX:TENANT:e:DIGEST``, ``PREFIX:usage``, ...): the caps, ``max_bytes`` and
``tenant_bytes``, and the fair shares hold for the whole tier.

**Redis Cluster** (``cluster=True``, redis-py's ``RedisCluster``): ``groups`` groups (16 by
default), each with a hash tag as its key base (keys ``{PREFIX:g:n}:TENANT:e:DIGEST``,
``{PREFIX:g:n}:usage``, ...), so that an entry's fields and its
group's accounting share one slot: every command and script touches keys of one slot only,
and resharding moves a group whole. A chunk belongs to group ``int(digest[:8], 16) % groups``
(keys are sha256: groups fill evenly). Group ``g``'s tag is chosen so that its slot lies in
the g-th of ``groups`` equal slot ranges; a cluster whose masters own equal contiguous
ranges (what ``redis-cli --cluster create`` makes) then holds ``groups / masters`` groups per
master. The guarantees hold **per group**, hence per shard: each group holds at most
``max_bytes // groups`` bytes and each tenant at most ``tenant_bytes // groups`` in it (so the
tier holds at most ``max_bytes`` and a tenant at most ``tenant_bytes``); a tenant holding at
most its fair share of a group (that group's cap / tenants holding entries in it) never
loses an entry of that group to another tenant's put. A tenant's share of the whole tier is
not enforced as one number: a put only sees its own group. An entry larger than a group's
cap is refused. ``stats``/``entries``/``evict`` sum or walk every group (``evict`` in the
tenant's last-use order over all groups, group by group, not atomically).

Every Redis call has a timeout and no retries; a failure (connection refused or timed out,
CLUSTERDOWN, a slot not covered, redirections that do not settle, an error reply) counts a
warning, reads miss and writes return False. When the node itself failed (anything but an
error reply from a node that answers, such as OOM) it (the one server, or the cluster node
holding the group) is skipped for ``retry_s`` before trying again; the other nodes keep
serving. A node over Redis' ``maxmemory`` refuses puts (a put's first write is one Redis
refuses then) and still serves reads (a read's recency update is best effort). Entries are
verified against their checksums as on every tier, so a failing node can cost
recomputation, never a wrong tensor.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Callable, NamedTuple, TypeVar
from urllib.parse import urlparse, urlsplit, urlunsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import AskError, ClusterError, NoScriptError, RedisClusterException, ResponseError, TryAgainError
from redis.retry import Retry

from kvblend.store.base import EntryInfo
from kvblend.store.codec import checksum_bytes, tensor_bytes, tensor_from_bytes
from kvblend.store.entry import CorruptEntry, Entry, EntryHeader, header_fields, parse_header_fields
from kvblend.store.keys import ChunkKey, validate_tenant
from kvblend.store.tier import ADMIN, LayerRead, Tier, TierUnavailable, WriteOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")
HEADER_FIELDS = ("format", "header", "header_xxh3")
MAX_GROUPS = 256
FAILURES = (redis.RedisError, RedisClusterException, OSError)  # RedisClusterException is not a RedisError
SERVER = "server"  # the node name of a one-server tier


def node_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says a node cannot serve now (unreachable, slow, loading, cluster
    down, slots moving) rather than that it refused one command (an error reply such as
    OOM when Redis' ``maxmemory`` is reached): only the former backs the node off."""
    return not isinstance(exc, ResponseError) or isinstance(exc, (ClusterError, AskError, TryAgainError))

_LUA_COMMON = """
local prefix = ARGV[1]
local function num(v) return tonumber(v) or 0 end
local function drop(t, d)
  local base = prefix .. ':' .. t
  local n = num(redis.call('HGET', base .. ':size', d))
  local existed = redis.call('DEL', base .. ':e:' .. d)
  local indexed = redis.call('HDEL', base .. ':size', d)
  redis.call('ZREM', base .. ':lru', d)
  redis.call('ZREM', prefix .. ':expiry', t .. '/' .. d)
  if indexed == 1 then
    redis.call('DECR', prefix .. ':entries')
    redis.call('DECRBY', prefix .. ':bytes', n)
    if num(redis.call('ZINCRBY', prefix .. ':usage', -n, t)) <= 0 then redis.call('ZREM', prefix .. ':usage', t) end
  end
  return existed + indexed
end
local function split(member)
  local at = string.find(member, '/', 1, true)
  return string.sub(member, 1, at - 1), string.sub(member, at + 1)
end
"""

# Every key a script names starts with ARGV[1], the group's key base: one slot in a cluster.
# KEYS: entry, tenant lru, sizes, usage, global bytes, global entries, expiry
# ARGV: prefix, tenant, digest, nbytes, now, ttl_ms, cap, tenant_cap (-1: none), field, value, ...
# Returns {stored, tenant of each evicted entry...}.
_LUA_PUT = _LUA_COMMON + """
local tenant, digest = ARGV[2], ARGV[3]
local need, now, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cap, tcap = tonumber(ARGV[7]), tonumber(ARGV[8])
local member = tenant .. '/' .. digest
local out = {0}
if need > cap or (tcap >= 0 and need > tcap) then return out end
-- A write that Redis refuses over maxmemory comes first: once a script has written (drop's
-- DEL), Redis lets the rest through, and the entry would land past the limit.
redis.call('INCRBY', KEYS[6], 0)
drop(tenant, digest)
local function held(t) return num(redis.call('ZSCORE', KEYS[4], t)) end
local function over_tenant() return tcap >= 0 and held(tenant) + need > tcap end
local function over_tier() return num(redis.call('GET', KEYS[5])) + need > cap end
local function fair_victim()  -- whose entry goes next; nil when all others are within their share
  local mine = held(tenant)
  local holders = redis.call('ZCARD', KEYS[4]) + (mine > 0 and 0 or 1)
  if mine > 0 and (mine + need) * holders > cap then return tenant end
  local top = redis.call('ZREVRANGE', KEYS[4], 0, 1, 'WITHSCORES')
  for i = 1, #top, 2 do
    if top[i] ~= tenant then
      if tonumber(top[i + 1]) * holders > cap then return top[i] end
      return nil
    end
  end
  return nil
end
local function pop(t)  -- evict t's least recently used entry; false when it has none
  local first = redis.call('ZRANGE', prefix .. ':' .. t .. ':lru', 0, 0)[1]
  if first == nil then return false end
  if drop(t, first) > 1 then table.insert(out, t) end
  return true
end
if over_tenant() or over_tier() then  -- expired entries' index rows go first, oldest expiry first
  while true do
    local first = redis.call('ZRANGE', KEYS[7], 0, 0, 'WITHSCORES')
    if first[1] == nil or tonumber(first[2]) > now * 1000 then break end
    local t, d = split(first[1])
    drop(t, d)
  end
end
while over_tenant() do
  if not pop(tenant) then return out end
end
while over_tier() do
  local victim = fair_victim()
  if victim == nil or not pop(victim) then return out end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('ZADD', KEYS[7], now * 1000 + ttl, member)
end
redis.call('HSET', KEYS[3], digest, need)
redis.call('ZADD', KEYS[2], now, digest)
redis.call('ZINCRBY', KEYS[4], need, tenant)
redis.call('INCRBY', KEYS[5], need)
redis.call('INCR', KEYS[6])
out[1] = 1
return out
"""

# KEYS: entry (for routing); ARGV: prefix, tenant, digest
_LUA_DROP = _LUA_COMMON + "return drop(ARGV[2], ARGV[3])"

# KEYS: tenant lru, usage; ARGV: prefix, tenant, target_bytes
_LUA_EVICT = _LUA_COMMON + """
local evicted = 0
while num(redis.call('ZSCORE', KEYS[2], ARGV[2])) > tonumber(ARGV[3]) do
  local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if victim == nil then break end
  drop(ARGV[2], victim)
  evicted = evicted + 1
end
return evicted
"""


class _Script(NamedTuple):
    text: str
    sha: str


def _script(text: str) -> _Script:
    return _Script(text, hashlib.sha1(text.encode()).hexdigest())


PUT, DROP, EVICT = _script(_LUA_PUT), _script(_LUA_DROP), _script(_LUA_EVICT)


def group_bases(prefix: str, groups: int) -> tuple[str, ...]:
    """The key base (a hash tag) of each of a cluster tier's ``groups`` groups: group g's tag
    ``{prefix:g:n}`` takes the smallest n whose slot lies in the g-th of ``groups`` equal slot
    ranges. Every client computes the same bases from the same prefix and group count."""
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"groups must be in 1..{MAX_GROUPS}; got {groups}")
    bases = []
    for g in range(groups):
        n = 0
        while key_slot(f"{prefix}:{g}:{n}".encode()) * groups // REDIS_CLUSTER_HASH_SLOTS != g:
            n += 1
        bases.append(f"{{{prefix}:{g}:{n}}}")
    return tuple(bases)


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The startup nodes of a cluster URL: one ``redis://`` or ``rediss://`` URL per node,
    comma-separated (``redis://10.0.0.1:6379,redis://10.0.0.2:6379``); the first URL's
    credentials and options apply to every node, and its database must be 0. Raises
    ValueError on anything else."""
    nodes = []
    for i, part in enumerate(p.strip() for p in url.split(",")):
        parsed = urlparse(part)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ValueError(f"cluster URL {i + 1}: want redis://HOST:PORT or rediss://HOST:PORT; got {part!r}")
        if parsed.path.strip("/") not in ("", "0"):
            raise ValueError(f"cluster URL {i + 1}: a Redis Cluster has database 0 only; got {part!r}")
        try:
            nodes.append((parsed.hostname, parsed.port or 6379))
        except ValueError as exc:  # a port that is not a number
            raise ValueError(f"cluster URL {i + 1}: {exc}") from exc
    return nodes


class RedisStore(Tier):
    """Chunk entries in Redis (see the module docstring). Thread-safe (connection pools);
    any number of processes and machines may share one server or cluster and ``prefix``
    (with the same ``groups`` on a cluster)."""

    name = "redis"

    def __init__(self, url: str, max_bytes: int, *, ttl_s: float | None = None, timeout_s: float = 0.5,
                 retry_s: float = 5.0, prefix: str = "kvblend", tenant_bytes: int | None = None,
                 cluster: bool = False, groups: int = 16, kv_dtype: str = "fp32", compute_dtype: str = "fp32") -> None:
        super().__init__(kv_dtype=kv_dtype, compute_dtype=compute_dtype)
        if max_bytes < 0 or timeout_s <= 0 or retry_s < 0 or (ttl_s is not None and ttl_s <= 0):
            raise ValueError("max_bytes >= 0, timeout_s > 0, retry_s >= 0 and ttl_s > 0 (or None) required")
        self.max_bytes = max_bytes
        self.tenant_bytes = None if tenant_bytes is None else min(tenant_bytes, max_bytes)
        self.ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        self.prefix = validate_tenant(prefix)
        self.retry_s = retry_s
        self.cluster = cluster
        self.bases = group_bases(self.prefix, groups) if cluster else (self.prefix,)
        self.group_bytes = max_bytes // len(self.bases)
        self.group_tenant_bytes = None if self.tenant_bytes is None else self.tenant_bytes // len(self.bases)
        self._url, self._timeout_s = url, timeout_s
        if cluster:
            cluster_nodes(url)  # a malformed URL fails here, not as warnings later
        elif "," in url:
            raise ValueError("several Redis URLs name the nodes of a cluster: use the cluster mode")
        self._client: redis.Redis | RedisCluster | None = None
        self._down: dict[str, float] = {}  # node name -> monotonic time until which it is skipped
        self._lock = threading.Lock()
        try:
            self._connected()
        except TierUnavailable as exc:  # a cluster not reachable yet: every call retries after retry_s
            log.warning("redis tier: %s", exc)
        if not cluster:
            self._warn_old_layout()

    def _warn_old_layout(self) -> None:
        """Entries written before per-tenant usage accounting (a global ``prefix:lru``) are
        invisible to it: say so, once, instead of letting puts be refused unexplained."""
        try:
            old = self._call(self.prefix, lambda c: c.exists(f"{self.prefix}:lru", f"{self.prefix}:tenants"))
        except TierUnavailable:  # unreachable now: the tier's own timeout-then-miss applies
            return
        if old:
            log.warning("redis prefix %r holds entries from an older kvblend whose capacity this version does not "
                        "count; clear the prefix (e.g. delete %s:*) before sharing the tier", self.prefix, self.prefix)

    @property
    def capacity_bytes(self) -> int:
        return self.max_bytes

    # -- key names ---------------------------------------------------------------------

    def group_of(self, key: ChunkKey) -> int:
        """The index in ``bases`` of the group holding ``key`` (0 on one server)."""
        return int(key.digest[:8], 16) % len(self.bases)

    def _base(self, key: ChunkKey) -> str:
        return self.bases[self.group_of(key)]

    def entry_name(self, key: ChunkKey) -> str:
        """The Redis key of ``key``'s hash."""
        return f"{self._base(key)}:{key.tenant}:e:{key.digest}"

    # -- availability ------------------------------------------------------------------

    def _connected(self) -> redis.Redis | RedisCluster:
        """The client, made on first use; a cluster client reads the topology when made,
        so an unreachable cluster raises TierUnavailable (and is retried after ``retry_s``)."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                if time.monotonic() < self._down.get("*", 0.0):
                    raise TierUnavailable("redis cluster unreachable; backing off")
                try:
                    self._client = _connect_cluster(self._url, self._timeout_s) if self.cluster \
                        else _connect(self._url, self._timeout_s)
                except FAILURES as exc:
                    self._down["*"] = time.monotonic() + self.retry_s
                    raise TierUnavailable(f"redis cluster unreachable: {exc}") from exc
            return self._client

    def _node(self, client: redis.Redis | RedisCluster, base: str) -> str:
        """The name of the node serving ``base``'s group now."""
        if not isinstance(client, RedisCluster):
            return SERVER
        try:
            return str(client.get_node_from_key(base).name)
        except FAILURES as exc:  # the slot is not covered
            raise TierUnavailable(f"redis cluster: {exc}") from exc

    def _call(self, base: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)``, one round trip to the node of ``base``'s group; TierUnavailable
        when that node is backing off or fails (it then backs off)."""
        client = self._connected()
        return self._on_node(self._node(client, base), lambda: fn(client))

    def _on_node(self, node: str, fn: Callable[[], T]) -> T:
        with self._lock:
            if time.monotonic() < self._down.get(node, 0.0):
                raise TierUnavailable(f"redis node {node} backing off after a failure")
        try:
            return fn()
        except FAILURES as exc:
            if node_failed(exc):
                with self._lock:
                    self._down[node] = time.monotonic() + self.retry_s
                log.warning("redis tier: node %s unavailable (%s); skipping it for %.1f s", node, exc, self.retry_s)
            raise TierUnavailable(f"redis: {exc}") from exc

    def _gather(self, queue: Callable[[Any, str], None]) -> tuple[dict[str, list[Any]], bool]:
        """Queue ``queue(pipe, base)`` for every group, one pipeline per node; the replies per
        base of the groups whose node answered, and whether any did not. TierUnavailable
        when none answered."""
        client = self._connected()
        by_node: dict[str, list[str]] = {}
        failed = False
        for base in self.bases:
            try:
                by_node.setdefault(self._node(client, base), []).append(base)
            except TierUnavailable:
                failed = True
        out: dict[str, list[Any]] = {}
        for node, bases in by_node.items():
            def run(bases: list[str] = bases) -> list[tuple[str, list[Any]]]:
                pipe = client.pipeline(transaction=False)
                sizes = []
                for base in bases:
                    before = len(pipe)
                    queue(pipe, base)
                    sizes.append(len(pipe) - before)
                replies, parts, at = pipe.execute(), [], 0
                for base, n in zip(bases, sizes):
                    parts.append((base, replies[at:at + n]))
                    at += n
                return parts

            try:
                out.update(self._on_node(node, run))
            except TierUnavailable:
                failed = True
        if not out:
            raise TierUnavailable("no redis node answered")
        return out, failed

    def _run(self, client: Any, script: _Script, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA, or EVAL when the node does not know the script yet (a node restarted,
        or first contact): the node caches it, nothing is loaded on other nodes."""
        try:
            return client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.eval(script.text, len(keys), *keys, *args)

    # -- reads -------------------------------------------------------------------------

    def _fetch_and_touch(self, client: Any, key: ChunkKey, queue: Callable[[Any], None]) -> Any:
        """One round trip: ``queue(pipe)``'s one read and the entry's recency update (an
        absent member stays absent); the read's reply. The update is best effort: a node
        refusing writes (``maxmemory`` reached) still serves reads."""
        pipe = client.pipeline(transaction=False)
        queue(pipe)
        pipe.zadd(f"{self._base(key)}:{key.tenant}:lru", {key.digest: time.time()}, xx=True)
        reply, touched = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(touched, Exception) and node_failed(touched):
            raise touched
        return reply

    def contains(self, key: ChunkKey) -> bool:
        try:
            return bool(self._call(self._base(key), lambda c: c.exists(self.entry_name(key))))
        except TierUnavailable:
            self.counters.add(key.tenant, "warnings")
            return False

    def _read(self, key: ChunkKey) -> Entry | None:
        def fetch(client: Any) -> Any:
            return self._fetch_and_touch(client, key, lambda pipe: pipe.hgetall(self.entry_name(key)))

        fields = {name.decode(errors="replace"): value for name, value in self._call(self._base(key), fetch).items()}
        if not fields:
            return None
        header = parse_header_fields(fields)
        return Entry(header, {name: _tensor(header, name, fields.get(name)) for name in header.checksums}, owned=True)

    def _read_layer(self, key: ChunkKey, layer: int) -> LayerRead | None:
        names = (f"k.{layer}", f"v.{layer}", f"k.{layer}.scale", f"v.{layer}.scale")

        def fetch(client: Any) -> Any:
            return self._fetch_and_touch(client, key, lambda pipe: pipe.hmget(self.entry_name(key),
                                                                              [*HEADER_FIELDS, *names]))

        values = self._call(self._base(key), fetch)
        fields = dict(zip((*HEADER_FIELDS, *names), values))
        if all(v is None for v in values):
            return None
        header = parse_header_fields(fields)
        if layer >= header.n_layers:
            return None
        tensors = {n: _tensor(header, n, fields.get(n)) for n in header.tensor_names(layer)}
        return LayerRead(header, tensors, owned=True)

    # -- writes ------------------------------------------------------------------------

    def _write(self, entry: Entry) -> WriteOutcome:
        h = entry.header
        base = self._base(ChunkKey(h.tenant, h.digest))
        payload = _payload(entry)
        nbytes = sum(len(v) for v in payload.values())
        keys = [f"{base}:{h.tenant}:e:{h.digest}", f"{base}:{h.tenant}:lru", f"{base}:{h.tenant}:size",
                f"{base}:usage", f"{base}:bytes", f"{base}:entries", f"{base}:expiry"]
        tenant_cap = -1 if self.group_tenant_bytes is None else self.group_tenant_bytes
        args: list[Any] = [base, h.tenant, h.digest, nbytes, time.time(), self.ttl_ms, self.group_bytes, tenant_cap]
        for name, value in payload.items():
            args += [name, value]
        stored, *evicted = self._call(base, lambda c: self._run(c, PUT, keys, args))
        return WriteOutcome(bool(stored), tuple(t.decode() if isinstance(t, bytes) else str(t) for t in evicted))

    def _remove(self, key: ChunkKey) -> bool:
        base = self._base(key)
        args = [base, key.tenant, key.digest]
        return bool(self._call(base, lambda c: self._run(c, DROP, [self.entry_name(key)], args)))

    def _evict(self, tenant: str, target_bytes: int) -> int:
        if len(self.bases) == 1:
            base = self.bases[0]
            keys = [f"{base}:{tenant}:lru", f"{base}:usage"]
            return int(self._call(base, lambda c: self._run(c, EVICT, keys, [base, tenant, target_bytes])))
        infos = sorted(self.entries(tenant), key=lambda i: i.last_used)  # what the nodes answering hold
        excess, evicted = sum(i.nbytes for i in infos) - target_bytes, 0
        for info in infos:
            if excess <= 0:
                break
            try:
                removed = self._remove(info.key)
            except TierUnavailable:  # its node failed since the listing: counted, the others go on
                self.counters.add(tenant, "warnings")
                continue
            if removed:
                excess -= info.nbytes
                evicted += 1
        return evicted

    # -- accounting --------------------------------------------------------------------

    def entries(self, tenant: str) -> list[EntryInfo]:
        """Live entries of ``tenant`` in the groups whose node answers (index rows of
        TTL-expired entries are dropped); a group whose node does not counts a warning."""
        validate_tenant(tenant)
        infos: list[EntryInfo] = []
        unavailable = False
        for base in self.bases:
            try:
                rows, sizes, alive = self._call(base, lambda c, b=base: self._listing(c, b, tenant))
            except TierUnavailable:
                unavailable = True
                continue
            for (digest, used), size, live in zip(rows, sizes, alive):
                key = ChunkKey(tenant, digest.decode())
                if live:
                    infos.append(EntryInfo(key, int(size or 0), float(used)))
                else:
                    self._discard(key)
        if unavailable:
            self.counters.add(tenant, "warnings")
        return infos

    def _listing(self, client: Any, base: str, tenant: str) -> tuple[list[Any], list[Any], list[Any]]:
        rows = client.zrange(f"{base}:{tenant}:lru", 0, -1, withscores=True)
        digests = [d for d, _ in rows]
        pipe = client.pipeline(transaction=False)
        for d in digests:
            pipe.exists(f"{base}:{tenant}:e:{d.decode()}")
        alive = pipe.execute() if digests else []
        sizes = client.hmget(f"{base}:{tenant}:size", digests) if digests else []
        return rows, sizes, alive

    def _occupancy(self, tenant: str | None) -> tuple[int, int]:
        """Summed over the groups whose node answers; a warning when some did not."""
        def queue(pipe: Any, base: str) -> None:
            if tenant is None:
                pipe.get(f"{base}:entries")
                pipe.get(f"{base}:bytes")
            else:
                pipe.zcard(f"{base}:{tenant}:lru")
                pipe.zscore(f"{base}:usage", tenant)

        replies, failed = self._gather(queue)
        if failed:
            self.counters.add(tenant or ADMIN, "warnings")
        return (sum(int(count or 0) for count, _ in replies.values()),
                sum(int(nbytes or 0) for _, nbytes in replies.values()))

    def ping(self) -> bool:
        """Whether the server (every cluster node) answers now (ignores the back-off)."""
        try:
            return bool(self._connected().ping())
        except (*FAILURES, TierUnavailable):
            return False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def hide_password(urls: str) -> str:
    """A Redis URL, or several comma-separated, with each password shown as ``***``
    (``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``): for messages
    and printed settings."""
    out = []
    for url in urls.split(","):
        parts = urlsplit(url.strip())
        if parts.password is not None:
            host = parts.netloc.rsplit("@", 1)[1]
            url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
        out.append(url)
    return ",".join(out)


def _connect(url: str, timeout_s: float) -> redis.Redis:
    """A client with hard timeouts and no retries: a slow cache must not slow requests."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
    )


def _connect_cluster(url: str, timeout_s: float) -> RedisCluster:
    """A cluster client (it reads the slot map now) with the same hard timeouts and no
    retries; redirections (MOVED/ASK) are still followed, a failed node makes it re-read the
    slot map from the others before the call fails."""
    first, *others = [p.strip() for p in url.split(",")]
    return RedisCluster.from_url(
        first,
        startup_nodes=[ClusterNode(host, port) for host, port in cluster_nodes(",".join(others))] if others else None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        require_full_coverage=False,
    )


def _payload(entry: Entry) -> dict[str, bytes | memoryview | str]:
    payload: dict[str, bytes | memoryview | str] = dict(header_fields(entry.header))
    for name, tensor in entry.tensors.items():
        payload[name] = tensor_bytes(tensor)
    return payload


def _tensor(header: EntryHeader, name: str, data: bytes | None) -> torch.Tensor:
    """A private tensor holding a reply field, after checking its checksum and size."""
    if data is None:
        raise CorruptEntry(f"{name}: missing field")
    if checksum_bytes(data) != header.checksums.get(name):
        raise CorruptEntry(f"{name}: checksum mismatch")
    dtype, shape = header.tensor_spec(name)
    try:
        return tensor_from_bytes(data, dtype, shape)
    except ValueError as exc:
        raise CorruptEntry(f"{name}: {exc}") from exc
