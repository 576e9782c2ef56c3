"""Automatic prefix caching for every caching method (issue #40): every exactly computed
run of tokens enters the tenant's radix tree: a prompt no reused document touched, the
exact prefix of a blended one, and the answer decoded after an exact prompt."""

from __future__ import annotations

import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, PrefixCache, Request
from kvblend.generation import SamplingParams
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

SYSTEM = "answer the question ."
CONTEXT = " ".join(DOCS)


def plain(question: str = QUESTION, method: str = "blend", tenant: str = "default") -> Request:
    """A prompt with no documents: the passages pasted into the user turn."""
    return Request(question=f"{CONTEXT} {question}", system=SYSTEM, method=method, tenant=tenant)


def test_a_repeated_plain_prompt_is_served_from_the_prefix_cache_exactly() -> None:
    eng = Engine(make_loaded())
    first = eng.prepare(plain())
    again = eng.prepare(plain())
    n = len(again.layout)
    assert first.stats.prefix_hit_tokens < n // 4  # cold: at most the system turn
    assert again.stats.prefix_hit_tokens == n - 1  # all but the token that yields the logits
    full = eng.prepare(plain(method="full")).logits
    assert torch.allclose(again.logits, full, atol=1e-4)
    assert eng.prepare(plain(tenant="globex")).stats.prefix_hit_tokens == 0  # scoped by tenant


def test_full_prefill_neither_reads_nor_fills_the_prefix_cache() -> None:
    eng = Engine(make_loaded())
    assert eng.prepare(plain(method="full")).exact_tokens == 0
    assert eng.prepare(plain()).stats.prefix_hit_tokens == 0
    assert eng.prepare(plain(method="full")).stats.prefix_hit_tokens == 0


def test_documents_inside_an_exact_cached_prompt_are_not_blended() -> None:
    """An exact prompt (``prefix``) is cached whole; a blend of the same documents then
    takes them from the exact prefix, so its logits are full prefill's."""
    eng = Engine(make_loaded())
    req = Request(documents=DOCS, question=QUESTION, system=SYSTEM, method="prefix")
    eng.prepare(req)
    blended = eng.prepare(Request(documents=DOCS, question=QUESTION, system=SYSTEM))
    assert [d.source for d in blended.stats.docs] == ["prefix"] * 3
    assert blended.stats.prefix_hit_tokens == len(blended.layout) - 1
    full = eng.prepare(Request(documents=DOCS, question=QUESTION, system=SYSTEM, method="full")).logits
    assert torch.allclose(blended.logits, full, atol=1e-4)


def test_a_prefix_hit_ending_inside_a_document_stops_at_its_start() -> None:
    eng = Engine(make_loaded())
    eng.prepare(Request(documents=DOCS, question=QUESTION, system=SYSTEM, method="prefix"))
    changed = DOCS[1].replace("green", "purple")  # the same first words: the match ends inside it
    got = eng.prepare(Request(documents=[DOCS[0], changed], question=QUESTION, system=SYSTEM,
                              blend=BlendConfig(recompute_misses=False)))
    assert got.layout.doc_starts[1] < got.layout.doc_starts[1] + len(got.layout.docs[1])
    assert got.stats.prefix_hit_tokens == got.layout.doc_starts[1]
    assert [d.source for d in got.stats.docs] == ["prefix", "chunk"]


def test_a_blend_caches_only_its_exact_prefix() -> None:
    """Tokens after a reused document read approximate KV: they never enter the cache."""
    eng = Engine(make_loaded())
    req = Request(documents=DOCS, question=QUESTION, system=SYSTEM, blend=BlendConfig(recompute_misses=False))
    first = eng.prepare(req)
    assert first.exact_tokens == first.layout.doc_starts[0]
    again = eng.prepare(req)
    assert again.stats.prefix_hit_tokens == first.layout.doc_starts[0]
    assert [d.source for d in again.stats.docs] == ["memory"] * 3


def test_the_answer_after_an_exact_prompt_is_cached_for_the_next_turn() -> None:
    eng = Engine(make_loaded())
    turn1 = Request(question=f"{CONTEXT} {QUESTION}", system=SYSTEM)
    prompt = eng.layout(turn1).ids
    result = eng.generate(turn1, SamplingParams(max_tokens=6, ignore_eos=True))
    answer = result.token_ids
    # the next turn's prompt repeats the first prompt and the answer's tokens, then goes on
    probe = torch.tensor([*prompt, *answer, *eng.tokenizer("and then ?", add_special_tokens=False)["input_ids"]])
    hit = eng.prefix_cache.lookup(eng.prefix_scope("default"), probe)
    assert hit is not None and hit.length == len(prompt) + len(answer) - 1  # the last token's KV is never computed
    ref = Engine(make_loaded(), prefix_cache=PrefixCache(0))
    cache_ref = ref.prepare(Request(question=f"{CONTEXT} {QUESTION}", system=SYSTEM, method="full"),
                            extra_capacity=len(answer))
    tail = ref.model(torch.tensor(answer[:-1]), cache_ref.cache, logits_for="all")
    assert tail.shape[0] == len(answer) - 1
    for layer in range(len(hit.keys)):  # the cached answer KV is a full prefill's
        assert torch.allclose(hit.keys[layer], cache_ref.cache.keys[layer][:, : hit.length], atol=1e-4)


def test_a_prefix_cache_that_fails_on_the_answer_never_fails_the_request(monkeypatch) -> None:
    """The answer's entry is an optimisation: a failing insert is logged and the request
    still returns its answer, in Engine.generate and under the scheduler."""
    from kvblend.engine.scheduler import Scheduler

    eng = Engine(make_loaded())
    request = Request(question=f"{CONTEXT} {QUESTION}", system=SYSTEM)
    expected = eng.generate(request, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids
    eng.prefix_cache.clear()
    real = eng.prefix_cache.insert

    def fails_on_answers(scope, ids, cache, length):
        if length > len(eng.layout(request)):
            raise RuntimeError("out of memory (test)")
        return real(scope, ids, cache, length)

    monkeypatch.setattr(eng.prefix_cache, "insert", fails_on_answers)
    assert eng.generate(request, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids == expected
    sched = Scheduler(eng)
    sched.start()
    try:
        out = sched.submit(request, SamplingParams(max_tokens=4, ignore_eos=True)).result()
        assert out.token_ids == expected
    finally:
        sched.drain(10)


def finished(eng: Engine, request: Request, max_tokens: int = 4):
    """Prepare ``request``, decode greedily and remember the answer, as the scheduler does."""
    prepared = eng.prepare(request, extra_capacity=max_tokens)
    tokens, cache, logits = [], prepared.cache, prepared.logits
    for step in range(max_tokens):
        tokens.append(int(logits.argmax()))
        if step + 1 < max_tokens:  # the last token's KV is never computed
            logits = eng.model(torch.tensor(tokens[-1:]), cache)[0]
    eng.remember_answer(request, prepared, tokens)
    return prepared, tokens


def blended(question: str = QUESTION, tenant: str = "default", **blend) -> Request:
    return Request(documents=DOCS, question=question, system=SYSTEM, tenant=tenant,
                   blend=BlendConfig(recompute_misses=False, **blend))


def test_a_repeated_blend_is_served_its_first_blend_whole() -> None:
    """A blended prompt is not exact, so its prefixes never enter the exact tree; but the
    whole prompt is the same blend again: a repeat reuses it (all but its last token), and
    gets the first blend's logits and risk without blending again."""
    eng = Engine(make_loaded())
    first, _ = finished(eng, blended())
    assert first.exact_tokens == first.layout.doc_starts[0] and first.blended is not None
    again = eng.prepare(blended())
    n = len(again.layout)
    assert again.stats.prefix_hit_tokens == n - 1
    assert [d.source for d in again.stats.docs] == ["prefix"] * 3  # nothing looked up, nothing blended
    assert again.stats.candidates == 0  # no stored KV read: nothing fused
    assert torch.allclose(again.logits, first.logits, atol=1e-4)
    assert again.stats.risk == first.stats.risk and again.exact_tokens == 0


def test_a_blend_served_whole_only_to_the_same_tenant_config_and_prompt() -> None:
    eng = Engine(make_loaded())
    first, _ = finished(eng, blended())
    exact_prefix = first.layout.doc_starts[0]
    assert eng.prepare(blended(tenant="globex")).stats.prefix_hit_tokens == 0
    assert eng.prepare(blended(ratio=0.5)).stats.prefix_hit_tokens == exact_prefix
    other = eng.prepare(blended(question="what colour is the sky ?"))  # the same documents, another question
    assert other.stats.prefix_hit_tokens == exact_prefix  # not a part of the earlier blend
    assert [d.source for d in other.stats.docs] == ["memory"] * 3


def test_a_chat_turn_after_a_blend_reuses_the_blended_prompt_and_answer() -> None:
    eng = Engine(make_loaded())
    turn1 = blended()
    first, answer = finished(eng, turn1)
    probe = torch.tensor([*first.layout.ids, *answer, *eng.tokenizer(" and then ?", add_special_tokens=False)["input_ids"]])
    hit = eng.prefix_cache.lookup(first.blended.scope, probe, whole_entries=True)
    assert hit is not None and hit.length == len(first.layout) + len(answer) - 1
    for layer in range(len(hit.keys)):  # the very KV the answer was decoded from
        assert torch.allclose(hit.keys[layer][:, : len(first.layout)], first.cache.keys[layer][:, : len(first.layout)])


def test_a_request_served_a_whole_blend_remembers_its_own_answer() -> None:
    eng = Engine(make_loaded())
    finished(eng, blended())
    second, _ = finished(eng, blended())
    assert second.blended is not None and second.exact_tokens == 0
    assert eng.prepare(blended()).stats.prefix_hit_tokens == len(second.layout) - 1


def test_deleting_a_stored_chunk_forgets_its_tenants_whole_blends_only() -> None:
    """A blend kept whole holds KV made from stored chunks: once a chunk of the tenant is
    deleted, no repeat is served from it; other tenants' and exact prefixes stay."""
    eng = Engine(make_loaded())
    finished(eng, blended())
    finished(eng, blended(tenant="globex"))
    n = len(eng.layout(blended()))
    exact = eng.prepare(blended(question="other ?")).stats.prefix_hit_tokens  # the exact prefix before the documents
    assert eng.cached_prefix(blended()) == n - 1
    before = eng.prefix_cache.stats()["tokens"]
    dropped = eng.forget_blends(["default/" + "0" * 64])
    assert dropped > 0 and eng.prefix_cache.stats()["tokens"] == before - dropped
    assert eng.cached_prefix(blended()) == exact < n - 1
    assert eng.cached_prefix(blended(tenant="globex")) == n - 1
    finished(eng, blended())  # the cache still takes entries after the drop
    assert eng.cached_prefix(blended()) == n - 1


def test_a_blend_reusing_little_of_its_prompt_runs_as_an_exact_prefill() -> None:
    """Below ``BlendConfig.min_reuse`` of the prompt reused, fusion costs more than a full
    prefill (issue #40's traffic: 78 reused tokens of 1,295 blended in 2x full's time): the
    request is computed exactly and prefix-cached; the stored document is reported skipped."""
    eng = Engine(make_loaded())
    doc, pasted = DOCS[0], f"{' '.join(DOCS[1:] * 3)} {QUESTION}"
    eng.warm([doc], eng.sink_prefix)

    def ask(**knobs) -> Request:
        return Request(documents=[doc], question=pasted, system=SYSTEM, blend=BlendConfig(**knobs))

    assert len(eng.layout(ask()).docs[0]) < 0.3 * len(eng.layout(ask()))
    exact = eng.prepare(ask())
    assert exact.stats.fallback == "little-reuse" and [d.source for d in exact.stats.docs] == ["skipped"]
    full = eng.prepare(Request(documents=[doc], question=pasted, system=SYSTEM, method="full")).logits
    assert torch.allclose(exact.logits, full, atol=1e-4)
    assert eng.prepare(ask()).stats.prefix_hit_tokens == len(exact.layout) - 1  # exact, so prefix-cached
    cold = Engine(make_loaded())  # no prefix cached
    cold.warm([doc], cold.sink_prefix)
    blended = cold.prepare(ask(min_reuse=0.0, ratio=0.2))  # 0: blend whatever is reused
    assert blended.stats.fallback is None and [d.source for d in blended.stats.docs] == ["memory"]
