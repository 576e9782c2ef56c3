"""Entries an older kvblend wrote stay correct after the storage default moved to fp16 and
int8 moved to per-token scales: an fp32 entry still loads exactly (through its own key,
whatever the reading tier stores new chunks in), and an int8 entry with the old per-channel
scales decodes with them, on every tier (memory, disk, Redis)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Callable

import pytest
import torch

from kvblend.store.codec import checksum
from kvblend.store.entry import CorruptEntry, Entry, EntryHeader, encode_chunk, header_fields, parse_header_fields
from kvblend.store.tier import Tier
from tests.store.helpers import assert_same_chunk, keyed


def test_an_fp32_entry_loads_exactly_in_a_tier_that_stores_fp16(make_tier: Callable[..., Tier]) -> None:
    reader = make_tier(kv_dtype="fp16")
    key, chunk = keyed(1, kv_dtype="fp32")
    assert reader.store(encode_chunk(key, chunk, "fp32"))  # as an fp32 server wrote it
    got = reader.get(key, chunk.token_ids)
    assert got is not None and got.keys[0].dtype == torch.float32
    assert_same_chunk(got, chunk)  # exact: decoded as the header says (fp32), not as the reader stores
    assert reader.get_layer(key, 1) is not None and reader.stats().errors == 0


def legacy_int8_entry(seed: int = 2) -> tuple[Entry, object]:
    """An int8 entry as written before per-token scales: one scale per (head, channel), and
    no ``int8_scales`` field in its header; with the chunk it encodes."""
    key, chunk = keyed(seed, kv_dtype="int8", n_tokens=6)
    fresh = encode_chunk(key, chunk, "int8")
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(chunk.n_layers):
        for name, x in ((f"k.{layer}", chunk.keys[layer]), (f"v.{layer}", chunk.values[layer])):
            scale = x.abs().amax(dim=1, keepdim=True) / 127  # (H, 1, D)
            tensors[name] = torch.round(x / scale).to(torch.int8).contiguous()
            tensors[f"{name}.scale"] = scale.contiguous()
    header = replace(fresh.header, int8_scales="", checksums={n: checksum(t) for n, t in tensors.items()})
    assert "int8_scales" not in json.loads(header.to_json())  # as the older version wrote it
    return Entry(header, tensors, owned=True), (key, chunk)


def test_a_legacy_per_channel_int8_entry_still_decodes(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(kv_dtype="int8")
    entry, (key, chunk) = legacy_int8_entry()
    assert tier.store(entry)
    got = tier.get(key, chunk.token_ids)
    assert got is not None
    step = max(float(x.abs().amax()) for x in (*chunk.keys, *chunk.values)) / 127
    assert_same_chunk(got, chunk, atol=step * 0.51)
    legacy = tuple(tier.get_layer(key, 0))  # type: ignore[arg-type]
    torch.testing.assert_close(legacy[0], got.keys[0], rtol=0, atol=0)
    assert tier.stats().errors == 0


def test_int8_headers_name_their_scale_layout_and_others_are_unchanged() -> None:
    key, chunk = keyed(3, kv_dtype="int8")
    int8 = encode_chunk(key, chunk, "int8").header
    assert json.loads(int8.to_json())["int8_scales"] == "token"
    assert int8.tensor_spec("k.0.scale")[1] == (2, 4, 1)
    fp16 = encode_chunk(*keyed(3, kv_dtype="fp16"), "fp16").header
    assert "int8_scales" not in json.loads(fp16.to_json())  # what earlier versions read, byte for byte
    assert set(json.loads(fp16.to_json())) == set(asdict(fp16)) - {"int8_scales"}
    assert parse_header_fields(header_fields(int8)) == int8 and parse_header_fields(header_fields(fp16)) == fp16


def test_an_unknown_scale_layout_is_a_corrupt_entry() -> None:
    key, chunk = keyed(4, kv_dtype="int8")
    header: EntryHeader = replace(encode_chunk(key, chunk, "int8").header, int8_scales="block")
    with pytest.raises(CorruptEntry):
        parse_header_fields(header_fields(header))
