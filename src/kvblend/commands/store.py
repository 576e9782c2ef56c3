"""``kvblend store ...`` as the command line runs it: the locations a flag does not give
come from the settings ``kvblend serve`` reads, then ``kvblend.store.cli`` runs the command."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_store(args: argparse.Namespace) -> int:
    from kvblend.store.cli import run_store_command

    if args.store_command == "plan":
        if args.dtype is None:
            from kvblend.settings import Settings

            args.dtype = Settings.load().store.kv_dtype
    else:
        missing = fill_from_settings(args)
        if missing and args.disk_dir is None and args.redis_url is None:
            print(f"kvblend store: nothing stored yet: the settings' disk folder {missing} does not exist "
                  "(serve, ingest and ask create it); give --disk-dir or --redis-url for another store",
                  file=sys.stderr)
            return 1
    return run_store_command(args)


def fill_from_settings(args: argparse.Namespace) -> str | None:
    """With neither location flag, the store the settings ``kvblend serve`` reads name: the
    disk folder when the disk tier is on and the folder exists (a command that only reads
    must not create it), the Redis URL with its prefix, cluster flag and groups. Returns
    the settings' disk folder when it was left out for not existing yet."""
    from kvblend.settings import Settings

    if args.disk_dir is not None or args.redis_url is not None:
        return None  # the flags name the store (store.cli's defaults for the rest)
    store = Settings.load().store
    missing = None
    if "disk" in store.tiers:
        if os.path.isdir(store.disk_folder):
            args.disk_dir = store.disk_folder
        else:
            missing = store.disk_folder
    if "redis" in store.tiers:
        args.redis_url = store.redis_url
    for name in ("redis_prefix", "redis_cluster", "redis_groups"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(store, name))
    return missing
