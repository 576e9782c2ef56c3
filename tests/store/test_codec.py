from __future__ import annotations

import pytest
import torch

from kvblend.store.codec import (
    checksum, decode_into, encode_tensor, int8_scale_shape, legacy_int8_scale_shape, storage_dtype, tensor_from_bytes,
)


@pytest.mark.parametrize("kv_dtype,tol", [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 8e-3), ("int8", 0.5 / 127 + 1e-6)])
def test_round_trip_error_is_bounded(kv_dtype: str, tol: float) -> None:
    """Each decoded element is within ``tol`` of its (head, token) vector's largest magnitude:
    half an int8 step, or the float formats' rounding (fp16 2^-11, bf16 2^-8, relative)."""
    x = torch.randn(3, 16, 8)
    data, scale = encode_tensor(x, kv_dtype)
    assert data.dtype == storage_dtype(kv_dtype) and data.is_contiguous()
    y = decode_into(torch.empty_like(x), data, scale)
    rel = ((y - x).abs() / x.abs().amax(dim=-1, keepdim=True)).max().item()
    assert rel <= tol


@pytest.mark.parametrize("dest_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp16_storage_decodes_into_every_compute_dtype(dest_dtype: torch.dtype) -> None:
    x = torch.randn(2, 9, 8) * 30.0
    data, scale = encode_tensor(x, "fp16")
    y = decode_into(torch.empty(x.shape, dtype=dest_dtype), data, scale)
    assert scale is None and y.dtype == dest_dtype
    torch.testing.assert_close(y.float(), x.half().to(dest_dtype).float(), rtol=0, atol=0)


def test_int8_scales_are_per_token_and_head() -> None:
    x = torch.randn(2, 10, 4)
    x[1, 3, :] *= 1000.0  # one outlier token (an attention sink) must not crush the others
    data, scale = encode_tensor(x, "int8")
    assert scale is not None and scale.shape == int8_scale_shape(2, 10, 4) == (2, 10, 1)
    torch.testing.assert_close(scale[:, :, 0], x.abs().amax(dim=-1) / 127)
    y = decode_into(torch.empty_like(x), data, scale)
    others = torch.ones(2, 10, dtype=torch.bool)
    others[1, 3] = False
    step = x.abs().amax(dim=-1)[others].max() / 127
    assert (y - x)[others].abs().max() <= step * 0.51
    assert (y[1, 3] - x[1, 3]).abs().max() <= x[1, 3].abs().max() / 127 * 0.51


def test_legacy_per_channel_scales_still_decode() -> None:
    """An int8 entry written before per-token scales holds one scale per (head, channel)."""
    x = torch.randn(2, 5, 4)
    scale = x.abs().amax(dim=1, keepdim=True) / 127  # (H, 1, D), the old layout
    q = torch.round(x / scale).to(torch.int8)
    assert scale.shape == legacy_int8_scale_shape(2, 5, 4)
    y = decode_into(torch.empty_like(x), q, scale)
    assert (y - x).abs().max() <= scale.max() * 0.51


def test_int8_handles_all_zero_channels() -> None:
    x = torch.zeros(1, 5, 2)
    data, scale = encode_tensor(x, "int8")
    y = decode_into(torch.empty_like(x), data, scale)
    assert torch.equal(y, x) and torch.isfinite(scale).all()


def test_encode_copies() -> None:
    x = torch.randn(1, 3, 2)
    data, _ = encode_tensor(x, "fp32")
    x.add_(1.0)
    assert not torch.equal(data, x)


def test_checksum_sees_every_byte() -> None:
    x = torch.randn(2, 3, 4)
    y = x.clone()
    y.view(torch.uint8).view(-1)[37] ^= 1
    assert checksum(x) != checksum(y) and checksum(x) == checksum(x.clone())


def test_tensor_from_bytes_checks_size() -> None:
    t = tensor_from_bytes(bytes(24), torch.float32, (2, 3))
    assert t.shape == (2, 3)
    with pytest.raises(ValueError):
        tensor_from_bytes(bytes(20), torch.float32, (2, 3))
