"""``kvblend profile``: measure this model's costs on this device and store the profile.

Prints the fits, each configured tier's per-layer load speed, and (unless ``--no-quality``)
the next-token KL against fp32 storage of a blended request whose chunk KV was stored in
fp16, bf16 or int8, so that the storage dtype can be chosen knowingly.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

QUALITY_DTYPES = ("fp16", "bf16", "int8")


def dtype_quality(loaded, documents: Sequence[str], question: str, ratio: float = 0.15,
                  dtypes: Sequence[str] = QUALITY_DTYPES) -> dict[str, float]:
    """Next-token KL(fp32 storage ‖ dtype storage) of one blended request at ``ratio``."""
    from kvblend.blend.config import BlendConfig
    from kvblend.engine import Engine, Request
    from kvblend.metrics import kl_divergence
    from kvblend.store.config import StoreConfig, build_store

    request = Request(documents=list(documents), question=question, blend=BlendConfig(ratio=ratio))

    def logits(kv_dtype: str):
        engine = Engine(loaded, build_store(StoreConfig(tiers=("memory",), kv_dtype=kv_dtype)), calibrate=False)
        try:
            engine.warm(list(documents), engine.chunk_prefix(request, engine.layout(request)))
            return engine.prepare(request).logits
        finally:
            engine.close()

    reference = logits("fp32")
    return {dt: kl_divergence(reference, logits(dt)) for dt in dtypes}


def _sample_example():
    from kvblend.data import MUSIQUE_SAMPLE
    from kvblend.eval.datasets import load_musique

    return load_musique(MUSIQUE_SAMPLE, n_docs=3, limit=1)[0]


def cmd_profile(args: argparse.Namespace) -> int:
    from kvblend.cliargs import load_from_args
    from kvblend.pipeline.profile import measure_profile, profile_path, save_profile
    from kvblend.store.config import build_store

    from kvblend.settings import Settings

    args.kv_dtype = args.kv_dtype or Settings.load().store.kv_dtype
    loaded = load_from_args(args)
    store = build_store(profiled_store(args))
    try:
        profile = measure_profile(loaded.model, loaded.fingerprint, store.tiers, progress=not args.json)
    finally:
        store.close()
    if not args.no_quality:
        example = _sample_example()
        quality = dtype_quality(loaded, example.documents, example.question)
        profile = replace(profile, quality=quality)
    path = profile_path(loaded.fingerprint, loaded.model.device, loaded.model.dtype)
    save_profile(profile, path)
    if args.json:
        print(profile.to_json())
    else:
        _print_profile(profile, loaded.model.cfg, args.kv_dtype)
        print(f"saved to {path}")
    return 0


def _print_profile(profile, cfg, kv_dtype: str) -> None:
    from kvblend.pipeline.profile import layer_bytes

    a, b, c = profile.prefill
    print(f"full prefill: {a:.4f} + {b:.3e} L + {c:.3e} L^2 s   (512: {profile.prefill_s(512):.3f} s, "
          f"3072: {profile.prefill_s(3072):.3f} s)")
    a, b, c = profile.layer
    print(f"one layer:    {a:.4f} + ({b:.3e} + {c:.3e} N) n s   (n=460 of N=3072: {profile.layer_s(460, 3072):.4f} s)")
    nbytes = layer_bytes(cfg, 512, kv_dtype)
    for name, speed in profile.tiers.items():
        if speed.immediate:
            print(f"tier {name:7s} lent from memory (no load)")
        else:
            print(f"tier {name:7s} {speed.latency_s * 1e3:.3f} ms + {speed.bytes_per_s / 1e9:.2f} GB/s   "
                  f"(one layer of a 512-token {kv_dtype} chunk: {speed.layer_s(nbytes) * 1e3:.2f} ms)")
    for dt, kl in profile.quality.items():
        print(f"quality {dt:5s} KL vs fp32 storage {kl:.2e}")


def profiled_store(args: argparse.Namespace):  # noqa: ANN201 - kvblend.store.config.StoreConfig
    """The tiers to measure: memory, the disk tier at ``--store-dir`` and the Redis tier at
    ``--redis-url`` when given, Redis reached as ``kvblend serve`` reaches it (a Redis
    Cluster in the settings is measured as one)."""
    from kvblend.settings import Settings

    return replace(Settings.load().store.flagged(args.store_dir, args.redis_url, args.kv_dtype), disk_fsync=False)


def add_profile_command(subparsers: argparse._SubParsersAction) -> None:
    from kvblend.cliargs import add_model_args
    from kvblend.store.codec import STORAGE_DTYPES

    p = subparsers.add_parser("profile", help="measure prefill/recompute/load costs for the loading controller")
    add_model_args(p)  # --model, --device, --dtype: the same defaults (KVBLEND_* settings) as every command
    p.add_argument("--store-dir", default=None, help="disk tier directory to measure")
    p.add_argument("--redis-url", default=None, help="Redis tier to measure")
    p.add_argument("--kv-dtype", default=None, choices=sorted(STORAGE_DTYPES),
                   help="storage dtype of the tiers (default: store.kv_dtype)")
    p.add_argument("--no-quality", action="store_true", help="skip the KL-per-storage-dtype measurement")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)

