"""``kvblend store ...`` as the command line runs it: the locations a flag does not give
come from the settings ``kvblend serve`` reads, then ``kvblend.store.cli`` runs the command."""

from __future__ import annotations

import argparse
import os


def cmd_store(args: argparse.Namespace) -> int:
    from kvblend.store.cli import run_store_command

    if args.store_command == "plan":
        if args.dtype is None:
            from kvblend.settings import Settings

            args.dtype = Settings.load().store.kv_dtype
    else:
        fill_from_settings(args)
    return run_store_command(args)


def fill_from_settings(args: argparse.Namespace) -> None:
    """Locations not given as flags, from the settings ``kvblend serve`` reads: the disk
    folder when it exists (a command that only reads must not create it) and the disk tier
    is on, the Redis URL, prefix, cluster flag and groups."""
    from kvblend.settings import Settings

    store = Settings.load().store
    if args.disk_dir is None and args.redis_url is None:
        if "disk" in store.tiers and os.path.isdir(store.disk_folder):
            args.disk_dir = store.disk_folder
        if "redis" in store.tiers:
            args.redis_url = store.redis_url
    for name in ("redis_prefix", "redis_cluster", "redis_groups"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(store, name))
