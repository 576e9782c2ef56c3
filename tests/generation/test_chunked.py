"""Chunked prefill (``generation.chunked``): a forward split into chunks over the growing
cache gives one forward's logits (≤ 1e-4) and cache, one chunk per step."""

from __future__ import annotations

import functools

import pytest
import torch

from kvblend.generation.chunked import Forward, InPlace, chunk_size, forward_chunks, run_steps
from kvblend.models.transformer import LayerDone
from tests.conftest import make_loaded


@functools.cache
def _model(arch: str):
    return make_loaded(arch).model


def _ids(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))  # (n,)


def _steps_and_value(gen, model) -> tuple[int, torch.Tensor]:
    """Drive ``gen`` as a scheduler would (each Forward through the model), counting its steps."""
    steps, reply = 0, None
    while True:
        try:
            step = gen.send(reply)
        except StopIteration as stop:
            return steps, stop.value
        assert isinstance(step, Forward)
        steps += 1
        reply = model(step.ids, step.cache, step.logits_for)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # gemma3: sliding windows of 8 across chunks
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_shot(arch: str, chunk: int) -> None:
    model = _model(arch)
    ids = _ids(model, 37, 1)  # (37,)
    one = model.new_cache(40)
    want = model(ids, one, logits_for="all")  # (37, V)
    last = model.new_cache(40)
    steps, got_last = _steps_and_value(forward_chunks(model, ids, last, chunk), model)
    assert steps == -(-37 // chunk)  # one step per chunk
    assert got_last.shape == (1, want.shape[1])
    assert torch.allclose(got_last, want[-1:], atol=1e-4, rtol=0)
    every = model.new_cache(40)
    _, got_all = _steps_and_value(forward_chunks(model, ids, every, chunk, logits_for="all"), model)
    assert got_all.shape == want.shape and torch.allclose(got_all, want, atol=1e-4, rtol=0)
    for cache in (last, every):
        assert cache.length == one.length == 37
        for layer in range(len(model.layers)):
            for a, b in zip(cache.view(layer), one.view(layer)):
                assert torch.allclose(a, b, atol=1e-4, rtol=0)


def test_chunks_continue_an_existing_cache() -> None:
    """Teacher forcing appends to a prompt's cache: positions go on from its length."""
    model = _model("llama")
    ids = _ids(model, 30, 2)  # (30,)
    want = model(ids, model.new_cache(30), logits_for="all")[12:]  # (18, V)
    cache = model.new_cache(30)
    model(ids[:12], cache, logits_for="none")
    _, got = _steps_and_value(forward_chunks(model, ids[12:], cache, 4, logits_for="all"), model)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_length_dependent_rope_runs_in_one_chunk() -> None:
    """Dynamic NTK past its window rotates by the sequence's length: chunking would change it."""
    model = make_loaded(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}).model
    assert chunk_size(model, 12, 4) == 4 and chunk_size(model, 28, 4) == 28
    ids = _ids(model, 28, 3)  # (28,): past the window of 16, within the context of 32
    want = model(ids, model.new_cache(28))
    steps, got = _steps_and_value(forward_chunks(model, ids, model.new_cache(28), 4), model)
    assert steps == 1 and torch.allclose(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        chunk_size(model, 12, 0)


def test_run_steps_drives_a_forward_alone() -> None:
    model = _model("llama")
    ids = _ids(model, 21, 4)  # (21,)
    want = model(ids, model.new_cache(21))  # (1, V)
    got = run_steps(forward_chunks(model, ids, model.new_cache(21), 8), model)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert chunk_size(model, 21, None) == 21  # None: one slice


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_in_place_chunks_equal_one_shot_and_yield_each_layer(arch: str) -> None:
    """A size callable answering ``InPlace(n)`` runs those n tokens here, layer by layer (a
    ``LayerDone`` per layer, the first and last flagged not inner: they also embed and make
    logits), mixed freely with ``Forward`` slices; logits and cache equal one forward's."""
    model = _model(arch)
    layers = len(model.layers)
    ids = _ids(model, 37, 5)  # (37,)
    one = model.new_cache(40)
    want = model(ids, one, logits_for="all")  # (37, V)
    asks = iter([InPlace(5), 7, InPlace(11), InPlace(40)])  # 5 in place, 7 by the driver, 11 + 14 in place
    cache = model.new_cache(40)
    gen = forward_chunks(model, ids, cache, lambda: next(asks), logits_for="all")
    units, forwards, reply = [], 0, None
    while True:
        try:
            step = gen.send(reply)
        except StopIteration as stop:
            got = stop.value
            break
        reply = None
        if isinstance(step, Forward):
            forwards += 1
            reply = model(step.ids, step.cache, step.logits_for)
        else:
            assert isinstance(step, LayerDone)
            units.append((int(step), step.inner))
    assert forwards == 1
    assert units == [(n, 0 < i < layers - 1) for n in (5, 11, 14) for i in range(layers)]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=0)
    assert cache.length == 37
    for layer in range(layers):
        for a, b in zip(cache.view(layer), one.view(layer)):
            assert torch.allclose(a, b, atol=1e-4, rtol=0)
    last = model.new_cache(40)  # run alone (run_steps), in place throughout
    got_last = run_steps(forward_chunks(model, ids, last, lambda: InPlace(16)), model)
    assert torch.allclose(got_last, want[-1:], atol=1e-4, rtol=0)
