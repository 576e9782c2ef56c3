from __future__ import annotations

import pytest
import torch

from kvblend.store.codec import checksum, decode_into, encode_tensor, storage_dtype, tensor_from_bytes


@pytest.mark.parametrize("kv_dtype,tol", [("fp32", 0.0), ("fp16", 2e-3), ("bf16", 2e-2), ("int8", 1.5e-2)])
def test_round_trip_error_is_bounded(kv_dtype: str, tol: float) -> None:
    x = torch.randn(3, 16, 8)
    data, scale = encode_tensor(x, kv_dtype)
    assert data.dtype == storage_dtype(kv_dtype) and data.is_contiguous()
    y = decode_into(torch.empty_like(x), data, scale)
    rel = ((y - x).abs().amax(dim=1) / x.abs().amax(dim=1)).max().item()  # per channel, relative to its range
    assert rel <= tol


def test_int8_scales_are_per_channel() -> None:
    x = torch.randn(2, 10, 4)
    x[1, :, 3] *= 1000.0  # one outlier channel must not crush the others
    data, scale = encode_tensor(x, "int8")
    assert scale is not None and scale.shape == (2, 1, 4)
    y = decode_into(torch.empty_like(x), data, scale)
    assert (y[0] - x[0]).abs().max() <= x[0].abs().max() / 127 * 0.51 + 1e-6


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
