"""``kvblend store stats|ls|evict|clear|plan``: inspect and manage a chunk store, per tenant."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from kvblend.store.config import StoreConfig
from kvblend.store.disk import DiskStore
from kvblend.store.keys import ChunkKey, validate_tenant
from kvblend.store.plan import format_size, parse_size, plan_capacity
from kvblend.store.remote import RedisStore, hide_password
from kvblend.store.tier import Tier
from kvblend.store.tiered import TieredStore

UNCAPPED = sys.maxsize  # the CLI never evicts by capacity when it opens a store


def add_store_commands(subparsers: argparse._SubParsersAction,
                       run: Callable[[argparse.Namespace], int] | None = None) -> None:
    """Register the ``store`` command and its subcommands on a parent parser's subparsers;
    ``run`` (default ``run_store_command``) runs them: ``kvblend.commands.store`` fills the
    locations not given from the settings first (this package sits below them)."""
    store = subparsers.add_parser("store", help="inspect and manage the chunk KV store")
    sub = store.add_subparsers(dest="store_command", required=True)
    for name, helptext in (("stats", "entries and bytes per tier"), ("ls", "list entries"),
                           ("evict", "evict entries (LRU first) or given keys"), ("clear", "delete all entries")):
        _add_location_flags(sub.add_parser(name, help=helptext))
    evict = sub.choices["evict"]
    evict.add_argument("--to-bytes", type=parse_size, help="evict until the tenant holds at most this much")
    evict.add_argument("--key", action="append", default=[], help="digest of an entry to delete (repeatable)")
    _add_plan_flags(sub.add_parser("plan", help="KV bytes per token and chunks that fit a budget"))
    store.set_defaults(func=run or run_store_command)


def _add_location_flags(p: argparse.ArgumentParser) -> None:
    """Where the store is: from ``kvblend store`` with neither ``--disk-dir`` nor
    ``--redis-url``, the server's (settings ``store.*``: its disk folder, and its Redis with
    the same prefix, cluster and groups); with either, the flags alone (prefix kvblend, 16
    groups, no cluster unless given)."""
    p.add_argument("--disk-dir", help="disk tier directory (with neither location flag: the settings' store)")
    p.add_argument("--redis-url", help="redis tier URL, e.g. redis://127.0.0.1:6379/0; with --redis-cluster, "
                   "one or more node URLs, comma-separated (with neither location flag: the settings' store)")
    p.add_argument("--redis-prefix", default=None, help="key prefix of the redis tier (default: store.redis_prefix)")
    p.add_argument("--redis-cluster", action=argparse.BooleanOptionalAction, default=None,
                   help="the URL names a Redis Cluster (default: store.redis_cluster)")
    p.add_argument("--redis-groups", type=int, default=None,
                   help="a cluster tier's hash-tag groups (default: store.redis_groups)")
    p.add_argument("--tenant", type=_tenant, default="default", help="tenant namespace (default: default)")


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.description = "The shape defaults are SmolLM2-135M's (the default model): give another model's."
    p.add_argument("--layers", type=int, default=30, help="(default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16", "int8"), default=None,
                   help="storage dtype (default: store.kv_dtype)")
    p.add_argument("--budget", type=parse_size, default=parse_size("10GiB"))
    p.add_argument("--chunk-tokens", type=int, default=512)


def _tenant(text: str) -> str:
    try:
        return validate_tenant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def run_store_command(args: argparse.Namespace) -> int:
    """Run a parsed ``store`` subcommand; returns the process exit code (1 when a tier
    cannot be reached: nothing there was read or changed, and saying "0 entries" would lie)."""
    if args.store_command == "plan":
        return _plan(args)
    for name in ("redis_prefix", "redis_cluster", "redis_groups"):  # StoreConfig's defaults, not copies
        if getattr(args, name) is None:
            setattr(args, name, getattr(StoreConfig, name))
    if args.disk_dir and not os.path.isdir(args.disk_dir):
        print(f"kvblend store: no such directory: {args.disk_dir}", file=sys.stderr)
        return 2
    try:
        store = _open(args)
    except ValueError as exc:
        print(f"kvblend store: {exc}", file=sys.stderr)
        return 2
    if store is None:
        print("kvblend store: give --disk-dir and/or --redis-url", file=sys.stderr)
        return 2
    commands: dict[str, Callable[[TieredStore, argparse.Namespace], int]] = {
        "stats": _stats, "ls": _ls, "evict": _evict, "clear": _clear}
    try:
        down = [t for t in store.tiers if isinstance(t, RedisStore) and not t.ping()]
        if down:
            print(f"kvblend store: cannot reach the redis tier at {hide_password(args.redis_url)}", file=sys.stderr)
            return 1
        return commands[args.store_command](store, args)
    finally:
        store.close()


def _open(args: argparse.Namespace) -> TieredStore | None:
    tiers: list[Tier] = []
    if args.disk_dir:
        tiers.append(DiskStore(args.disk_dir, UNCAPPED, create=False))
    if args.redis_url:
        tiers.append(RedisStore(args.redis_url, UNCAPPED, prefix=args.redis_prefix, retry_s=0,
                                cluster=args.redis_cluster, groups=args.redis_groups))
    return TieredStore(tiers) if tiers else None


def _stats(store: TieredStore, args: argparse.Namespace) -> int:
    print(f"tenant {args.tenant}")
    for name, s in store.tier_stats(args.tenant).items():
        note = "  (unavailable)" if s.warnings else ""
        print(f"{name:8s} entries {s.entries:8d}  bytes {s.bytes:14d} ({format_size(s.bytes)}){note}")
    return 0


def _ls(store: TieredStore, args: argparse.Namespace) -> int:
    for tier, infos in store.entries(args.tenant).items():
        for info in sorted(infos, key=lambda i: i.last_used, reverse=True):
            used = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(info.last_used))
            print(f"{tier:8s} {info.key.digest}  {info.nbytes:12d}  {used}")
    return 0


def _evict(store: TieredStore, args: argparse.Namespace) -> int:
    if not args.key and args.to_bytes is None:
        print("kvblend store evict: give --to-bytes SIZE and/or --key DIGEST", file=sys.stderr)
        return 2
    try:
        keys = [ChunkKey(args.tenant, digest) for digest in args.key]
    except ValueError as exc:
        print(f"kvblend store evict: {exc}", file=sys.stderr)
        return 2
    removed = sum(store.delete(key) for key in keys)
    if args.to_bytes is not None:
        removed += store.evict(args.tenant, args.to_bytes)
    print(f"evicted {removed} entries of tenant {args.tenant}")
    return 0


def _clear(store: TieredStore, args: argparse.Namespace) -> int:
    print(f"cleared {store.clear(args.tenant)} entries of tenant {args.tenant}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    args.dtype = args.dtype or StoreConfig.kv_dtype
    try:
        p = plan_capacity(args.layers, args.kv_heads, args.head_dim, args.dtype, args.budget, args.chunk_tokens)
    except ValueError as exc:
        print(f"kvblend store plan: {exc}", file=sys.stderr)
        return 2
    scales = f" + 2 x {args.layers} x {args.kv_heads} fp32 scales" if args.dtype == "int8" else ""
    print(f"KV per token: {p.bytes_per_token} bytes "
          f"(2 x {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} head dim x {args.dtype}{scales})")
    print(f"one {p.chunk_tokens}-token chunk: {p.chunk_bytes} bytes ({format_size(p.chunk_bytes)})")
    print(f"budget {format_size(p.budget_bytes)}: {p.chunks} chunks ({p.tokens} tokens)")
    return 0
