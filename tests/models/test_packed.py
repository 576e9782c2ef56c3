"""Decode weights (models.packed): packed matmuls against fp32, one row's result independent
of its batch, prefill untouched, and the one rule for which passes read them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvblend.errors import KvblendError
from kvblend.generation.batch import decode_batch, forward_batch
from kvblend.generation.chunked import Forward
from kvblend.models.packed import (PackedWeight, decode_pass, decoding, fbgemm_available, native_int8,
                                   resolve_decode_weights)

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM is part of every x86 build of torch")


def _weights(out: int = 96, inp: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) * 0.05, torch.randn(out, generator=gen) * 0.1


@pytest.mark.parametrize(("kind", "tol"), [("int8", 0.03), ("fp16", 1e-3)])
def test_packed_matmul_is_the_fp32_matmul_up_to_its_rounding(kind: str, tol: float) -> None:
    w, b = _weights()
    x = torch.randn(5, 64)
    ref = F.linear(x, w, b)
    got = PackedWeight(w, b, kind)(x)
    assert got.shape == ref.shape
    err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < tol


def test_int8_is_the_matmul_of_the_rounded_weights_and_rows() -> None:
    """The int8 matmul is exactly the fp32 matmul of W rounded per output row to 127 levels
    of its max |w|, and of each row as FBGEMM's 7-bit grid over [-1, 1] (step 2/127) sees it
    twice: the row scaled to max |x| = 1, and what rounding it lost, times 127."""
    w, _ = _weights()
    packed = PackedWeight(w, None, "int8")
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    w_deq = (w / scale).round() * scale

    def grid(v: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_tensor_affine(v, 2 / 127, 0, -128, 127)

    x = torch.randn(3, 64) * torch.tensor([[0.01], [1.0], [30.0]])
    norm = x.abs().amax(dim=1, keepdim=True)
    hi = x / norm
    steps = hi * 63.5
    lo = (steps - steps.round()) * 2  # (hi - grid(hi)) * 127: at most half a step of 2/127, so within [-1, 1]
    x_deq = (grid(hi) + grid(lo) / 127) * norm
    torch.testing.assert_close(packed(x), F.linear(x_deq, w_deq), rtol=1e-4, atol=1e-6)
    # ~14 bits of activation: the error is the weights' rounding, not the 7-bit grid's
    exact_rows = F.linear(x, w_deq)
    assert ((packed(x) - exact_rows).norm(dim=-1) / exact_rows.norm(dim=-1)).max() < 1e-3


@pytest.mark.parametrize(("kind", "native"), [("int8", True), ("int8", False), ("fp16", True)])
def test_a_rows_result_does_not_depend_on_the_other_rows(kind: str, native: bool) -> None:
    """FBGEMM quantizes its whole input over one range: without the per-row scaling and the
    pinned row, a large row beside a small one coarsened the small one's result (both
    paths of the int8 arithmetic: the one-call kernel and the tensor ops)."""
    w, b = _weights()
    packed = PackedWeight(w, b, kind, native=native)
    small = torch.randn(1, 64) * 0.01
    large = torch.randn(1, 64) * 50.0
    alone = packed(small)
    beside = packed(torch.cat((small, large)))[:1]
    torch.testing.assert_close(beside, alone, rtol=0, atol=1e-7)


def test_the_one_call_int8_kernel_is_built_and_equals_the_tensor_ops() -> None:
    """``csrc/packed_int8.cpp`` does what ``int8_linear_ops`` does, to float32 rounding, for
    every batch size and with or without a bias; it builds on this machine (setup installs
    ninja; a compiler is part of every supported machine)."""
    assert native_int8() is not None
    for bias in (True, False):
        w, b = _weights(out=130, inp=77, seed=3)
        packed = PackedWeight(w, b if bias else None, "int8")
        assert packed._native is not None
        for rows in (1, 3, 8):
            x = torch.randn(rows, 77) * torch.logspace(-3, 2, rows)[:, None]
            with torch.inference_mode():
                torch.testing.assert_close(packed(x), packed.int8_linear_ops(x), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="2-d float32"):
        packed(torch.randn(2, 77, dtype=torch.float64))


def test_linear_reads_the_packed_copy_only_while_decoding(tiny) -> None:
    layer = tiny.model.layers[0].qkv
    x = torch.randn(1, layer.weight.shape[1])
    exact = F.linear(x, layer.weight, layer.bias)
    tiny.model.pack_decode_weights("int8")
    try:
        assert torch.equal(layer(x), exact)
        with decoding():
            packed = layer(x)
        assert not torch.equal(packed, exact)
        torch.testing.assert_close(packed, exact, rtol=0.05, atol=0.05)
    finally:
        tiny.model.pack_decode_weights("fp32")
    with decoding():
        assert torch.equal(layer(x), exact)  # fp32: no packed copy, decode reads the weights


def test_decode_pass_is_every_step_one_token() -> None:
    assert decode_pass([1])
    assert decode_pass([1, 1, 1])
    assert not decode_pass([1, 7])  # a prefill slice riding beside decodes: the fp32 weights
    assert not decode_pass([2])
    assert not decode_pass([])


def test_prefill_is_the_same_whatever_the_decode_weights(tiny) -> None:
    model = tiny.model
    ids = torch.arange(3, 15)

    def prefill() -> tuple[torch.Tensor, torch.Tensor]:
        cache = model.new_cache(16)
        logits = model(ids, cache, logits_for="all")
        return logits, cache.keys[-1][:, :12].clone()

    ref_logits, ref_keys = prefill()
    model.pack_decode_weights("int8")
    try:
        logits, keys = prefill()
    finally:
        model.pack_decode_weights("fp32")
    assert torch.equal(logits, ref_logits) and torch.equal(keys, ref_keys)


def test_int8_decode_rows_in_a_batch_equal_each_alone(tiny) -> None:
    """A stream's tokens do not change with the other streams batched beside it."""
    model = tiny.model
    model.pack_decode_weights("int8")
    try:
        prompts = [torch.arange(3, 10), torch.arange(20, 33), torch.arange(40, 44)]
        caches = []
        for p in prompts:
            c = model.new_cache(32)
            model(p, c)
            caches.append(c)
        alone = []
        for c in caches:
            copy = model.new_cache(32)
            for layer in range(model.cfg.num_layers):
                copy.keys[layer].copy_(c.keys[layer])
                copy.values[layer].copy_(c.values[layer])
            copy.length = c.length
            alone.append(model(torch.tensor([5]), copy)[0])
        batched = decode_batch(model, [5, 5, 5], caches)
        for b in range(3):
            torch.testing.assert_close(batched[b], alone[b], rtol=0, atol=1e-5)
    finally:
        model.pack_decode_weights("fp32")


def test_a_prefill_slice_beside_decodes_reads_the_fp32_weights(tiny) -> None:
    model = tiny.model
    model.pack_decode_weights("int8")
    try:
        ref_cache = model.new_cache(16)
        with decoding(False):
            ref = model(torch.arange(3, 9), ref_cache, logits_for="all")
        d_cache, s_cache = model.new_cache(16), model.new_cache(16)
        model(torch.arange(1, 4), d_cache)
        out = forward_batch(model, [Forward(torch.tensor([7]), d_cache), Forward(torch.arange(3, 9), s_cache, "all")])
        torch.testing.assert_close(out[1], ref, rtol=0, atol=1e-5)
    finally:
        model.pack_decode_weights("fp32")


def test_resolve_decode_weights() -> None:
    assert resolve_decode_weights("auto", "cpu", torch.float32) == "int8"
    assert resolve_decode_weights("auto", "cpu", torch.bfloat16) == "fp32"
    assert resolve_decode_weights("auto", "cuda", torch.float32) == "fp32"
    assert resolve_decode_weights("fp16", "cpu", torch.float32) == "fp16"
    with pytest.raises(KvblendError, match="CPU, float32"):
        resolve_decode_weights("int8", "cpu", torch.bfloat16)
    with pytest.raises(KvblendError, match="must be one of"):
        resolve_decode_weights("int4", "cpu", torch.float32)


def test_packing_a_model_follows_the_same_rule(tiny) -> None:
    model = tiny.model
    model.pack_decode_weights("auto")
    try:
        assert model.decode_weights == "int8" and model.layers[0].qkv.packed is not None
    finally:
        model.pack_decode_weights("fp32")
    assert model.layers[0].qkv.packed is None
    bf16 = model.to(torch.bfloat16)
    with pytest.raises(KvblendError, match="CPU, float32"):
        bf16.pack_decode_weights("int8")


def test_decode_weight_bytes(tiny) -> None:
    model = tiny.model
    fp32 = model.decode_weight_bytes()
    model.pack_decode_weights("int8")
    try:
        int8 = model.decode_weight_bytes()
    finally:
        model.pack_decode_weights("fp32")
    assert fp32 > 3.5 * int8 > 3 * fp32 / 4


def test_a_one_token_forward_reads_the_packed_weights_by_every_entry(tiny) -> None:
    """``forward`` and ``forward_steps`` (the chunked driver's entry) apply the same rule, and
    the flag is never left set across a yield into the owner's other work."""
    from kvblend.models.packed import is_decoding

    model = tiny.model
    prompt = torch.arange(3, 10)

    def cache() -> object:
        c = model.new_cache(16)
        model(prompt, c)
        return c

    exact = model(torch.tensor([5]), cache())
    model.pack_decode_weights("int8")
    try:
        via_forward = model(torch.tensor([5]), cache())
        steps, flags = model.forward_steps(torch.tensor([5]), cache()), []
        while True:
            try:
                next(steps)
                flags.append(is_decoding())
            except StopIteration as stop:
                via_steps = stop.value
                break
    finally:
        model.pack_decode_weights("fp32")
    assert torch.equal(via_steps, via_forward) and not torch.equal(via_forward, exact)
    assert flags and not any(flags)
