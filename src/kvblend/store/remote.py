"""Remote tier on Redis/Valkey (single instance), shared by several serving machines.

Each entry is a Redis hash: ``format``/``header``/``header_xxh3`` plus one field per
tensor (``k.3``, ``v.3``, ...), so one layer is fetched alone with HMGET. Per tenant a
sorted set orders entries by last use and a hash holds their sizes; a global sorted set
(``usage``) holds the bytes of each tenant holding entries, and global counters hold all
bytes and entries. Puts, deletes and evictions run as Lua scripts, so caps and accounting
stay exact with many clients, and every script touches only the entries it removes (pops
from the front of a sorted set): a put never scans the store. Capacity is shared fairly,
as in the local tiers (``kvblend.store.index.ByteIndex``): when the tier's cap binds, a
put evicts its tenant's least recently used entries while that tenant would exceed its
fair share (cap / tenants in ``usage``), else those of the tenant holding the most, and
never those of a tenant within its share; a tenant over ``tenant_bytes`` loses its own
first. An optional TTL expires entries; a sorted set by expiry time lets a put that is
short of room drop their index rows first.

Every Redis call has a timeout and no retries; a failure counts a warning, reads miss,
writes return False, and the tier is skipped for ``retry_s`` before trying again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvblend.store.base import EntryInfo
from kvblend.store.codec import checksum_bytes, tensor_bytes, tensor_from_bytes
from kvblend.store.entry import CorruptEntry, Entry, EntryHeader, header_fields, parse_header_fields
from kvblend.store.keys import ChunkKey, validate_tenant
from kvblend.store.tier import LayerRead, Tier, TierUnavailable, WriteOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")
HEADER_FIELDS = ("format", "header", "header_xxh3")

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

# ARGV: prefix, tenant, digest
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


class RedisStore(Tier):
    """Chunk entries in Redis (see the module docstring). Thread-safe (connection pool);
    any number of processes and machines may share one server and ``prefix``."""

    name = "redis"

    def __init__(self, url: str, max_bytes: int, *, ttl_s: float | None = None, timeout_s: float = 0.5,
                 retry_s: float = 5.0, prefix: str = "kvblend", tenant_bytes: int | None = None,
                 kv_dtype: str = "fp32", compute_dtype: str = "fp32") -> None:
        super().__init__(kv_dtype=kv_dtype, compute_dtype=compute_dtype)
        if max_bytes < 0 or timeout_s <= 0 or retry_s < 0 or (ttl_s is not None and ttl_s <= 0):
            raise ValueError("max_bytes >= 0, timeout_s > 0, retry_s >= 0 and ttl_s > 0 (or None) required")
        self.max_bytes = max_bytes
        self.tenant_bytes = None if tenant_bytes is None else min(tenant_bytes, max_bytes)
        self.ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        self.prefix = validate_tenant(prefix)
        self.retry_s = retry_s
        self._client = _connect(url, timeout_s)
        self._put_script = self._client.register_script(_LUA_PUT)
        self._drop_script = self._client.register_script(_LUA_DROP)
        self._evict_script = self._client.register_script(_LUA_EVICT)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._warn_old_layout()

    def _warn_old_layout(self) -> None:
        """Entries written before per-tenant usage accounting (a global ``prefix:lru``) are
        invisible to it: say so, once, instead of letting puts be refused unexplained."""
        try:
            old = self._client.exists(f"{self.prefix}:lru", f"{self.prefix}:tenants")
        except Exception:  # noqa: BLE001 - unreachable now: the tier's own timeout-then-miss applies
            return
        if old:
            log.warning("redis prefix %r holds entries from an older kvblend whose capacity this version does not "
                        "count; clear the prefix (e.g. delete %s:*) before sharing the tier", self.prefix, self.prefix)

    @property
    def capacity_bytes(self) -> int:
        return self.max_bytes

    # -- key names ---------------------------------------------------------------------

    def _k(self, tenant: str, what: str) -> str:
        return f"{self.prefix}:{tenant}:{what}"

    def _entry_key(self, key: ChunkKey) -> str:
        return self._k(key.tenant, f"e:{key.digest}")

    # -- availability ------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one round trip; TierUnavailable on any Redis failure, and back off."""
        with self._lock:
            if time.monotonic() < self._down_until:
                raise TierUnavailable("redis tier backing off after a failure")
        try:
            return fn()
        except (redis.RedisError, OSError) as exc:
            self._mark_down(exc)
            raise TierUnavailable(f"redis: {exc}") from exc

    def _mark_down(self, exc: Exception) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s
        log.warning("redis tier unavailable (%s); skipping it for %.1f s", exc, self.retry_s)

    # -- reads -------------------------------------------------------------------------

    def _touch(self, pipe: Any, key: ChunkKey) -> None:
        """Queue the recency update of a read (an absent member stays absent)."""
        pipe.zadd(self._k(key.tenant, "lru"), {key.digest: time.time()}, xx=True)

    def contains(self, key: ChunkKey) -> bool:
        try:
            return bool(self._call(lambda: self._client.exists(self._entry_key(key))))
        except TierUnavailable:
            self.counters.add(key.tenant, "warnings")
            return False

    def _read(self, key: ChunkKey) -> Entry | None:
        def fetch() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(self._entry_key(key))
            self._touch(pipe, key)
            return pipe.execute()

        fields = {name.decode(errors="replace"): value for name, value in self._call(fetch)[0].items()}
        if not fields:
            return None
        header = parse_header_fields(fields)
        return Entry(header, {name: _tensor(header, name, fields.get(name)) for name in header.checksums}, owned=True)

    def _read_layer(self, key: ChunkKey, layer: int) -> LayerRead | None:
        names = (f"k.{layer}", f"v.{layer}", f"k.{layer}.scale", f"v.{layer}.scale")

        def fetch() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.hmget(self._entry_key(key), [*HEADER_FIELDS, *names])
            self._touch(pipe, key)
            return pipe.execute()

        values = self._call(fetch)[0]
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
        payload = _payload(entry)
        nbytes = sum(len(v) for v in payload.values())
        keys = [self._k(h.tenant, f"e:{h.digest}"), self._k(h.tenant, "lru"), self._k(h.tenant, "size"),
                f"{self.prefix}:usage", f"{self.prefix}:bytes", f"{self.prefix}:entries", f"{self.prefix}:expiry"]
        tenant_cap = -1 if self.tenant_bytes is None else self.tenant_bytes
        args: list[Any] = [self.prefix, h.tenant, h.digest, nbytes, time.time(), self.ttl_ms,
                           self.max_bytes, tenant_cap]
        for name, value in payload.items():
            args += [name, value]
        stored, *evicted = self._call(lambda: self._put_script(keys=keys, args=args))
        return WriteOutcome(bool(stored), tuple(t.decode() if isinstance(t, bytes) else str(t) for t in evicted))

    def _remove(self, key: ChunkKey) -> bool:
        args = [self.prefix, key.tenant, key.digest]
        return bool(self._call(lambda: self._drop_script(keys=[], args=args)))

    def _evict(self, tenant: str, target_bytes: int) -> int:
        keys = [self._k(tenant, "lru"), f"{self.prefix}:usage"]
        return int(self._call(lambda: self._evict_script(keys=keys, args=[self.prefix, tenant, target_bytes])))

    # -- accounting --------------------------------------------------------------------

    def entries(self, tenant: str) -> list[EntryInfo]:
        """Live entries of ``tenant`` (index rows of TTL-expired entries are dropped)."""
        validate_tenant(tenant)
        try:
            rows, sizes, alive = self._call(lambda: self._listing(tenant))
        except TierUnavailable:
            self.counters.add(tenant, "warnings")
            return []
        infos = []
        for (digest, used), size, live in zip(rows, sizes, alive):
            key = ChunkKey(tenant, digest.decode())
            if live:
                infos.append(EntryInfo(key, int(size or 0), float(used)))
            else:
                self._discard(key)
        return infos

    def _listing(self, tenant: str) -> tuple[list[Any], list[Any], list[Any]]:
        rows = self._client.zrange(self._k(tenant, "lru"), 0, -1, withscores=True)
        digests = [d for d, _ in rows]
        pipe = self._client.pipeline(transaction=False)
        for d in digests:
            pipe.exists(self._k(tenant, f"e:{d.decode()}"))
        alive = pipe.execute() if digests else []
        sizes = self._client.hmget(self._k(tenant, "size"), digests) if digests else []
        return rows, sizes, alive

    def _occupancy(self, tenant: str | None) -> tuple[int, int]:
        if tenant is not None:
            def one() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                pipe.zcard(self._k(tenant, "lru"))
                pipe.zscore(f"{self.prefix}:usage", tenant)
                return pipe.execute()

            count, nbytes = self._call(one)
            return int(count), int(nbytes or 0)
        def whole() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(f"{self.prefix}:entries")
            pipe.get(f"{self.prefix}:bytes")
            return pipe.execute()

        count, nbytes = self._call(whole)
        return int(count or 0), int(nbytes or 0)

    def ping(self) -> bool:
        """Whether the server answers now (ignores the back-off)."""
        try:
            return bool(self._client.ping())
        except (redis.RedisError, OSError):
            return False

    def close(self) -> None:
        self._client.close()


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
