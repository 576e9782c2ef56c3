"""Request-level behaviour: hits and misses, repeats, ordering, stats, streaming."""

from __future__ import annotations

import threading

import pytest
import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Request, RequestStats
from kvblend.errors import InvalidRequestError
from kvblend.generation import SamplingParams, StreamEvent
from kvblend.store import StoreConfig, build_store
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION


@pytest.fixture
def eng() -> Engine:
    return Engine(make_loaded())


def prepare(eng: Engine, docs, **kw):
    return eng.prepare(Request(documents=docs, question=QUESTION, **kw))


def test_first_request_misses_then_every_order_hits(eng: Engine) -> None:
    first = prepare(eng, DOCS).stats
    assert [d.hit for d in first.docs] == [False, False, False]
    eng.flush()
    for order in ([2, 0, 1], [1, 2, 0]):
        stats = prepare(eng, [DOCS[i] for i in order]).stats
        assert all(d.hit and d.source == "memory" for d in stats.docs)
    assert eng.store.stats().entries == 3  # one stored copy per document, whatever its position


def test_same_document_twice_uses_one_entry(eng: Engine) -> None:
    prepare(eng, [DOCS[0]])
    eng.flush()
    stats = prepare(eng, [DOCS[0], DOCS[1], DOCS[0]]).stats
    assert [d.source for d in stats.docs] == ["memory", "chunk", "request"]
    eng.flush()
    assert eng.store.stats().entries == 2


def test_empty_document_is_skipped(eng: Engine) -> None:
    stats = prepare(eng, ["", DOCS[0]]).stats
    assert stats.docs[0].tokens == 0 and stats.docs[1].tokens > 0
    assert stats.prompt_tokens == prepare(eng, [DOCS[0]], method="full").stats.prompt_tokens


def test_token_id_documents_are_placed_verbatim(eng: Engine) -> None:
    ids = eng.tokenizer(DOCS[1], add_special_tokens=False)["input_ids"]
    a = prepare(eng, [DOCS[0], ids], method="full")
    b = prepare(eng, [DOCS[0], DOCS[1]], method="full")
    assert a.layout.ids == b.layout.ids
    assert a.layout.docs[1] == tuple(ids)


def test_tenants_do_not_share_chunks(eng: Engine) -> None:
    prepare(eng, DOCS, tenant="acme")
    eng.flush()
    assert not any(d.hit for d in prepare(eng, DOCS, tenant="globex").stats.docs)


def test_generate_reports_text_tokens_and_stats(eng: Engine) -> None:
    prepare(eng, DOCS)
    eng.flush()
    res = eng.generate(Request(documents=DOCS, question=QUESTION), SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(res.token_ids) == 6 and res.finish_reason == "length"
    s = res.stats
    assert s.method == "blend" and s.ttft_s >= s.prefill_s > 0
    assert len(s.recomputed_per_layer) == eng.loaded.config.num_layers
    assert 0 < s.recompute_frac < 1
    assert set(res.to_dict()["stats"]) >= {"docs", "recompute_frac", "lookup_s", "load_s", "ttft_s"}


def test_stream_yields_stats_before_the_first_token_then_events(eng: Engine) -> None:
    items = list(eng.stream(Request(documents=DOCS, question=QUESTION, method="full"),
                            SamplingParams(max_tokens=4, ignore_eos=True)))
    assert isinstance(items[0], RequestStats) and isinstance(items[1], StreamEvent) and items[0].ttft_s > 0
    assert sum(isinstance(i, StreamEvent) for i in items) == 4


def test_bad_requests_are_rejected_clearly() -> None:
    with pytest.raises(InvalidRequestError, match="method"):
        Request(documents=DOCS, question=QUESTION, method="magic")
    with pytest.raises(InvalidRequestError, match="one string"):
        Request(documents="just text", question=QUESTION)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Request(documents=DOCS)
    with pytest.raises(InvalidRequestError, match="non-increasing"):
        BlendConfig(check_layers=(1, 2), schedule=(0.1, 0.3))
    with pytest.raises(InvalidRequestError, match="layer-0"):
        BlendConfig(check_layers=(0,))


def test_chat_messages_put_documents_in_the_last_user_turn(eng: Engine) -> None:
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": QUESTION}]
    p = eng.prepare(Request(documents=DOCS[:1], messages=msgs, method="full"))
    text = eng.tokenizer.decode(p.layout.prefix)
    assert text.count("<|im_start|>") == 3 and text.rstrip().endswith("user")


def _disk_engine(loaded, path) -> Engine:
    return Engine(loaded, store=build_store(StoreConfig(tiers=("disk",), disk_dir=str(path))))


def test_disk_tier_serves_a_restarted_engine(tmp_path) -> None:
    loaded = make_loaded()
    first = _disk_engine(loaded, tmp_path)
    prepare(first, DOCS)
    first.close()
    again = _disk_engine(loaded, tmp_path)
    p = prepare(again, DOCS[::-1])
    assert [d.source for d in p.stats.docs] == ["disk"] * 3


def test_corrupt_entries_are_recomputed_never_used(tmp_path) -> None:
    loaded = make_loaded()
    first = _disk_engine(loaded, tmp_path)
    prepare(first, DOCS)
    first.close()
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) == 3
    for f in files:
        data = bytearray(f.read_bytes())
        data[-50:] = bytes(50)  # clobber the end of the last tensor
        f.write_bytes(bytes(data))
    again = _disk_engine(loaded, tmp_path)
    blended = prepare(again, DOCS, blend=BlendConfig(ratio=0.0))
    assert not any(d.hit for d in blended.stats.docs)
    full = prepare(again, DOCS, method="full")
    assert (blended.logits - full.logits).abs().max().item() <= 1e-3


def test_misses_can_be_cached_first_then_blended(eng: Engine) -> None:
    cfg = BlendConfig(ratio=1.0, recompute_misses=False)
    p = eng.prepare(Request(documents=DOCS, question=QUESTION, blend=cfg))
    assert p.stats.candidates > 0  # the fresh chunks were blended like hits
    eng.flush()
    assert eng.store.stats().entries == 3  # and written back without computing them again
    full = prepare(eng, DOCS, method="full")
    assert (p.logits - full.logits).abs().max().item() <= 1e-3


def test_background_writes_are_bounded() -> None:
    """The store's first write is held until the request ends, so the bound is reached
    whatever the write-back thread's speed (it once drained each miss before the next)."""
    store = build_store(StoreConfig(writeback_queue=1))
    release, put = threading.Event(), store.put
    store.put = lambda *a, **kw: release.wait(30) and put(*a, **kw)
    eng = Engine(make_loaded(), store=store)
    prepare(eng, DOCS)  # three misses, room for one pending write
    release.set()
    eng.flush()
    assert eng.writeback_stats().dropped == 2 and eng.store.stats().entries == 1


def test_requests_never_write_to_the_stored_chunks_they_borrow(eng: Engine) -> None:
    prepare(eng, DOCS)
    eng.flush()
    memory = eng.store.tier("memory")
    before = {key: {n: t.clone() for n, t in entry.tensors.items()} for key, entry in memory._entries.items()}
    for order, method, ratio in (([2, 0, 1], "blend", 0.3), ([1, 1, 0], "reuse", 0.15), ([0, 2], "blend", 1.0)):
        stats = prepare(eng, [DOCS[i] for i in order], method=method, blend=BlendConfig(ratio=ratio)).stats
        assert all(d.hit for d in stats.docs)
    assert before.keys() == memory._entries.keys()
    for key, tensors in before.items():
        stored = memory._entries[key].tensors
        assert all(torch.equal(t, stored[n]) for n, t in tensors.items())


def test_recompute_fraction_is_the_share_of_prompt_token_layers_computed(eng: Engine) -> None:
    """A prefix hit and one stored 10-token document: the fraction stays in [0, 1] for every
    ratio (question selection runs the question's rows twice; they count once). Ratio 1
    computes everything but the prefix hit; ratio 0 reuses the document too."""
    doc = eng.tokenizer(DOCS[0], add_special_tokens=False)["input_ids"][:10]
    question = "who is the doctor ? tell me where the doctor works and what the doctor does there , please"

    def stats(**kw) -> RequestStats:
        return eng.prepare(Request(documents=[doc], question=question, **kw)).stats

    stats()  # stores the document's KV and the prefix
    eng.flush()
    by_ratio = {r: stats(blend=BlendConfig(ratio=r, min_reuse=0.0)) for r in (0.0, 0.15, 1.0)}  # blend however little
    for s in by_ratio.values():
        assert s.prefix_hit_tokens > 0 and [(d.tokens, d.source) for d in s.docs] == [(10, "memory")]
        assert 0.0 <= s.recompute_frac <= 1.0
    n, p = by_ratio[1.0].prompt_tokens, by_ratio[1.0].prefix_hit_tokens
    assert by_ratio[1.0].recompute_frac == pytest.approx((n - p) / n)
    assert by_ratio[0.0].recompute_frac == pytest.approx((n - p - 10) / n)
    assert by_ratio[0.0].recompute_frac < by_ratio[0.15].recompute_frac < by_ratio[1.0].recompute_frac
    assert stats(method="full").recompute_frac == 1.0
    prefix = stats(method="prefix")
    assert prefix.recompute_frac == pytest.approx(1 - prefix.prefix_hit_tokens / prefix.prompt_tokens)
