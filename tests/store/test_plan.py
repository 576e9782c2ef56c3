from __future__ import annotations

import pytest

from kvblend.store.plan import format_size, kv_bytes_per_token, parse_size, plan_capacity


def test_smollm2_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(30, 3, 64, "fp32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(30, 3, 64, "bf16") == kv_bytes_per_token(30, 3, 64, "fp16") == 23040
    assert kv_bytes_per_token(30, 3, 64, "int8") == 11520 + 2 * 30 * 3 * 4 == 12240  # one fp32 scale per token and head


def test_chunks_that_fit_a_budget() -> None:
    plan = plan_capacity(30, 3, 64, "fp32", 10 * 1024**3, 512)
    assert plan.chunk_bytes == 46080 * 512 and plan.chunks == 10 * 1024**3 // (46080 * 512) == 455
    assert plan.tokens == 455 * 512
    int8 = plan_capacity(30, 3, 64, "int8", 10 * 1024**3, 512)
    assert int8.chunk_bytes == 12240 * 512 and int8.chunks == 10 * 1024**3 // (12240 * 512)


@pytest.mark.parametrize("text,value", [("10GiB", 10 * 1024**3), ("512MB", 512 * 10**6), ("1.5k", 1500),
                                        ("4096", 4096), (" 2 mib ", 2 * 1024**2), (7, 7)])
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "10 parsecs", "-1GiB", "1e3"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B" and format_size(1536) == "1.50 KiB" and format_size(3 * 1024**4) == "3.00 TiB"


def test_plan_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        plan_capacity(0, 3, 64, "fp32", 100, 512)
    with pytest.raises(ValueError):
        plan_capacity(30, 3, 64, "fp8", 100, 512)
