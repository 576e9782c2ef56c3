"""Batched decode equals one-request decode; DecodeSlot follows stream_from's rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvblend.generation import SamplingParams, prefill, stream_from
from kvblend.generation.batch import DecodeSlot, decode_batch
from tests.conftest import make_loaded, make_tokenizer

# (prompt length, step at which the request joins the batch)
JOINS = ((3, 0), (11, 2), (6, 3), (19, 5))
STEPS = 12


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 8}),  # decode past the window takes the masked plan
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16}),
])
def test_batched_decode_equals_single_request_decode(arch, overrides) -> None:
    model = make_loaded(arch, **overrides).model
    single, batched = [], []
    for i, (n, _) in enumerate(JOINS):
        ids = _prompt(n, i)
        single.append(list(prefill(model, ids, STEPS)))
        batched.append(list(prefill(model, ids, STEPS)))
    tokens = [int(s[1].argmax()) for s in single]
    for step in range(STEPS):
        members = [i for i, (_, join) in enumerate(JOINS) if join <= step]
        out = decode_batch(model, [tokens[i] for i in members], [batched[i][0] for i in members])  # (B, V)
        for row, i in zip(out, members):
            ref = model(torch.tensor([tokens[i]]), single[i][0])[0]  # (V,)
            assert torch.allclose(row, ref, atol=1e-4, rtol=0), (arch, step, i, (row - ref).abs().max())
            assert int(row.argmax()) == int(ref.argmax())
            assert batched[i][0].length == single[i][0].length
            tokens[i] = int(ref.argmax())
    for (cache_b, _), (cache_s, _) in zip(batched, single):
        for layer in range(cache_s.num_layers):
            kb, vb = cache_b.view(layer)
            ks, vs = cache_s.view(layer)
            assert torch.allclose(kb, ks, atol=1e-5) and torch.allclose(vb, vs, atol=1e-5)


def test_decode_batch_rejects_mismatched_or_shared_caches() -> None:
    model = make_loaded().model
    cache, _ = prefill(model, [1, 5, 6], 4)
    with pytest.raises(ValueError, match="one token per cache"):
        decode_batch(model, [5, 6], [cache])
    with pytest.raises(ValueError, match="twice"):
        decode_batch(model, [5, 6], [cache, cache])


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.3, top_k=12, top_p=0.9, seed=4),
    SamplingParams(max_tokens=30, temperature=1.0, seed=9, stop=("river",)),
    SamplingParams(max_tokens=30, temperature=1.0, seed=2),  # stops at EOS sooner or later
])
def test_decode_slot_yields_what_stream_from_yields(params) -> None:
    loaded = make_loaded()
    model, tok = loaded.model, loaded.tokenizer
    ids = tok("the city river is in paris . who led the project ?")["input_ids"]
    eos = [tok.eos_token_id, 7]  # a frequent word as extra EOS so that EOS paths run
    cache, logits = prefill(model, ids, params.max_tokens)
    expected = list(stream_from(model, tok, cache, logits, params, eos))
    cache, logits = prefill(model, ids, params.max_tokens)
    slot, got = DecodeSlot(tok, cache, params, eos, model.cfg.context_length), []
    while not slot.finished:
        got.append(slot.next_event(logits))
        if not slot.finished:
            logits = decode_batch(model, [slot.last_token], [cache])[0]
    assert got == expected
    assert got[-1].finish_reason in ("stop", "length")


def test_decode_slot_caps_tokens_to_the_context_left() -> None:
    loaded = make_loaded(max_position_embeddings=16)
    cache, logits = prefill(loaded.model, list(range(3, 13)), 100)
    slot = DecodeSlot(loaded.tokenizer, cache, SamplingParams(max_tokens=100, ignore_eos=True), [], 16)
    assert slot.params.max_tokens == 6
    with pytest.raises(RuntimeError):
        while True:
            event = slot.next_event(logits)
            logits = decode_batch(loaded.model, [event.token_id], [cache])[0] if not slot.finished else logits
    assert event.finish_reason == "length" and slot.count == 6


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("gemma3", {}), ("mistral", {"sliding_window": 8})])
def test_a_prefill_slice_batched_with_decodes_equals_each_forward_alone(arch, overrides) -> None:
    """Chunked prefill piggybacking decodes: a multi-token slice and single decode tokens in
    one ``forward_batch`` give each step's own forward (logits and cache)."""
    from kvblend.generation.batch import forward_batch
    from kvblend.generation.chunked import Forward

    model = make_loaded(arch, **overrides).model
    long_ids = torch.tensor(_prompt(23, 9))  # (23,)
    solo_cache, mixed_cache = model.new_cache(23), model.new_cache(23)
    model(long_ids[:9], solo_cache, logits_for="none")
    model(long_ids[:9], mixed_cache, logits_for="none")
    decoders = [prefill(model, _prompt(n, i), 2) for i, n in enumerate((4, 13))]
    alone = [prefill(model, _prompt(n, i), 2) for i, n in enumerate((4, 13))]
    want_slice = model(long_ids[9:], solo_cache, logits_for="all")  # (14, V)
    want_rows = [model(torch.tensor([7]), c)[0] for c, _ in alone]
    got = forward_batch(model, [Forward(torch.tensor([7]), decoders[0][0]), Forward(long_ids[9:], mixed_cache, "all"),
                                Forward(torch.tensor([7]), decoders[1][0])])
    assert got[1].shape == want_slice.shape and torch.allclose(got[1], want_slice, atol=1e-4, rtol=0)
    for row, want in zip((got[0], got[2]), want_rows):
        assert row.shape == (1, want.shape[0]) and torch.allclose(row[0], want, atol=1e-4, rtol=0)
    assert mixed_cache.length == solo_cache.length == 23
    for layer in range(solo_cache.num_layers):
        for a, b in zip(mixed_cache.view(layer), solo_cache.view(layer)):
            assert torch.allclose(a, b, atol=1e-5)
    assert forward_batch(model, [Forward(long_ids[:3], model.new_cache(3), "none")])[0].numel() == 0


def _one_hot(token: int, vocab: int) -> torch.Tensor:
    out = torch.zeros(vocab)  # (V,)
    out[token] = 1.0
    return out


def test_decode_slot_flushes_the_text_held_back_for_a_stop_string_at_eos() -> None:
    tok = make_tokenizer()
    eos = tok.eos_token_id
    answer = tok("the red city", add_special_tokens=False)["input_ids"] + [eos]
    cache = SimpleNamespace(length=4)
    slot = DecodeSlot(tok, cache, SamplingParams(max_tokens=20, stop=("city of",)), [eos], 1000)
    events = [slot.next_event(_one_hot(t, len(tok))) for t in answer]
    assert [e.token_id for e in events] == answer
    assert "".join(e.text for e in events[:-1]) == "the red "  # "city" could still begin "city of"
    assert events[-1].finish_reason == "stop" and events[-1].text == "city"
    assert slot.finished and slot.count == len(answer)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_forks_decode_in_one_batch_as_copies_would_past_a_sliding_window(arch) -> None:
    """n choices after one prefill: forks that read the prompt in place decode, batched
    beside their parent, exactly as independent caches of the same tokens (Gemma 3's local
    layers have a window of 8 that these 12 positions pass, so a fork's visible keys start
    inside its shared prompt)."""
    from kvblend.generation import prefill
    from kvblend.generation.slot import fork_cache

    model = make_loaded(arch).model
    prompt = [1, 5, 6, 7, 8, 9, 10]
    parent, _ = prefill(model, prompt, 8)
    forks = [fork_cache(parent, 8) for _ in range(2)]
    copies = [prefill(model, prompt, 8)[0] for _ in range(3)]
    steps = [(11, 12, 13), (14, 15, 16), (17, 18, 19)]
    for t in range(3):
        tokens = [s[t] for s in steps]
        shared = decode_batch(model, tokens, [parent, *forks])  # (3, V)
        apart = torch.cat([decode_batch(model, [tok], [c]) for tok, c in zip(tokens, copies)])
        assert torch.allclose(shared, apart, atol=1e-5)
    assert [f.length for f in forks] == [len(prompt) + 3] * 2 and parent.length == len(prompt) + 3


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_decode_token_is_the_same_whether_or_not_a_prefill_rides_in_its_pass(arch) -> None:
    """With packed decode weights, a decode token's logits and KV are exactly those of the
    same token decoded in a pass of decodes alone, whether or not a prefill slice rides in
    the pass: one pass multiplied its row by the fp32 weights, so a greedy answer under
    load (a shadow check's prefill beside it) could differ from the same request's answer
    on a quiet server at a near tie. The slice still gets its own forward's result."""
    from kvblend.generation.batch import forward_batch
    from kvblend.generation.chunked import Forward

    model = make_loaded(arch).model
    model.pack_decode_weights("int8")
    prompts = [_prompt(n, i) for i, n in enumerate((4, 13))]
    quiet = [prefill(model, p, 2)[0] for p in prompts]
    busy = [prefill(model, p, 2)[0] for p in prompts]
    want = forward_batch(model, [Forward(torch.tensor([7]), c) for c in quiet])
    long_ids = torch.tensor(_prompt(23, 9))
    solo, mixed = model.new_cache(23), model.new_cache(23)
    want_slice = model(long_ids, solo, logits_for="all")
    got = forward_batch(model, [Forward(torch.tensor([7]), busy[0]), Forward(long_ids, mixed, "all"),
                                Forward(torch.tensor([7]), busy[1])])
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[1])
    torch.testing.assert_close(got[1], want_slice, rtol=0, atol=1e-4)
    for a, b in zip(quiet, busy):
        assert a.length == b.length
        for layer in range(a.num_layers):
            assert all(torch.equal(x, y) for x, y in zip(a.view(layer), b.view(layer)))
    assert mixed.length == 23


def test_a_split_pass_that_fails_extends_no_cache() -> None:
    """A mixed pass runs its prefill steps, then its decode steps; when the decode steps
    fail, the prefill steps' caches are back at their lengths, as after one failed pass
    (the scheduler then runs each step alone from where it was)."""
    from kvblend.generation.batch import forward_batch
    from kvblend.generation.chunked import Forward

    model = make_loaded(max_position_embeddings=16).model
    model.pack_decode_weights("int8")
    cache, _ = prefill(model, list(range(3, 19)), 0)  # at the context's end: its decode step fails
    slice_cache = model.new_cache(9)
    with pytest.raises(Exception, match="context"):
        forward_batch(model, [Forward(torch.arange(3, 12), slice_cache, "none"), Forward(torch.tensor([7]), cache)])
    assert slice_cache.length == 0 and cache.length == 16
