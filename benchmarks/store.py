"""Load bandwidth of each store tier for one 512-token chunk, next to the raw medium.

SmolLM2-135M shape (30 layers, 3 KV heads, head_dim 64), fp32 compute, KV stored in
``--kv-dtype`` (fp32: 23.6 MB per chunk; fp16 half). For each tier it times a whole-chunk
``get`` (verified, decoded into fresh fp32 tensors) and the 30 ``get_layer`` calls, and
compares with the raw medium measured in the same run on the stored bytes: memory = torch
clone of that many bytes in one tensor, disk = reading a plain file of that size (both
from the page cache), redis = GET of one blob of that size. GB/s count the decoded fp32
bytes, so dtypes compare by what a load delivers; ``*_ms`` is one chunk's load. Tier and raw loads run interleaved so that they see the
same machine and allocator state; medians are reported. Prints a table, then ONE line of
JSON with the headline figures (GB/s, and ratio = tier / raw).

    python benchmarks/store.py [--repeats 9] [--tokens 512] [--kv-dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import redis
import torch

from kvblend.store import ChunkKV, DiskStore, KeyContext, MemoryStore, RedisStore, chunk_key
from kvblend.store.codec import STORAGE_DTYPES
from kvblend.store.entry import encode_chunk
from kvblend.store.keys import ChunkKey
from kvblend.store.localredis import LocalRedis, RedisServerMissing
from kvblend.store.tier import Tier

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
GiB = 1024**3


def make_chunk(tokens: int, kv_dtype: str = "fp32") -> tuple[ChunkKey, ChunkKV]:
    torch.manual_seed(0)
    ids = tuple(range(1000, 1000 + tokens))
    kv = [torch.randn(KV_HEADS, tokens, HEAD_DIM) for _ in range(2 * LAYERS)]  # (H, T, D) each
    ctx = KeyContext("bench-model", "bench-tokenizer", '{"rope_theta": 100000}', kv_dtype)
    return chunk_key(ids, ctx), ChunkKV(ids, 0, tuple(kv[:LAYERS]), tuple(kv[LAYERS:]))


def paired_seconds(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each function, run interleaved (a, b, c, a, b, c, ...) so that
    all of them see the same machine and allocator state; one warm-up round first."""
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            if round_:
                samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def tier_loads(tier: Tier, key: ChunkKey, chunk: ChunkKV) -> tuple[Callable[[], object], Callable[[], object]]:
    """Store the chunk, then return (load whole chunk, load all layers one by one)."""
    if not tier.put(key, chunk):
        raise RuntimeError(f"{tier.name}: put refused")

    def whole() -> None:
        if tier.get(key, chunk.token_ids) is None:
            raise RuntimeError(f"{tier.name}: unexpected miss")

    def layers() -> None:
        for layer in range(LAYERS):
            if tier.get_layer(key, layer) is None:
                raise RuntimeError(f"{tier.name}: unexpected layer miss")

    return whole, layers


def raw_memory(nbytes: int) -> Callable[[], object]:
    flat = torch.empty(nbytes, dtype=torch.uint8).random_()  # as many bytes, one buffer
    return flat.clone


def raw_disk(directory: str, nbytes: int) -> Callable[[], object]:
    path = os.path.join(directory, "raw.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))

    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return read


def raw_redis(client: redis.Redis, nbytes: int) -> Callable[[], object]:
    client.set("bench:raw", os.urandom(nbytes))
    return lambda: client.get("bench:raw")


def measure(name: str, tier: Tier, raw: Callable[[], object], key: ChunkKey, chunk: ChunkKV,
            repeats: int) -> dict[str, float]:
    whole, layers = tier_loads(tier, key, chunk)
    whole_s, layers_s, raw_s = paired_seconds([whole, layers, raw], repeats)
    return report(name, chunk.nbytes, (whole_s, layers_s), raw_s, stored_bytes(key, chunk, tier.kv_dtype))


def stored_bytes(key: ChunkKey, chunk: ChunkKV, kv_dtype: str) -> int:
    return encode_chunk(key, chunk, kv_dtype).nbytes


def report(name: str, nbytes: int, tier_s: tuple[float, float], raw_s: float, raw_bytes: int) -> dict[str, float]:
    """GB/s of the decoded ``nbytes`` for the tier's loads, of ``raw_bytes`` for the medium."""
    whole, layers = gbps(nbytes, tier_s[0]), gbps(nbytes, tier_s[1])
    raw = gbps(raw_bytes, raw_s)
    row = {f"{name}_gbps": whole, f"{name}_layer_gbps": layers, f"{name}_raw_gbps": raw,
           f"{name}_ratio": round(whole / raw, 3), f"{name}_layer_ratio": round(layers / raw, 3),
           f"{name}_ms": round(tier_s[0] * 1e3, 2), f"{name}_layer_ms": round(tier_s[1] * 1e3, 2)}
    print(f"{name:7s} whole {whole:7.2f} GB/s   per layer {layers:7.2f} GB/s   raw {raw:7.2f} GB/s   "
          f"ratio {row[f'{name}_ratio']:.2f} / {row[f'{name}_layer_ratio']:.2f}")
    return row


def bench_redis(key: ChunkKey, chunk: ChunkKV, repeats: int, kv_dtype: str) -> dict[str, float | None]:
    try:
        server = LocalRedis().start()
    except RedisServerMissing as exc:
        print(f"redis   skipped: {exc}")
        return {"redis_gbps": None, "redis_raw_gbps": None, "redis_ratio": None}
    client = redis.Redis.from_url(server.url)
    tier = RedisStore(server.url, 4 * GiB, timeout_s=30.0, kv_dtype=kv_dtype)
    try:
        return measure("redis", tier, raw_redis(client, stored_bytes(key, chunk, kv_dtype)), key, chunk, repeats)
    finally:
        tier.close()
        client.close()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--kv-dtype", choices=sorted(STORAGE_DTYPES), default="fp32",
                        help="storage dtype of every tier (default: %(default)s, the exact reference)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dt = args.kv_dtype
    key, chunk = make_chunk(args.tokens, dt)
    stored = stored_bytes(key, chunk, dt)
    print(f"chunk: {args.tokens} tokens, {LAYERS} layers, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, fp32: "
          f"{chunk.nbytes / 1e6:.1f} MB, stored in {dt}: {stored / 1e6:.1f} MB")
    summary: dict[str, float | int | str | None] = {"chunk_bytes": chunk.nbytes, "stored_bytes": stored,
                                                    "kv_dtype": dt, "tokens": args.tokens}
    summary |= measure("memory", MemoryStore(4 * GiB, kv_dtype=dt), raw_memory(stored), key, chunk, args.repeats)
    with tempfile.TemporaryDirectory(prefix="kvblend-bench-") as directory:
        disk = DiskStore(os.path.join(directory, "store"), 4 * GiB, kv_dtype=dt)
        summary |= measure("disk", disk, raw_disk(directory, stored), key, chunk, args.repeats)
    summary |= bench_redis(key, chunk, args.repeats, dt)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
