from __future__ import annotations

import dataclasses

import pytest
import torch

from kvblend.store.entry import (
    CorruptEntry,
    check_identity,
    decode_entry,
    encode_chunk,
    header_fields,
    parse_header_fields,
)
from kvblend.store.keys import ChunkKey, chunk_key

from tests.store.helpers import assert_same_chunk, keyed, make_chunk, make_ctx


def test_encode_decode_round_trip() -> None:
    key, chunk = keyed(1)
    entry = encode_chunk(key, chunk, "fp32")
    assert entry.header.token_ids == chunk.token_ids and entry.header.base_position == chunk.base_position
    assert entry.header.model_fingerprint == "model-a" and entry.header.n_layers == 2
    assert_same_chunk(decode_entry(entry, torch.float32), chunk)


def test_decoded_tensors_do_not_alias_a_shared_entry() -> None:
    key, chunk = keyed(1)
    entry = encode_chunk(key, chunk, "fp32").shared()
    out = decode_entry(entry, torch.float32)
    out.keys[0].zero_()
    assert not torch.equal(entry.tensors["k.0"], out.keys[0])


def test_put_under_another_texts_key_is_refused() -> None:
    key, _ = keyed(1)
    _, other = keyed(2)
    with pytest.raises(ValueError, match="do not hash"):
        encode_chunk(key, other, "fp32")


def test_put_needs_a_key_with_context() -> None:
    key, chunk = keyed(1)
    with pytest.raises(ValueError, match="chunk_key"):
        encode_chunk(ChunkKey(key.tenant, key.digest), chunk, "fp32")


def test_header_round_trip_and_tamper_detection() -> None:
    key, chunk = keyed(1)
    fields = header_fields(encode_chunk(key, chunk, "int8").header)
    header = parse_header_fields(fields)
    check_identity(header, key)
    tampered = dict(fields, header=fields["header"].replace('"base_position":2', '"base_position":3'))
    assert tampered != fields
    with pytest.raises(CorruptEntry, match="checksum"):
        parse_header_fields(tampered)
    with pytest.raises(CorruptEntry):
        parse_header_fields(dict(fields, format="other/1"))


def test_wrong_model_header_fails_identity_even_under_the_right_name() -> None:
    ids = (5, 6, 7, 8)
    key_a = chunk_key(ids, make_ctx(model="model-a"))
    key_b = chunk_key(ids, make_ctx(model="model-b"))
    header_b = encode_chunk(key_b, make_chunk(ids), "fp32").header
    forged = dataclasses.replace(header_b, digest=key_a.digest)  # renamed, but still model-b inside
    with pytest.raises(CorruptEntry, match="wrong model"):
        check_identity(forged, key_a)
    with pytest.raises(CorruptEntry):
        check_identity(header_b, key_a)
