"""Storage encodings of KV tensors (fp32, fp16, bf16, int8 with per-token scales) and checksums.

A stored layer is one K and one V tensor of shape (heads, tokens, head_dim) in the storage
dtype; int8 adds one fp32 scale per (head, token) for each, of shape (heads, tokens, 1):
a token's vector is quantized against its own range, so one token with large values
(an attention sink) costs no other token its precision. Entries written before that
carry one scale per (head, channel), shape (heads, 1, head_dim) (``LEGACY_INT8_SCALES``);
they still decode, the scale broadcasting either way (``legacy_int8_scale_shape``).
Checksums are xxh3-128 over the raw bytes: fast enough (~20 GB/s) to verify every hit
without halving load bandwidth.
"""

from __future__ import annotations

import torch
import xxhash

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
SCALE_DTYPE = torch.float32
_INT8_MAX = 127.0


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype a KV dtype name is stored in (ValueError for unknown names)."""
    if kv_dtype not in STORAGE_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(STORAGE_DTYPES)}; got {kv_dtype!r}")
    return STORAGE_DTYPES[kv_dtype]


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype loaded KV is converted to (ValueError for unknown names)."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {sorted(COMPUTE_DTYPES)}; got {name!r}")
    return COMPUTE_DTYPES[name]


def compute_dtype_name(dtype: torch.dtype) -> str:
    """Inverse of :func:`compute_dtype` ("fp32", "fp16", "bf16"); ValueError for others."""
    for name, known in COMPUTE_DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"models compute in one of {sorted(COMPUTE_DTYPES)}; got {dtype}")


def bytes_per_element(kv_dtype: str) -> int:
    return torch.empty((), dtype=storage_dtype(kv_dtype)).element_size()


def int8_scale_shape(heads: int, tokens: int, head_dim: int) -> tuple[int, int, int]:
    """Shape of an int8 tensor's scales: one per (head, token)."""
    return (heads, tokens, 1)


def legacy_int8_scale_shape(heads: int, tokens: int, head_dim: int) -> tuple[int, int, int]:
    """Shape of the scales of int8 entries written before per-token scales: one per (head, channel)."""
    return (heads, 1, head_dim)


def encode_tensor(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Own a contiguous copy of ``x`` (heads, tokens, head_dim) in the storage dtype.

    Returns (data, scale); scale is None except for int8, where it is each (head, token)
    vector's absmax / 127, shape (heads, tokens, 1). Values round to the nearest step, so
    a decoded element is within half a step (scale / 2) of ``x``.
    """
    if kv_dtype != "int8":
        return x.detach().to(storage_dtype(kv_dtype), copy=True).contiguous(), None
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)  # (H, T, 1)
    scale = (amax / _INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(xf / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def decode_into(dest: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Write ``data`` (× ``scale`` for int8, per token or, in older entries, per channel:
    it broadcasts) into ``dest``, converting to its dtype."""
    dest.copy_(data)
    if scale is not None:
        dest.mul_(scale.to(dest.dtype))
    return dest


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def checksum(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of the tensor's raw bytes."""
    return checksum_bytes(tensor_bytes(t))


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor holding a copy of ``data`` (private and writable, so it can be handed
    out as is); ValueError when the size does not match."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = itemsize
    for dim in shape:
        expected *= dim
    if len(data) != expected:
        raise ValueError(f"expected {expected} bytes for {shape} {dtype}, got {len(data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
