"""Streaming text: stop strings, held-back prefixes, finish reasons, context caps."""

from __future__ import annotations

import pytest

from kvblend.errors import ContextLengthError
from kvblend.generation import SamplingParams, collect, stream
from kvblend.generation.text import TextStream
from tests.conftest import make_loaded, make_tokenizer


def ids(text: str) -> list[int]:
    return make_tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_stop_string_cuts_text_and_never_leaks() -> None:
    s = TextStream(make_tokenizer(), stop=("city of",))
    out = "".join(s.push(t) for t in ids("the red city of paris"))
    assert s.stopped and out == "the red "


def test_text_that_might_start_a_stop_string_is_held_back() -> None:
    s = TextStream(make_tokenizer(), stop=("city of",))
    deltas = [s.push(t) for t in ids("the red city")]
    assert "".join(deltas) == "the red "  # "city" could begin "city of"
    assert s.push(ids("blue")[0]) == "city blue" and not s.stopped


def test_finish_flushes_what_was_held() -> None:
    s = TextStream(make_tokenizer(), stop=("city of",))
    shown = "".join(s.push(t) for t in ids("the red city"))
    assert shown + s.finish() == "the red city"


def test_stream_reports_length_and_stop_reasons() -> None:
    loaded = make_loaded()
    prompt = [1, 5, 6, 7]
    free = collect(stream(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=8, ignore_eos=True), ()), 4)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    eos = free.token_ids[2]
    stopped = collect(stream(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=8), (eos,)), 4)
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos


def test_new_tokens_are_capped_by_the_context() -> None:
    loaded = make_loaded(max_position_embeddings=12)
    done = collect(stream(loaded.model, loaded.tokenizer, [1, 5, 6, 7, 8, 9, 10, 11, 12, 13],
                          SamplingParams(max_tokens=50, ignore_eos=True), ()), 10)
    assert len(done.token_ids) == 2 and done.finish_reason == "length"
    with pytest.raises(ContextLengthError, match="12"):
        list(stream(loaded.model, loaded.tokenizer, list(range(1, 14)), SamplingParams(), ()))


class _Scripted:
    """A stand-in model whose next token follows a script (one-hot logits)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.step = script, vocab, 0
        self.device = "cpu"
        self.cfg = type("Cfg", (), {"context_length": 1000})()

    def logits(self):
        import torch

        out = torch.zeros(1, self.vocab)
        out[0, self.script[self.step]] = 1.0
        self.step += 1
        return out

    def __call__(self, ids, cache):
        return self.logits()


def test_eos_flushes_the_text_held_back_for_a_stop_string() -> None:
    from kvblend.generation import stream_from

    tok = make_tokenizer()
    eos = tok.eos_token_id
    model = _Scripted(ids("the red city") + [eos], len(tok))
    cache = type("Cache", (), {"length": 4})()
    events = list(stream_from(model, tok, cache, model.logits()[0], SamplingParams(max_tokens=20, stop=("city of",)),
                              (eos,)))
    done = collect(iter(events), 4)
    assert done.finish_reason == "stop" and done.text == "the red city"  # "city" was held back, then EOS came


# ----- incremental decoding: the same text as one decode, at a cost linear in the answer --------
def _smollm2_tokenizer():
    from kvblend.models.loader import load_tokenizer
    from kvblend.models.registry import DEFAULT_MODEL, resolve_packaged

    return load_tokenizer(resolve_packaged(DEFAULT_MODEL))


class _Counting:
    """A tokenizer that counts the token ids it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kw) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deltas_add_up_to_one_decode_of_the_answer(seed: int) -> None:
    import random

    tok = _smollm2_tokenizer()
    rng = random.Random(seed)
    text = "Café naïve — 東京 and Zürich: \"don't\" ... 🙂🙂 x² ≥ 3 . , ; newline\n\ttab  double  spaces"
    natural = tok(text, add_special_tokens=False)["input_ids"]
    noise = [rng.randrange(len(tok)) for _ in range(300)]  # byte pieces, specials, anything
    ids_ = natural + noise + natural
    s = TextStream(tok)
    shown = "".join(s.push(t) for t in ids_) + s.finish()
    assert shown == tok.decode(ids_, skip_special_tokens=True)


def test_each_token_decodes_a_short_window_not_the_whole_answer() -> None:
    counting = _Counting(_smollm2_tokenizer())
    words = counting.tokenizer("the river runs north past an old mill " * 250, add_special_tokens=False)["input_ids"]
    s = TextStream(counting, stop=("never said",))
    out = "".join(s.push(t) for t in words) + s.finish()
    assert out == counting.tokenizer.decode(words, skip_special_tokens=True)
    assert counting.decoded < 20 * len(words)  # decoding the whole answer each token: ~len(words)**2 / 2


def test_a_stop_string_across_tokens_after_a_long_answer_is_found() -> None:
    tok = _smollm2_tokenizer()
    ids_ = tok("word " * 400 + "the city of paris", add_special_tokens=False)["input_ids"]
    s = TextStream(tok, stop=("city of",))
    out = "".join(s.push(t) for t in ids_)
    assert s.stopped and out == "word " * 400 + "the "


def test_a_long_run_of_tokens_without_text_keeps_the_window_short() -> None:
    """Special tokens (an EOS ignored again and again) decode to nothing: they must settle,
    not grow the window that every later token decodes."""
    counting = _Counting(_smollm2_tokenizer())
    eos = counting.tokenizer.eos_token_id
    words = counting.tokenizer("the river runs north", add_special_tokens=False)["input_ids"]
    ids_ = words + [eos] * 2000 + words
    s = TextStream(counting)
    out = "".join(s.push(t) for t in ids_) + s.finish()
    assert out == counting.tokenizer.decode(ids_, skip_special_tokens=True)
    assert counting.decoded < 20 * len(ids_)
