"""The character matcher: stored texts found in messages exactly, never near-misses,
never another tenant's; spans chosen without overlap; memory bounded."""

from __future__ import annotations

import random

import pytest

from kvblend.engine.matching import (
    MIN_CHARS, WINDOW, DocumentIndex, IndexedText, best_spans, code_points, text_anchors, window_hashes,
)

WORDS = "river city north paris blue company doctor alpha novel year green lisbon oslo madrid rome".split()


def passage(seed: int, words: int = 40) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + f" #{seed}."


def text(t: str, chunk: str, document: str | None = "doc") -> IndexedText:
    return IndexedText(t, tuple(range(1, len(t) // 4 + 2)), chunk, document)


def indexed(*texts: str, tenant: str = "t") -> DocumentIndex:
    index = DocumentIndex()
    index.add(tenant, [text(t, f"c{i}", f"d{i}") for i, t in enumerate(texts)])
    return index


def spans(index: DocumentIndex, message: str, tenant: str = "t") -> list[tuple[int, int, str]]:
    return [(m.start, m.end, m.chunk) for m in index.match(tenant, [message])]


def test_window_hashes_equal_the_polynomial_of_each_window() -> None:
    s = "héllo wörld, ünïcode ✓ " * 4
    h = window_hashes(code_points(s))
    assert len(h) == len(s) - WINDOW + 1
    for p in (0, 7, len(h) - 1):
        want = 0
        for ch in s[p : p + WINDOW]:
            want = (want * 0x100000001B3 + ord(ch)) % 2**64
        assert int(h[p]) == want


def test_exact_spans_are_found_where_they_stand() -> None:
    a, b = passage(1), passage(2)
    msg = f"Answer using the context:\n\n{a}\n\n{b}\n\nQuestion: who?"
    found = spans(indexed(a, b), msg)
    assert found == [(msg.index(a), msg.index(a) + len(a), "c0"), (msg.index(b), msg.index(b) + len(b), "c1")]
    for start, end, chunk in found:
        assert msg[start:end] == (a if chunk == "c0" else b)


def test_passages_at_message_start_and_end_and_adjacent() -> None:
    a, b = passage(3), passage(4)
    msg = a + b  # adjacent, the first at the start and the second at the end
    assert spans(indexed(a, b), msg) == [(0, len(a), "c0"), (len(a), len(msg), "c1")]


def test_overlapping_candidates_keep_the_most_characters() -> None:
    a = passage(5, 60)
    head, tail = a[: len(a) // 2 + 10], a[len(a) // 2 - 10 :]  # overlap each other; a covers both
    msg = "ctx: " + a + " end"
    index = indexed(head, tail, a)
    assert spans(index, msg) == [(5, 5 + len(a), "c2")]
    only_halves = indexed(head, tail)  # overlapping: one of them, not both
    found = spans(only_halves, msg)
    assert len(found) == 1


def test_unicode_and_repeated_passages() -> None:
    a = "Ünïcödé façade — 東京 は 日本 の 首都 です。 " * 3 + "emoji 🙂 end"
    msg = f"{a}\n\n{a}"
    found = spans(indexed(a), msg)
    assert found == [(0, len(a), "c0"), (len(a) + 2, 2 * len(a) + 2, "c0")]


def test_a_near_miss_does_not_match() -> None:
    a = passage(6)
    changed = a[:50] + ("X" if a[50] != "X" else "Y") + a[51:]
    assert spans(indexed(a), f"context: {changed} ?") == []
    assert spans(indexed(a), f"context: {a[:-1]} ?") == []  # truncated by one character
    assert spans(indexed(a), f"context: {a} ?") != []


def test_tenants_never_see_each_other() -> None:
    a = passage(7)
    index = indexed(a, tenant="alice")
    assert spans(index, a, tenant="alice") != []
    assert spans(index, a, tenant="bob") == []
    index.add("bob", [text(passage(8), "bob-chunk")])
    assert all(chunk != "bob-chunk" for _, _, chunk in spans(index, passage(8), tenant="alice"))


def test_short_texts_are_not_indexed_and_fixed_anchors_still_match() -> None:
    index = DocumentIndex()
    assert index.add("t", [text("x" * (MIN_CHARS - 1), "short")]) == 0
    fixed = next(t for t in (passage(s, 8) for s in range(2000)) if text_anchors(t)[1])  # no content anchor
    index.add("t", [text(fixed, "fixed")])
    assert spans(index, f"see: {fixed}!") == [(5, 5 + len(fixed), "fixed")]


def test_memory_is_bounded_and_least_recent_texts_go_first() -> None:
    texts = [passage(s) for s in range(14)]
    every = DocumentIndex()
    every.add("t", [text(t, f"c{i}") for i, t in enumerate(texts)])
    index = DocumentIndex(max_bytes=every.nbytes * 10 // 14)  # about ten texts (their anchors vary)
    for i, t in enumerate(texts):
        index.add("t", [text(t, f"c{i}")])
        if i == 8:
            index.match("t", [texts[0]])  # a match refreshes c0
    assert index.nbytes <= index.max_bytes and index.count("t") < 14
    assert spans(index, texts[0]) and spans(index, texts[13]) and not spans(index, texts[1])


def test_eviction_takes_from_the_tenant_holding_the_most() -> None:
    one = DocumentIndex()
    one.add("t", [text(passage(0), "c")])
    index = DocumentIndex(max_bytes=one.nbytes * 6)
    index.add("small", [text(passage(100), "s")])
    index.add("big", [text(passage(s), f"b{s}") for s in range(10)])
    assert index.count("small") == 1 and 0 < index.count("big") <= 5


def test_remove_document_drops_its_texts() -> None:
    a, b = passage(9), passage(10)
    index = indexed(a, b)
    assert index.remove_document("t", "d0") == 1
    assert [c for _, _, c in spans(index, a + b)] == ["c1"]


def test_a_stored_text_seen_inline_again_keeps_its_document() -> None:
    a = passage(11)
    index = indexed(a)  # stored as document d0
    index.add("t", [text(a, "c0", None)])  # the same text sent inline in a request
    assert [m.document for m in index.match("t", [a])] == ["d0"]
    assert index.remove_document("t", "d0") == 1  # so deleting the document still finds it
    assert spans(index, a) == []


def test_best_spans_is_weighted_interval_scheduling() -> None:
    assert best_spans([(0, 10, 1), (5, 30, 2), (10, 20, 3)]) == [(5, 30, 2)]
    assert best_spans([(0, 10, 1), (10, 20, 2), (5, 15, 3)]) == [(0, 10, 1), (10, 20, 2)]
    assert best_spans([(0, 10, 1), (0, 10, 7)]) == [(0, 10, 7)]  # the newest of equal spans
    assert best_spans([]) == []


@pytest.mark.parametrize("seed", range(3))
def test_random_messages_find_every_planted_passage(seed: int) -> None:
    rng = random.Random(seed)
    stored = [passage(1000 * seed + i, rng.randint(8, 60)) for i in range(30)]
    index = indexed(*stored)
    planted = rng.sample(range(30), 6)
    parts, want, pos = [], [], 0
    for i in planted:
        filler = rng.choice(["\n\n", " Document: ", "", "\n---\n"])
        parts += [filler, stored[i]]
        pos += len(filler)
        want.append((pos, pos + len(stored[i]), f"c{i}"))
        pos += len(stored[i])
    assert spans(index, "".join(parts)) == want


def test_a_repetitive_message_keeps_the_candidates_bounded() -> None:
    """A tenant that indexes 64 texts of one repeated character and sends a long message of
    it: every position verified for every text made the candidates grow with the message
    length times the bucket (1.28M here, minutes and GBs at 8 MiB) under the index's one lock."""
    from kvblend.engine.matching import candidate_limit

    index = indexed(*("a" * n for n in range(MIN_CHARS, MIN_CHARS + 64)))
    message = "a" * 20_000
    tenant_index = index._tenants["t"]
    found = tenant_index.candidates(message)
    assert len(found) <= candidate_limit(len(message))
    chosen = spans(index, message)
    assert chosen and all(message[a:b] == "a" * (b - a) for a, b, _ in chosen)
    assert all(b <= c for (_, b, _), (c, _, _) in zip(chosen, chosen[1:]))  # non-overlapping


@pytest.mark.parametrize("pasted", [0, 1])
def test_a_run_stored_in_several_texts_is_taken_from_the_text_it_continues(pasted: int) -> None:
    """A paragraph that two stored texts share is found in both; the run reused is the one
    after the same text as here (its KV was computed after what precedes it in the
    prompt), not the newest: an app's next chunk of a passage continues that passage."""
    from kvblend.models.loader import load_tokenizer
    from kvblend.models.registry import DEFAULT_MODEL, resolve_packaged

    tok = load_tokenizer(resolve_packaged(DEFAULT_MODEL))
    shared = " ".join(f"The {w} office of the company opened in {c} in {1900 + i}." for i, (w, c) in
                      enumerate(zip(["north", "south", "east", "west", "main", "old"] * 2, ["Paris", "Rome", "Oslo"] * 4)))
    heads = [" ".join(passage(s) for s in (31, 32)), " ".join(passage(s) for s in (33, 34))]
    stored = [f"{h} {shared}" for h in heads]
    index = DocumentIndex(tokenizer=tok)
    index.add("t", [IndexedText(t, tuple(tok(t, add_special_tokens=False)["input_ids"]), f"c{i}", f"d{i}")
                    for i, t in enumerate(stored)])
    message = f"Context:\n\n{heads[pasted]}\n\n{shared}\n\nQuestion: who?"  # the app cut it before the paragraph
    found = index.match("t", [message])
    assert len(found) == 2 and not any(m.whole for m in found), found
    assert [m.chunk for m in found] == [f"c{pasted}"] * 2
    head, run = found
    assert run.offset >= head.offset + len(head.token_ids)  # further on in the same stored text
    assert message[run.start : run.end] in shared
