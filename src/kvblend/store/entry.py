"""A stored chunk: a self-describing header plus named storage tensors.

The header carries the key's inputs (tenant, model/tokenizer fingerprints, model-config
digest, RoPE, compute and KV dtypes, prefix digest, token ids), so a reader can recompute the digest and reject an entry that
was written for another model, tokenizer, tenant or text, plus ``base_position``, shapes
and an xxh3 checksum per tensor. The header itself is checksummed. Tensor names:
``k.{layer}``, ``v.{layer}`` and, for int8, ``k.{layer}.scale``, ``v.{layer}.scale``,
per token (``int8_scales: "token"`` in the header) or, in int8 entries written before
per-token scales (no such field), per channel: both decode as their header says.

An entry is read back in whatever dtype its header names, whatever the reader stores new
chunks in; which entries a server finds at all is the key's business (``keys``: the
storage dtype is hashed into it, so a server storing fp16 misses an fp32 store's entries
and recomputes them).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Mapping, Sequence

import torch

from kvblend.store.chunk import ChunkKV
from kvblend.store.codec import (
    SCALE_DTYPE,
    checksum,
    checksum_bytes,
    decode_into,
    encode_tensor,
    int8_scale_shape,
    legacy_int8_scale_shape,
    storage_dtype,
)
from kvblend.store.keys import ChunkKey, canonical_rope, digest_of, token_bytes

FORMAT = "kvblend-chunk/2"
TOKEN_SCALES = "token"  # EntryHeader.int8_scales of an int8 entry written now


class CorruptEntry(Exception):
    """A stored entry failed a check (header, identity, checksum, shape); it must not be used."""


@dataclass(frozen=True)
class EntryHeader:
    """Everything about a stored chunk except its tensors (see the module docstring)."""

    tenant: str
    digest: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    rope: str
    key_kv_dtype: str
    key_compute_dtype: str
    model_config: str
    prefix_sha256: str
    token_ids: tuple[int, ...]
    base_position: int
    kv_dtype: str
    n_layers: int
    n_heads: int
    head_dim: int
    checksums: Mapping[str, str] = field(default_factory=dict)
    created: float = 0.0
    int8_scales: str = ""  # "token" in an int8 entry written now; "" elsewhere and in older int8 ones (per channel)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> str:
        """The header as stored; ``int8_scales`` only when set (an int8 entry), so that
        other entries' headers stay what earlier versions read."""
        fields = asdict(self)
        if not self.int8_scales:
            del fields["int8_scales"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @cached_property
    def recomputed_digest(self) -> str:
        """The key digest this header's own context and tokens hash to (cached)."""
        return digest_of(
            token_bytes(self.token_ids),
            model=self.model_fingerprint,
            model_config=self.model_config,
            tokenizer=self.tokenizer_fingerprint,
            rope=canonical_rope(self.rope),
            compute_dtype=self.key_compute_dtype,
            kv_dtype=self.key_kv_dtype,
            prefix_sha256=self.prefix_sha256,
            tenant=self.tenant,
        )

    def tensor_names(self, layer: int) -> tuple[str, ...]:
        return layer_tensor_names(layer, self.kv_dtype)

    def tensor_spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Expected (dtype, shape) of a named tensor; an int8 scale's shape follows ``int8_scales``."""
        dims = (self.n_heads, self.n_tokens, self.head_dim)
        if name.endswith(".scale"):
            shape = int8_scale_shape if self.int8_scales == TOKEN_SCALES else legacy_int8_scale_shape
            return SCALE_DTYPE, shape(*dims)
        return storage_dtype(self.kv_dtype), dims


def layer_tensor_names(layer: int, kv_dtype: str) -> tuple[str, ...]:
    names = (f"k.{layer}", f"v.{layer}")
    return names + (f"k.{layer}.scale", f"v.{layer}.scale") if kv_dtype == "int8" else names


@lru_cache(maxsize=256)
def header_from_json(text: str) -> EntryHeader:
    """Parse and type-check a header; CorruptEntry on anything unexpected. Cached: the
    same text always gives the same (immutable) header, so per-layer reads parse it once."""
    try:
        raw: dict[str, Any] = json.loads(text)
        raw["token_ids"] = tuple(map(int, raw["token_ids"]))
        raw["checksums"] = {str(k): str(v) for k, v in raw["checksums"].items()}
        header = EntryHeader(**raw)
        _check_header_types(header)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CorruptEntry(f"unreadable entry header: {exc}") from exc
    return header


def _check_header_types(h: EntryHeader) -> None:
    ints = (h.base_position, h.n_layers, h.n_heads, h.head_dim)
    if not all(isinstance(v, int) and v >= 0 for v in ints):
        raise ValueError("header sizes must be non-negative integers")
    storage_dtype(h.kv_dtype)
    if h.int8_scales not in ("", TOKEN_SCALES) or (h.int8_scales and h.kv_dtype != "int8"):
        raise ValueError(f"unknown int8 scale layout {h.int8_scales!r}")
    expected = {n for layer in range(h.n_layers) for n in h.tensor_names(layer)}
    if set(h.checksums) != expected:
        raise ValueError("header checksums do not name exactly the tensors of the entry")


def header_fields(header: EntryHeader) -> dict[str, str]:
    """The string metadata stored with an entry (safetensors metadata, Redis hash fields)."""
    text = header.to_json()
    return {"format": FORMAT, "header": text, "header_xxh3": checksum_bytes(text.encode())}


def parse_header_fields(fields: Mapping[str, str | bytes | None]) -> EntryHeader:
    """Inverse of :func:`header_fields`, verifying format and header checksum."""
    fmt, text, check = (_as_text(fields.get(n)) for n in ("format", "header", "header_xxh3"))
    if fmt != FORMAT or text is None:
        raise CorruptEntry(f"not a {FORMAT} entry")
    if checksum_bytes(text.encode()) != check:
        raise CorruptEntry("entry header checksum mismatch")
    return header_from_json(text)


def _as_text(value: str | bytes | None) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value


def check_identity(header: EntryHeader, key: ChunkKey) -> None:
    """CorruptEntry unless the header is the one ``key`` names: tenant, digest, and a digest
    recomputed from the header's own tokens and context (catches wrong-model entries)."""
    if header.tenant != key.tenant or header.digest != key.digest:
        raise CorruptEntry(f"entry header names {header.tenant}/{header.digest}, not {key}")
    try:
        recomputed = header.recomputed_digest
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptEntry(f"entry header context is malformed: {exc}") from exc
    if recomputed != key.digest:
        raise CorruptEntry("entry header does not hash to its key (wrong model, tokenizer or tokens)")


def verify_tensor(header: EntryHeader, name: str, tensor: torch.Tensor) -> None:
    """CorruptEntry unless ``tensor`` has the expected dtype, shape and checksum."""
    dtype, shape = header.tensor_spec(name)
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise CorruptEntry(f"{name}: expected {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
    if checksum(tensor) != header.checksums.get(name):
        raise CorruptEntry(f"{name}: checksum mismatch")


@dataclass(frozen=True)
class Entry:
    """A chunk in storage form.

    ``owned``: the tensors are private, writable memory that nothing else references (a
    fresh encoding, a whole-file read), so a store may keep them without copying and a
    reader may hand them out without copying. Entries over memory a store keeps, a file
    mapping or a read-only network reply are not owned.
    """

    header: EntryHeader
    tensors: Mapping[str, torch.Tensor]
    owned: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def owned_copy(self) -> Entry:
        """This entry if owned, else one with private copies of the tensors."""
        if self.owned:
            return self
        return Entry(self.header, {n: t.clone() for n, t in self.tensors.items()}, owned=True)

    def shared(self) -> Entry:
        """The same tensors, marked as referenced elsewhere (readers must copy)."""
        return Entry(self.header, self.tensors, owned=False)


def encode_chunk(key: ChunkKey, chunk: ChunkKV, kv_dtype: str) -> Entry:
    """Encode ``chunk`` for storage under ``key`` (copies; the caller's tensors are untouched).

    ValueError when ``key`` has no context or does not hash ``chunk.token_ids``: storing
    KV under another text's key would serve it to the wrong requests.
    """
    header = _header_for(key, chunk, kv_dtype)
    tensors: dict[str, torch.Tensor] = {}
    for layer, (k, v) in enumerate(zip(chunk.keys, chunk.values)):
        tensors.update(_encode_layer(layer, k, v, kv_dtype))
    sums = {name: checksum(t) for name, t in tensors.items()}
    return Entry(_with_checksums(header, sums), tensors, owned=True)


def _encode_layer(layer: int, k: torch.Tensor, v: torch.Tensor, kv_dtype: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, x in ((f"k.{layer}", k), (f"v.{layer}", v)):
        data, scale = encode_tensor(x.cpu(), kv_dtype)
        out[name] = data
        if scale is not None:
            out[f"{name}.scale"] = scale
    return out


def _header_for(key: ChunkKey, chunk: ChunkKV, kv_dtype: str) -> EntryHeader:
    ctx = key.context
    if ctx is None:
        raise ValueError("put needs a key made by chunk_key(): it carries the context written into the entry")
    heads, _, head_dim = chunk.keys[0].shape if chunk.n_layers else (0, 0, 0)
    header = EntryHeader(
        tenant=key.tenant, digest=key.digest, model_fingerprint=ctx.model_fingerprint,
        tokenizer_fingerprint=ctx.tokenizer_fingerprint, rope=ctx.rope, key_kv_dtype=ctx.kv_dtype,
        key_compute_dtype=ctx.compute_dtype, model_config=ctx.model_config, prefix_sha256=ctx.prefix_sha256, token_ids=tuple(int(t) for t in chunk.token_ids),
        base_position=int(chunk.base_position), kv_dtype=kv_dtype, n_layers=chunk.n_layers,
        n_heads=int(heads), head_dim=int(head_dim), created=time.time(),
        int8_scales=TOKEN_SCALES if kv_dtype == "int8" else "",
    )
    if header.recomputed_digest != key.digest:
        raise ValueError(f"chunk token ids do not hash to key {key}")
    return header


def _with_checksums(header: EntryHeader, sums: dict[str, str]) -> EntryHeader:
    return EntryHeader(**{**asdict(header), "token_ids": header.token_ids, "checksums": sums})


def _decode_pair(h: EntryHeader, tensors: Mapping[str, torch.Tensor], layer: int, out: torch.Tensor) -> None:
    """Decode layer ``layer`` into ``out`` of shape (2, heads, tokens, head_dim)."""
    for i, name in enumerate((f"k.{layer}", f"v.{layer}")):
        scale = tensors.get(f"{name}.scale") if h.kv_dtype == "int8" else None
        decode_into(out[i], tensors[name], scale)


def decode_layer(header: EntryHeader, tensors: Mapping[str, torch.Tensor], layer: int,
                 dtype: torch.dtype, owned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of ``layer`` in ``dtype`` that the caller owns, each (heads, tokens, head_dim);
    ``owned`` tensors already in ``dtype`` are handed out as they are."""
    if owned and _plain(header, dtype):
        return tensors[f"k.{layer}"], tensors[f"v.{layer}"]
    out = torch.empty(2, header.n_heads, header.n_tokens, header.head_dim, dtype=dtype)
    _decode_pair(header, tensors, layer, out)
    return out[0], out[1]


def decode_entry(entry: Entry, dtype: torch.dtype, borrow: bool = False) -> ChunkKV:
    """A ChunkKV in ``dtype`` that the caller owns. An owned entry already in ``dtype``
    is handed out as is (zero copy); otherwise all layers are decoded into one new
    allocation. ``borrow``: the caller will only read the tensors and owns nothing, so
    a shared entry already in ``dtype`` is handed out as is too (its tensors stay the
    store's)."""
    h = entry.header
    if (entry.owned or borrow) and _plain(h, dtype):
        return _chunk_of(h, [entry.tensors[f"k.{i}"] for i in range(h.n_layers)],
                         [entry.tensors[f"v.{i}"] for i in range(h.n_layers)])
    out = torch.empty(h.n_layers, 2, h.n_heads, h.n_tokens, h.head_dim, dtype=dtype)  # (L, K/V, H, T, D)
    for layer in range(h.n_layers):
        _decode_pair(h, entry.tensors, layer, out[layer])
    return _chunk_of(h, list(out[:, 0].unbind(0)), list(out[:, 1].unbind(0)))


def _plain(h: EntryHeader, dtype: torch.dtype) -> bool:
    """Whether stored tensors are already what the reader wants (no scale, same dtype)."""
    return h.kv_dtype != "int8" and storage_dtype(h.kv_dtype) == dtype


def _chunk_of(h: EntryHeader, keys: list[torch.Tensor], values: list[torch.Tensor]) -> ChunkKV:
    return ChunkKV(token_ids=h.token_ids, base_position=h.base_position, keys=tuple(keys), values=tuple(values))


def tokens_match(header: EntryHeader, token_ids: Sequence[int] | None) -> bool:
    """True when no token ids are given or they equal the entry's."""
    return token_ids is None or tuple(int(t) for t in token_ids) == header.token_ids
