"""Content keys for chunk KV: sha256 over canonical bytes, stable across processes and machines.

The digest covers everything that changes the KV of a chunk: its token ids, the model
weights (fingerprint), the model config (a digest of every field that shapes K/V: head
counts, norm eps, sliding window, biases, ...), the tokenizer, the RoPE configuration, the
dtype the KV was computed in, the KV storage dtype, the prefix the chunk was computed
after, and the tenant namespace. Changing any of them gives another
key, so a model update or a new tenant can only miss, never read stale or foreign KV.
Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

from kvblend.store.codec import COMPUTE_DTYPES, STORAGE_DTYPES

KEY_VERSION = b"kvblend/chunk-key/v2"
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_MAX_TOKEN_ID = 2**63 - 1


def validate_tenant(tenant: str) -> str:
    """Return ``tenant`` or raise ValueError: letters, digits, ``-_.``, not starting with ``-_.``."""
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise ValueError(
            f"tenant must be 1-64 of letters, digits, '-', '_', '.' and start with a letter or digit; got {tenant!r}"
        )
    return tenant


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical bytes of token ids: little-endian unsigned 64-bit each."""
    ids = [int(t) for t in token_ids]
    if any(t < 0 or t > _MAX_TOKEN_ID for t in ids):
        raise ValueError("token ids must be non-negative 63-bit integers")
    return struct.pack(f"<{len(ids)}Q", *ids)


def prefix_digest(prefix: Sequence[int]) -> str:
    """sha256 hex of the canonical bytes of a chunk prefix."""
    return hashlib.sha256(token_bytes(prefix)).hexdigest()


def _normalize_json(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _normalize_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize_json(v) for v in value]
    return value


def canonical_rope(rope: str | dict[str, Any]) -> str:
    """Canonical JSON of a RoPE config: sorted keys, no spaces, integral floats as ints.

    ``{"rope_theta": 100000.0}`` and ``{"rope_theta": 1e5}`` and ``{"rope_theta": 100000}``
    give the same string, so a config read from GGUF or from HF JSON keys the same.
    """
    try:
        value = json.loads(rope) if isinstance(rope, str) else rope
        if not isinstance(value, dict):
            raise TypeError("not an object")
        return json.dumps(_normalize_json(value), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rope must be a JSON object (the RoPE config); got {rope!r}") from exc


def _field(name: bytes, value: bytes) -> bytes:
    return name + b"\0" + struct.pack("<Q", len(value)) + value


def digest_of(
    tokens: bytes, *, model: str, model_config: str, tokenizer: str, rope: str, compute_dtype: str, kv_dtype: str,
    prefix_sha256: str, tenant: str
) -> str:
    """sha256 hex over length-prefixed fields; every argument is already canonical."""
    h = hashlib.sha256(KEY_VERSION)
    for name, value in (
        (b"tenant", tenant.encode()),
        (b"model", model.encode()),
        (b"model_config", model_config.encode()),
        (b"tokenizer", tokenizer.encode()),
        (b"rope", rope.encode()),
        (b"compute_dtype", compute_dtype.encode()),
        (b"kv_dtype", kv_dtype.encode()),
        (b"prefix", prefix_sha256.encode()),
        (b"tokens", tokens),
    ):
        h.update(_field(name, value))
    return h.hexdigest()


@dataclass(frozen=True)
class KeyContext:
    """Everything besides the tokens that a chunk's KV depends on (see the module docstring).

    ``rope`` is the RoPE config as JSON (canonicalised before hashing); ``kv_dtype`` is the
    storage dtype name; ``chunk_prefix`` the token ids the chunk was prefilled after;
    ``compute_dtype`` the dtype the model computed the KV in; ``model_config`` a digest of
    the model config (``kvblend.models.config.kv_config_digest``; "" when none applies).
    """

    model_fingerprint: str
    tokenizer_fingerprint: str
    rope: str
    kv_dtype: str
    chunk_prefix: tuple[int, ...] = ()
    tenant: str = "default"
    compute_dtype: str = "fp32"
    model_config: str = ""

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "tokenizer_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string")
        if not isinstance(self.model_config, str):
            raise ValueError("model_config must be a string (a config digest)")
        canonical_rope(self.rope)
        if self.kv_dtype not in STORAGE_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(STORAGE_DTYPES)}; got {self.kv_dtype!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_DTYPES)}; got {self.compute_dtype!r}")
        object.__setattr__(self, "chunk_prefix", tuple(int(t) for t in self.chunk_prefix))
        token_bytes(self.chunk_prefix)
        validate_tenant(self.tenant)

    @cached_property
    def prefix_sha256(self) -> str:
        return prefix_digest(self.chunk_prefix)


@dataclass(frozen=True)
class ChunkKey:
    """Address of one chunk's KV: ``(tenant, digest)``; ``str(key)`` is ``tenant/digest``.

    Equality and hashing use tenant and digest only. ``context`` is carried by keys made
    with :func:`chunk_key` so that a store can write it into the entry header; keys parsed
    from text have none and can be used to read, list and delete, not to put.
    """

    tenant: str
    digest: str
    context: KeyContext | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_tenant(self.tenant)
        if not isinstance(self.digest, str) or not _DIGEST_RE.fullmatch(self.digest):
            raise ValueError(f"digest must be 64 lowercase hex characters; got {self.digest!r}")

    def __str__(self) -> str:
        return f"{self.tenant}/{self.digest}"

    @classmethod
    def parse(cls, text: str) -> ChunkKey:
        """Inverse of ``str(key)`` (without context)."""
        tenant, sep, digest = text.partition("/")
        if not sep:
            raise ValueError(f"expected 'tenant/digest'; got {text!r}")
        return cls(tenant, digest)


def chunk_key(token_ids: Sequence[int], ctx: KeyContext) -> ChunkKey:
    """The content key of a chunk whose KV was computed under ``ctx``. Pure and deterministic."""
    digest = digest_of(
        token_bytes(token_ids),
        model=ctx.model_fingerprint,
        model_config=ctx.model_config,
        tokenizer=ctx.tokenizer_fingerprint,
        rope=canonical_rope(ctx.rope),
        compute_dtype=ctx.compute_dtype,
        kv_dtype=ctx.kv_dtype,
        prefix_sha256=ctx.prefix_sha256,
        tenant=ctx.tenant,
    )
    return ChunkKey(ctx.tenant, digest, ctx)
