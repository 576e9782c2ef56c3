"""Decode weights (models.packed): packed matmuls against fp32, one row's result independent
of its batch, prefill untouched, and the one rule for which passes read them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvblend.errors import KvblendError
from kvblend.generation.batch import decode_batch, forward_batch
from kvblend.generation.chunked import Forward
from kvblend.models import packed as packed_mod
from kvblend.models.packed import (PackedWeight, tiles_kind, decode_pass, decoding, native_activation_error, native_int8,
                                   native_lanes, native_layer_ops, resolve_decode_weights)
from kvblend.models.transformer import Transformer
from tests.conftest import make_loaded


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


def _assert_int8_matmul(got: torch.Tensor, x: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None) -> None:
    """got is x w_deq^T + bias within the kernel's activation rounding (each activation off
    by at most ``native_activation_error`` x its row's max |x|, so each output by that x
    sum |w_deq| of its weight row) and float32 rounding."""
    want = F.linear(x, w_deq, bias)
    rounding = x.abs().amax(dim=1, keepdim=True) * native_activation_error() * w_deq.abs().sum(dim=1)
    float_error = 1e-5 * (x.abs() @ w_deq.abs().T) + 1e-6
    excess = (got - want).abs() - rounding - float_error
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond the bound"


def test_int8_is_the_matmul_of_the_rounded_weights() -> None:
    """The int8 matmul is the fp32 matmul of W rounded per output row to 127 levels of its
    max |w|, within the activations' rounding (~16 bits on the VNNI path), whatever the rows'
    scales."""
    w, b = _weights()
    packed = PackedWeight(w, b, "int8")
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    w_deq = (w / scale).round() * scale
    x = torch.randn(3, 64) * torch.tensor([[0.01], [1.0], [30.0]])
    _assert_int8_matmul(packed(x), x, w_deq, b)
    assert native_activation_error() <= 1 / 64000  # two 8-bit rows, one 16-bit row, or float32


def test_int8_sums_hold_at_the_largest_products_over_long_rows() -> None:
    """Every product at its largest, over rows longer than one int32 sum can hold on the
    AVX2 path (16-bit activations x 127: 2^31 is reached after ~4,100 inputs a lane), with
    rows of one sign and of alternating signs: the result is the exact sum, so the kernels'
    integer sums are split and widened before they overflow (a wrapped sum is off by ~2^32
    steps)."""
    for n in (4096 + 48, 4096 + 50, 3 * 4096 + 16):  # 4146: a tail past the last whole 16, row-major only
        w = torch.full((6, n), 0.5)
        w[1::2, 1::2] = -0.5  # rows 1, 3, 5 alternate in sign: their sums cancel to 0
        packed = PackedWeight(w, None, "int8")
        x = torch.full((3, n), 3.0)
        x[2] = torch.where(torch.arange(n) % 2 == 1, -3.0, 3.0)  # alternating too: row 2 times rows 1, 3, 5 is all +
        want = x.double() @ w.double().T
        torch.testing.assert_close(packed(x).double(), want, rtol=1e-5, atol=1e-3 * n)
        row_major = torch.ops.kvblend_packed.int8_linear(x, packed.q, packed.scale, packed.rowsum, None)  # no tiles
        torch.testing.assert_close(row_major.double(), want, rtol=1e-5, atol=1e-3 * n)


def test_int8_rows_with_a_nan_or_infinity_give_nan_and_tiny_rows_give_zero() -> None:
    """A row holding a NaN or an infinity gives NaN outputs, as the float32 matmul does (a
    quantized row would otherwise turn it into finite numbers), and the rows beside it are
    unchanged; a row whose max is too small for the quantizer's step (~1e-36) gives its bias,
    not values of the wrong sign; a zero row gives its bias."""
    w, b = _weights(out=12, inp=80, seed=3)
    packed = PackedWeight(w, b, "int8")
    x = torch.randn(5, 80)
    x[1, 7] = float("nan")
    x[2, 70] = float("inf")  # 70: past the last whole vector of 16 too, where the tail is scalar
    x[3] = torch.randn(80) * 1e-36
    x[4] = 0.0
    got = packed(x)
    assert got[1].isnan().all()
    assert not got[2].isfinite().any()  # NaN here; the float32 matmul gives +-inf
    torch.testing.assert_close(got[3:], b.expand(2, -1), rtol=0, atol=1e-30)
    clean = packed(x[:1])
    torch.testing.assert_close(got[:1], clean, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "native"), [("int8", True), ("int8", False), ("fp16", True)])
def test_a_rows_result_does_not_depend_on_the_other_rows(kind: str, native: bool) -> None:
    """A large row beside a small one leaves the small one's result as it is alone (with
    FBGEMM's one activation range per call, it once coarsened it)."""
    w, b = _weights()
    packed = PackedWeight(w, b, kind, native=native)
    small = torch.randn(1, 64) * 0.01
    large = torch.randn(1, 64) * 50.0
    alone = packed(small)
    beside = packed(torch.cat((small, large)))[:1]
    torch.testing.assert_close(beside, alone, rtol=0, atol=1e-7)


def test_the_int8_kernel_is_built_and_equals_the_tensor_ops() -> None:
    """``csrc/packed_int8.cpp`` equals the dequantized weight's matmul within its activation
    rounding (``_assert_int8_matmul``) for every row count (its one-row and tiled paths) and width (a vector path's tail, output rows
    outside a whole tile), with or without a bias; it builds on this machine with a vector
    path (setup installs ninja; a compiler is part of every supported machine)."""
    assert native_int8() is not None and native_lanes() in (8, 16)
    for bias in (True, False):
        for out, inp in ((130, 77), (64, 64), (7, 200)):
            w, b = _weights(out=out, inp=inp, seed=3)
            packed = PackedWeight(w, b if bias else None, "int8")
            assert packed._native is not None
            for rows in (1, 2, 3, 5, 8):
                x = torch.randn(rows, inp) * torch.logspace(-3, 2, rows)[:, None]
                w_deq = packed.q.float() * packed.scale[:, None]
                with torch.inference_mode():
                    torch.testing.assert_close(packed.int8_linear_ops(x), F.linear(x, w_deq, packed.bias))
                    _assert_int8_matmul(packed(x), x, w_deq, packed.bias)
    with pytest.raises(RuntimeError, match="2-d float32"):
        packed(torch.randn(2, inp, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="int8 \\(out, in\\)"):
        packed(torch.randn(2, inp + 1))


def test_tiles_give_the_row_major_weights_result() -> None:
    """Where the kernels read a second layout of the weights (``tiles_kind``), a packed int8
    weight also holds it, and steps of any rows multiply by it: the same result, bit for bit,
    as the row-major weight (which the same CPU takes without tiles, and a replica without
    AMX takes), at every row count and at widths and output counts off the tiles' edges.
    ``amx``: 16 outputs x 64 inputs a tile (zero past the edges). ``int16`` (AVX2 without
    VNNI): four outputs' 16 inputs a cache line, for widths that are a multiple of 16 (others
    keep row-major only). Tiles that are not q's are refused, and a process with no tiles
    refuses them."""
    op = torch.ops.kvblend_packed.int8_linear
    kind = tiles_kind()
    w, b = _weights(out=16, inp=64, seed=5)
    plain = PackedWeight(w, b, "int8")
    if kind == "":
        assert plain.tiles is None
        with pytest.raises(RuntimeError, match="without AMX"):
            op(torch.randn(4, 64), plain.q, plain.scale, plain.rowsum, None, torch.zeros(1, 1, 1024, dtype=torch.int8))
        return
    wrong = torch.zeros(2, 1, 1024, dtype=torch.int8) if kind == "amx" else torch.zeros(5, 4, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=f"{kind}_pack's of its weight"):
        op(torch.randn(4, 64), plain.q, plain.scale, plain.rowsum, None, wrong)
    for out, inp in ((130, 77), (130, 80), (64, 64), (7, 208), (40, 1536)):
        w, b = _weights(out=out, inp=inp, seed=5)
        packed = PackedWeight(w, b, "int8")
        if kind == "amx":
            assert packed.tiles is not None and packed.tiles.shape == ((out + 15) // 16, (inp + 63) // 64, 1024)
        elif inp % 16:
            assert packed.tiles is None
            continue
        else:
            assert packed.tiles is not None and packed.tiles.shape == ((out + 3) // 4, inp // 16, 64)
        for rows in (1, 2, 4, 7, 8, 9, 17):
            x = torch.randn(rows, inp) * torch.logspace(-3, 2, rows)[:, None]
            tiled = op(x, packed.q, packed.scale, packed.rowsum, packed.bias, packed.tiles)
            row_major = op(x, packed.q, packed.scale, packed.rowsum, packed.bias)
            torch.testing.assert_close(tiled, row_major, rtol=0, atol=0)  # replicas with and without tiles agree
            _assert_int8_matmul(tiled, x, packed.q.float() * packed.scale[:, None], packed.bias)
            torch.testing.assert_close(packed(x), tiled)
        other = PackedWeight(*_weights(out=out, inp=inp, seed=6), "int8")  # the tiles are what is read:
        x = torch.randn(3, inp)                                            # another weight's give its result
        torch.testing.assert_close(op(x, packed.q, packed.scale, packed.rowsum, packed.bias, other.tiles),
                                   op(x, other.q, packed.scale, packed.rowsum, packed.bias), rtol=0, atol=0)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it_at_any_count() -> None:
    """A row's int8 matmul is the same bit for bit alone and among 3, 4, 8 or 9 rows, through
    the weight's tiles where the CPU's kernels have them (AMX, AVX2) and row-major where not
    (each takes exact integer dot products into the same float operations; a served stream's tokens must not depend on how many
    other streams its step decoded)."""
    for out, inp in ((130, 77), (40, 1536)):
        w, b = _weights(out=out, inp=inp, seed=11)
        packed = PackedWeight(w, b, "int8")
        x = torch.randn(9, inp) * torch.logspace(-2, 1, 9)[:, None]
        alone = torch.cat([packed(x[r : r + 1]) for r in range(9)])
        for rows in (3, 4, 8, 9):
            torch.testing.assert_close(packed(x[:rows]), alone[:rows], rtol=0, atol=0)


def test_kernels_called_off_the_main_thread_give_the_main_threads_results() -> None:
    """Off the main thread (the server's model worker) the kernels split their loops over
    kvblend's own threads (``SpinPool`` in csrc/packed_int8.cpp: libgomp's threads sleep
    between a decode step's short regions there); each output is computed by one thread,
    and the loops split at whole tiles, so an output's sum order never depends on the split:
    the results equal the main thread's bit for bit, also with two threads calling at once
    (one of them then runs its loops alone, unsplit)."""
    import threading

    w, b = _weights(out=300, inp=200, seed=9)
    packed = PackedWeight(w, b, "int8")
    xs = [torch.randn(rows, 200) for rows in (1, 3, 8)]
    want = [packed(x) for x in xs]
    results: dict[str, list[list[torch.Tensor]]] = {}

    def call(name: str) -> None:
        results[name] = [[packed(x) for x in xs] for _ in range(50)]

    threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["a", "b"]
    assert all(torch.equal(got, ref) for runs in results.values() for run in runs for got, ref in zip(run, want))


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 16), (14, 2, 37)])
def test_native_decode_attention_writes_each_rows_kv_and_is_sdpa(heads: int, kv_heads: int, dim: int) -> None:
    """``decode_attend_rows``: each row's K and V land at its slot of its own cache, and its
    one query a head over slots first..slot is SDPA's result, over one key, a chunk's worth
    and several chunks merged (``kKeyChunk`` 256), with a sliding window's first slot."""
    from kvblend.models.attention import attend
    from kvblend.models.packed import native_layer_ops

    ops = native_layer_ops()
    gen = torch.Generator().manual_seed(heads)
    slots, firsts = [0, 255, 599, 599], [0, 0, 0, 100]
    caches = [[torch.randn(kv_heads, 700, dim, generator=gen) * 3 for _ in range(2)] for _ in slots]
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * dim, generator=gen) * 3
    got = ops.attend_rows(qkv, [k for k, _ in caches], [v for _, v in caches], [], [], [], slots, firsts, heads,
                          kv_heads, dim)
    for r, ((keys, values), slot, first) in enumerate(zip(caches, slots, firsts)):
        q, k, v = qkv[r].split((heads * dim, kv_heads * dim, kv_heads * dim))
        assert torch.equal(keys[:, slot], k.view(kv_heads, dim)) and torch.equal(values[:, slot], v.view(kv_heads, dim))
        want = attend(q.view(heads, 1, dim), keys[:, first : slot + 1], values[:, first : slot + 1])
        torch.testing.assert_close(got[r : r + 1], want, rtol=1e-5, atol=5e-5)  # values ~3
    with pytest.raises(RuntimeError, match="whole groups"):
        ops.attend_rows(torch.randn(1, 7 * dim), [torch.randn(2, 5, dim)], [torch.randn(2, 5, dim)], [], [], [], [0], [0],
                        3, 2, dim)
    with pytest.raises(RuntimeError, match="outside its cache"):
        ops.attend_rows(qkv[:1], [caches[0][0]], [caches[0][1]], [], [], [], [700], [0], heads, kv_heads, dim)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 37)])
def test_native_decode_attention_over_float16_copies(heads: int, kv_heads: int, dim: int) -> None:
    """With float16 copies of the caches, ``decode_attend_rows`` converts the slots a copy
    lacks (from its synced mark up to the row's slot), writes the row's K/V to the float32
    cache and to the copy, and attends over the copy: SDPA's result over the float16-rounded
    keys and values. Slots at or past the mark that the copy held before are overwritten."""
    from kvblend.models.attention import attend
    from kvblend.models.packed import native_layer_ops

    ops = native_layer_ops()
    gen = torch.Generator().manual_seed(dim)
    slots, firsts, synced = [0, 255, 599, 599], [0, 0, 0, 100], [0, 0, 300, 599]
    caches = [[torch.randn(kv_heads, 700, dim, generator=gen) * 3 for _ in range(2)] for _ in slots]
    halves = [[torch.full((kv_heads, 700, dim), 7.0, dtype=torch.float16) for _ in range(2)] for _ in slots]
    for (keys, values), (hk, hv), held in zip(caches, halves, synced):  # what a copy held before
        hk[:, :held], hv[:, :held] = keys[:, :held], values[:, :held]
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * dim, generator=gen) * 3
    got = ops.attend_rows(qkv, [k for k, _ in caches], [v for _, v in caches], [k for k, _ in halves],
                          [v for _, v in halves], synced, slots, firsts, heads, kv_heads, dim)
    for r, ((keys, values), (hk, hv), slot, first) in enumerate(zip(caches, halves, slots, firsts)):
        q, k, v = qkv[r].split((heads * dim, kv_heads * dim, kv_heads * dim))
        assert torch.equal(keys[:, slot], k.view(kv_heads, dim)) and torch.equal(values[:, slot], v.view(kv_heads, dim))
        assert torch.equal(hk[:, : slot + 1], keys[:, : slot + 1].half())
        assert torch.equal(hv[:, : slot + 1], values[:, : slot + 1].half())
        assert bool((hk[:, slot + 1 :] == 7).all())  # nothing past the slot
        want = attend(q.view(heads, 1, dim), hk[:, first : slot + 1].float(), hv[:, first : slot + 1].float())
        torch.testing.assert_close(got[r : r + 1], want, rtol=1e-5, atol=5e-5)
    with pytest.raises(RuntimeError, match="every row or for none"):
        ops.attend_rows(qkv[:2], [k for k, _ in caches[:2]], [v for _, v in caches[:2]], [halves[0][0]], [halves[0][1]],
                        [0], slots[:2], firsts[:2], heads, kv_heads, dim)
    with pytest.raises(RuntimeError, match="past its slot"):
        ops.attend_rows(qkv[:1], [caches[0][0]], [caches[0][1]], [halves[0][0]], [halves[0][1]], [5], [4], [0], heads,
                        kv_heads, dim)


def test_a_rewritten_slot_is_never_read_stale_from_the_float16_copy() -> None:
    """The native decode attends over float16 copies of the cache that it keeps in step
    itself; a slot the cache's own ``write`` changes afterwards (a prompt cut back and
    prefilled again, as a chat's next turn does) is converted again before a decode step
    reads it, and the copies grow with the cache: the logits equal a fresh cache's."""
    model = make_loaded("llama").model
    model.pack_decode_weights("int8")
    prompt, other = torch.arange(3, 15), torch.arange(30, 34)
    cache = model.new_cache(14)  # grown by the decode steps and the prefill below
    model(prompt, cache)
    for t in (5, 9, 11):
        model(torch.tensor([t]), cache)
    assert cache.half_keys[0] is not None and cache.half_synced[0] == 15
    cache.truncate(10)
    model(other, cache)  # slots 10..13 written through ``write``: the copies' mark drops to 10
    assert cache.half_synced[0] == 10
    steps = [model(torch.tensor([t]), cache)[0] for t in (6, 8)]
    fresh = model.new_cache(14)
    model(prompt, fresh)
    fresh.truncate(10)
    model(other, fresh)
    want = [model(torch.tensor([t]), fresh)[0] for t in (6, 8)]
    torch.testing.assert_close(torch.stack(steps), torch.stack(want), rtol=0, atol=1e-6)
    assert cache.half_keys[0].shape[1] == cache.capacity  # made at 14 slots, grown with the cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_the_native_decode_layer_equals_the_layer_as_ops(arch: str) -> None:
    """``decode_project``/``decode_finish``/``decode_layer`` (a decode step's layer in native
    calls) give the logits the same int8 weights give op by op, on each family's layer:
    Qwen2's q/k/v bias, Gemma 3's q/k norms, sandwich norms, GELU, query scale and sliding
    window. The two compute norms in different float order, which can move an activation's
    ~16-bit rounding on the VNNI path by a step: there they agree to ~1e-3, else to float32.
    Over the cache's float16 copies (the default, ``KVCache.decode_half``) they agree to ~1e-3."""
    from kvblend.models.transformer import Linear

    model = make_loaded(arch).model
    model.pack_decode_weights("int8")
    packed = [m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    assert packed and all(p.fused for p in packed)

    def decode(fused: bool, copies: bool = False) -> torch.Tensor:
        for p in packed:
            p.fused = fused
        cache = model.new_cache(32)
        cache.half_copies = copies
        model(torch.arange(3, 15), cache)  # past Gemma's window of 8
        steps = [model(torch.tensor([t]), cache)[0] for t in (5, 9, 11)]
        batched = [model.new_cache(32), model.new_cache(32)]
        for c, p in zip(batched, (torch.arange(3, 12), torch.arange(20, 24))):
            c.half_copies = copies
            model(p, c)
        return torch.cat((torch.stack(steps), decode_batch(model, [5, 7], batched)))

    ops = decode(False)
    tol = 2e-3 if native_activation_error() else 1e-5
    torch.testing.assert_close(decode(True), ops, rtol=tol, atol=tol)
    torch.testing.assert_close(decode(True, copies=True), ops, rtol=2e-3, atol=2e-3)  # over the float16 copies


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
    assert resolve_decode_weights("int8", "cpu", torch.float32) == "int8"
    with pytest.raises(KvblendError, match="CPU and float32"):
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
    with pytest.raises(KvblendError, match="CPU and float32"):
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


def test_int8_weights_move_into_one_huge_page_mapping(tiny) -> None:
    """``pack_decode_weights("int8")`` moves every int8 weight (``q``, and its tiles where
    it has them) into one mapping advised for huge pages (``in_huge_pages``), starting at a
    2 MiB boundary, with the same values and results as where they were packed."""
    from kvblend.models.packed import HUGE_PAGE, in_huge_pages
    from kvblend.models.transformer import Linear

    model = tiny.model
    model.pack_decode_weights("int8")
    try:
        packed = [m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
        arenas = {id(p.arena) for p in packed}
        assert len(arenas) == 1 and packed[0].arena is not None
        assert min(p.q.data_ptr() for p in packed) % HUGE_PAGE == 0
        mapped = [t for p in packed for t in (p.q, p.tiles) if t is not None]
        start = torch.frombuffer(packed[0].arena, dtype=torch.int8).data_ptr()
        assert all(start <= t.data_ptr() < start + len(packed[0].arena) for t in mapped)
        x = torch.randn(4, packed[0].in_features)  # four rows: through the tiles where there are some
        before, q = packed[0](x), packed[0].q.clone()
        assert in_huge_pages(packed[:1]) is not None  # moved again: same numbers, same result
        assert packed[0].q.data_ptr() % HUGE_PAGE == 0
        assert torch.equal(packed[0].q, q) and torch.equal(packed[0](x), before)
        assert in_huge_pages([PackedWeight(*_weights(), "fp16")]) is None  # only int8 moves
    finally:
        model.pack_decode_weights("fp32")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_steps_layers_in_one_native_call_equal_the_layer_by_layer_calls(arch, monkeypatch) -> None:
    """``Transformer.decode_layers`` (every layer's decode step in one ``decode_layers`` call)
    gives the layer-by-layer calls' logits and K/V bit for bit, for one row and for three at
    different positions, with Gemma 3's sliding and global layers and their own RoPE tables."""
    assert native_int8() is not None  # make setup builds the kernels
    model = make_loaded(arch).model
    model.pack_decode_weights("int8")
    prompts = [torch.arange(3, 15), torch.arange(20, 26), torch.arange(40, 49)]

    def run(stacked: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        calls = []
        ops = native_layer_ops()
        monkeypatch.setattr(packed_mod, "_LAYER_OPS", ops._replace(layers=lambda *a: calls.append(1) or ops.layers(*a)))
        if not stacked:
            monkeypatch.setattr(Transformer, "_native_stack", lambda self: None)
        caches = []
        for p in prompts:
            c = model.new_cache(32)
            model(p, c)
            caches.append(c)
        logits = [decode_batch(model, [5], caches[:1]), decode_batch(model, [7, 8, 9], caches)]
        logits.append(decode_batch(model, [1, 2, 3], caches))  # the copies already synced
        monkeypatch.undo()
        assert len(calls) == (3 if stacked else 0)
        return logits, [c.keys[layer][:, : c.length] for c in caches for layer in range(model.cfg.num_layers)]

    try:
        (one, keys), (ref, ref_keys) = run(True), run(False)
        assert all(torch.equal(a, b) for a, b in zip(one, ref))
        assert all(torch.equal(a, b) for a, b in zip(keys, ref_keys))
    finally:
        model.pack_decode_weights("fp32")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_one_token_forward_in_one_native_call_equals_the_layer_by_layer_steps(arch) -> None:
    """``model(ids, cache)`` with one token (the Python API's and the CLI's decode) runs every
    layer in one ``decode_layers`` call; ``forward_steps`` (which its owner may pause between
    layers) goes layer by layer: the same logits and K/V bit for bit, past Gemma 3's window."""
    assert native_int8() is not None  # make setup builds the kernels
    model = make_loaded(arch).model
    model.pack_decode_weights("int8")
    try:
        caches = [model.new_cache(32), model.new_cache(32)]
        for c in caches:
            model(torch.arange(3, 15), c)
        for token in (5, 9, 2):
            one = model(torch.tensor([token]), caches[0])
            steps = model.forward_steps(torch.tensor([token]), caches[1])
            while True:
                try:
                    next(steps)
                except StopIteration as stop:
                    ref = stop.value
                    break
            assert torch.equal(one, ref) and caches[0].length == caches[1].length
        assert caches[0].length == 15
        for layer in range(model.cfg.num_layers):
            assert torch.equal(caches[0].keys[layer][:, :15], caches[1].keys[layer][:, :15])
            assert torch.equal(caches[0].values[layer][:, :15], caches[1].values[layer][:, :15])
    finally:
        model.pack_decode_weights("fp32")
