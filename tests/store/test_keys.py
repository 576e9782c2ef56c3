from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvblend.store.keys import ChunkKey, KeyContext, canonical_rope, chunk_key

from tests.store.helpers import ROPE, make_ctx

IDS = (1, 15043, 3186, 2)
# Computed once and pinned: a change here silently turns every stored chunk into a miss.
# v2 (#10): the key also covers the compute dtype and the model-config digest.
GOLDEN = "ba581d28bf47ad743dca8d07d6d7c7389731825c9493610c0861b8526113793f"


def test_key_is_sha256_hex_with_tenant() -> None:
    key = chunk_key(IDS, make_ctx())
    assert key.tenant == "default" and len(key.digest) == 64
    assert str(key) == f"default/{key.digest}"
    assert ChunkKey.parse(str(key)) == key


def test_key_matches_pinned_value() -> None:
    assert chunk_key(IDS, make_ctx()).digest == GOLDEN


def test_key_is_stable_in_another_process() -> None:
    code = (
        "from kvblend.store.keys import KeyContext, chunk_key\n"
        f"print(chunk_key({IDS!r}, KeyContext('model-a', 'tok-a', {ROPE!r}, 'fp32', (1, 2), 'default', 'fp32', "
        "'cfg-a')).digest)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert out.stdout.strip() == chunk_key(IDS, make_ctx()).digest


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "model-b"},
        {"tokenizer_fingerprint": "tok-b"},
        {"rope": '{"rope_theta": 10000.0, "rope_type": "default"}'},
        {"kv_dtype": "fp16"},
        {"compute_dtype": "bf16"},
        {"model_config": "cfg-b"},
        {"chunk_prefix": (1, 2, 3)},
        {"chunk_prefix": ()},
        {"tenant": "acme"},
    ],
)
def test_changing_any_input_changes_the_key(change: dict) -> None:
    base = make_ctx()
    assert chunk_key(IDS, dataclasses.replace(base, **change)) != chunk_key(IDS, base)


def test_token_changes_change_the_key() -> None:
    ctx = make_ctx()
    keys = {chunk_key(ids, ctx).digest for ids in [IDS, IDS[:-1], IDS + (0,), tuple(reversed(IDS)), ()]}
    assert len(keys) == 5


def test_token_boundary_between_prefix_and_chunk_matters() -> None:
    a = chunk_key((3, 4), KeyContext("m", "t", ROPE, "fp32", (1, 2)))
    b = chunk_key((2, 3, 4), KeyContext("m", "t", ROPE, "fp32", (1,)))
    assert a != b


def test_equivalent_rope_spellings_give_one_key() -> None:
    spellings = ['{"rope_theta": 100000.0, "rope_type": "default"}', '{"rope_type":"default","rope_theta":1e5}',
                 '{ "rope_theta": 100000, "rope_type": "default" }']
    assert len({chunk_key(IDS, dataclasses.replace(make_ctx(), rope=r)) for r in spellings}) == 1
    assert canonical_rope({"b": [1.0, 2.5], "a": None}) == '{"a":null,"b":[1,2.5]}'


def test_sequence_types_do_not_matter() -> None:
    import torch

    ctx = make_ctx()
    assert chunk_key(list(IDS), ctx) == chunk_key(torch.tensor(IDS), ctx) == chunk_key(IDS, ctx)
    assert KeyContext("m", "t", ROPE, "fp32", [1, 2]).chunk_prefix == (1, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tenant": "../etc"}, {"tenant": ""}, {"tenant": ".hidden"}, {"tenant": "a/b"}, {"tenant": "a" * 65},
        {"kv_dtype": "float32"}, {"compute_dtype": "int8"}, {"rope": "theta=1e5"}, {"rope": "[1, 2]"}, {"model_fingerprint": ""},
        {"chunk_prefix": (-1,)},
    ],
)
def test_invalid_context_is_refused(kwargs: dict) -> None:
    fields = {"model_fingerprint": "m", "tokenizer_fingerprint": "t", "rope": ROPE, "kv_dtype": "fp32"} | kwargs
    with pytest.raises(ValueError):
        KeyContext(**fields)


def test_invalid_keys_are_refused() -> None:
    with pytest.raises(ValueError):
        ChunkKey("default", "abc")
    with pytest.raises(ValueError):
        ChunkKey("default", "G" * 64)
    with pytest.raises(ValueError):
        ChunkKey.parse("no-slash")
    with pytest.raises(ValueError):
        chunk_key((1, -2), make_ctx())


def test_key_equality_ignores_context() -> None:
    key = chunk_key(IDS, make_ctx())
    bare = ChunkKey(key.tenant, key.digest)
    assert bare == key and hash(bare) == hash(key) and bare.context is None and key.context is not None


def test_key_follows_the_documented_canonical_form() -> None:
    import hashlib
    import struct

    def field(name: bytes, value: bytes) -> bytes:
        return name + b"\0" + struct.pack("<Q", len(value)) + value

    prefix = hashlib.sha256(struct.pack("<2Q", 1, 2)).hexdigest().encode()
    rope = b'{"rope_theta":100000,"rope_type":"default"}'
    expected = hashlib.sha256(b"kvblend/chunk-key/v2" + field(b"tenant", b"default") + field(b"model", b"model-a")
                              + field(b"model_config", b"cfg-a") + field(b"tokenizer", b"tok-a")
                              + field(b"rope", rope) + field(b"compute_dtype", b"fp32") + field(b"kv_dtype", b"fp32")
                              + field(b"prefix", prefix) + field(b"tokens", struct.pack("<4Q", *IDS)))
    assert chunk_key(IDS, make_ctx()).digest == expected.hexdigest()
