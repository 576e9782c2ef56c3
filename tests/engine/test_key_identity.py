"""Chunk keys cover every input that changes the KV, and the identities they hash are
computed when the model is loaded (#10 point 6)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvblend.engine import Engine, Request
from kvblend.models.loader import LoadedModel, build_model, load_hf_folder
from kvblend.store import chunk_key
from tests.conftest import make_hf_model, make_loaded, make_tokenizer
from tests.engine.test_blend_invariants import DOCS, QUESTION


def _as_dtype(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """The same weights, config, tokenizer and fingerprint, computing in ``dtype``."""
    state = {k: v.clone() for k, v in make_hf_model(vocab_size=len(loaded.tokenizer), bos_token_id=1,
                                                     eos_token_id=2).state_dict().items()}
    model = build_model(loaded.config, state, "cpu", dtype)
    return LoadedModel(loaded.name, loaded.folder, loaded.config, model, loaded.tokenizer, loaded.fingerprint)


def _key(loaded: LoadedModel, ids=(5, 6, 7)):
    return chunk_key(ids, Engine(loaded).key_context((1,), "default"))


def test_compute_dtype_and_config_fields_change_the_key() -> None:
    base = make_loaded()
    assert _key(base) == _key(make_loaded())  # deterministic
    assert _key(_as_dtype(base, torch.bfloat16)) != _key(base)
    for change in ({"rms_norm_eps": 1e-5}, {"num_key_value_heads": 4}, {"sliding_window": 8}):
        other = make_loaded(arch="mistral" if "sliding_window" in change else "llama", **change)
        assert other.fingerprint == (f"tiny-{other.config.arch}-0") and other.config.rope == base.config.rope
        reference = make_loaded(arch=other.config.arch)
        assert _key(other) != _key(reference), change


def test_a_shared_store_never_serves_bf16_kv_to_an_fp32_engine() -> None:
    fp32 = Engine(make_loaded())
    fp32.prepare(Request(documents=DOCS, question=QUESTION))
    fp32.flush()
    bf16 = Engine(_as_dtype(fp32.loaded, torch.bfloat16), store=fp32.store)
    stats = bf16.prepare(Request(documents=DOCS, question=QUESTION)).stats
    assert [d.hit for d in stats.docs] == [False, False, False]


def test_identities_are_computed_when_the_model_is_loaded(tmp_path: Path) -> None:
    tok = make_tokenizer()
    make_hf_model(vocab_size=len(tok), bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    expected = hashlib.sha256(weights.read_bytes()).hexdigest()
    loaded = load_hf_folder(tmp_path)
    weights.write_bytes(b"changed after load")  # a lazy fingerprint would hash this
    assert loaded.fingerprint == expected
    assert len(loaded.tokenizer_fingerprint) == 64 and len(loaded.config_digest) == 64
