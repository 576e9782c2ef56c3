"""Capacity planning: bytes of KV per token and how many chunks fit a budget."""

from __future__ import annotations

import re
from typing import NamedTuple

from kvblend.store.codec import bytes_per_element

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
SCALE_BYTES = 4  # int8: one fp32 scale per (layer, K/V, KV head) and token


def parse_size(text: str | int) -> int:
    """Bytes from ``"10GiB"``, ``"512MB"``, ``"1.5g"`` or a plain integer (ValueError otherwise)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 10GiB, 512MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: float) -> str:
    """``1536`` → ``"1.50 KiB"``."""
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if abs(nbytes) < 1024:
            return f"{nbytes:.2f} {unit}"
    return f"{nbytes / 1024:.2f} TiB"


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Stored bytes of one token's KV: 2 (K and V) × layers × KV heads × (head dim × bytes
    per element, plus for int8 the token's own fp32 scale)."""
    scale = SCALE_BYTES if kv_dtype == "int8" else 0
    return 2 * layers * kv_heads * (head_dim * bytes_per_element(kv_dtype) + scale)


class CapacityPlan(NamedTuple):
    bytes_per_token: int
    chunk_tokens: int
    chunk_bytes: int  # tensor bytes of one chunk (int8 scales included)
    budget_bytes: int
    chunks: int  # whole chunks that fit the budget
    tokens: int  # tokens those chunks hold


def plan_capacity(layers: int, kv_heads: int, head_dim: int, kv_dtype: str, budget_bytes: int,
                  chunk_tokens: int) -> CapacityPlan:
    """How many chunks of ``chunk_tokens`` fit ``budget_bytes`` (tensor bytes; file
    headers add a few bytes per token and a few KiB per chunk)."""
    if min(layers, kv_heads, head_dim, chunk_tokens) < 1 or budget_bytes < 0:
        raise ValueError("layers, kv_heads, head_dim and chunk_tokens must be >= 1, budget >= 0")
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype)
    chunk_bytes = per_token * chunk_tokens
    chunks = budget_bytes // chunk_bytes
    return CapacityPlan(per_token, chunk_tokens, chunk_bytes, budget_bytes, chunks, chunks * chunk_tokens)
