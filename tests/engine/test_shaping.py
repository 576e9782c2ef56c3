"""Request shaping: documents expanded and cut, stored texts found in messages, passages
discovered, the layout rendered once and carried to the engine; on the tiny model."""

from __future__ import annotations

import dataclasses

import pytest

from kvblend.engine import Engine
from kvblend.engine import engine as engine_module
from kvblend.engine.discovery import Passage, Sightings, discover, paragraphs
from kvblend.engine.matching import DocumentIndex, IndexedText, Match
from kvblend.engine.shaping import (
    DocRef, DocumentTooLargeError, Draft, ShapeConfig, UnknownDocumentError, shape,
)
from kvblend.errors import ContextLengthError
from tests.conftest import make_loaded

DOCS = [
    "the city of paris is blue . the river was red and the project led to rome .",
    "doctor alpha works in lisbon . the company headquartered in oslo was green .",
    "the novel published in year one was about madrid and the north river .",
]
LONG = " ".join(DOCS * 2)


@pytest.fixture
def engine() -> Engine:
    return Engine(make_loaded())


def ids(engine: Engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def stored(engine: Engine, tenant: str = "default", *texts: str) -> DocumentIndex:
    index = DocumentIndex()
    index.add(tenant, [IndexedText(t, ids(engine, t), f"c{i}", f"d{i}") for i, t in enumerate(texts or DOCS)])
    return index


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ----- documents given ----------------------------------------------------------------------
def windows(engine: Engine, size: int):
    """The documents API's cut: the rag chunker's windows of ``size`` tokens."""
    from kvblend.rag.chunking import ChunkerConfig, chunk_text

    return lambda text: chunk_text(engine.tokenizer, text, ChunkerConfig(size=size), engine.loaded.tokenizer_fingerprint)


def test_long_texts_are_cut_into_chunks_that_concatenate_to_the_text(engine: Engine) -> None:
    shaped = shape(engine, Draft(documents=[LONG, DOCS[0]], question="which city ?"), cut=windows(engine, 8))
    assert all(len(d) <= 8 for d in shaped.layout.docs) and len(shaped.layout.docs) > 2
    assert sum(shaped.layout.docs, ()) == ids(engine, LONG) + ids(engine, DOCS[0])
    whole = shape(engine, Draft(documents=[LONG, DOCS[0]], question="which city ?"))
    assert shaped.layout.ids == whole.layout.ids  # cutting never changes the prompt's tokens


def test_stored_ids_expand_and_unknown_ids_name_their_index(engine: Engine) -> None:
    chunks = {"a": [ids(engine, DOCS[0]), ids(engine, DOCS[1])]}
    shaped = shape(engine, Draft(documents=[DocRef("a"), DOCS[2]], question="q ?"), lookup=chunks.get)
    assert shaped.layout.docs == (ids(engine, DOCS[0]), ids(engine, DOCS[1]), ids(engine, DOCS[2]))
    with pytest.raises(UnknownDocumentError) as err:
        shape(engine, Draft(documents=[DOCS[0], DocRef("b")], question="q ?"), lookup=chunks.get)
    assert err.value.index == 1 and err.value.doc_id == "b"


def test_document_and_context_limits(engine: Engine) -> None:
    with pytest.raises(DocumentTooLargeError) as err:
        shape(engine, Draft(documents=[DOCS[0], LONG], question="q ?"), ShapeConfig(max_document_tokens=20))
    assert err.value.index == 1
    with pytest.raises(ContextLengthError, match="maximum context length is 256"):
        shape(engine, Draft(documents=[LONG] * 4, question="q ?"))


def test_inline_documents_are_indexed_and_found_later_in_plain_prompts(engine: Engine) -> None:
    index = DocumentIndex()
    shape(engine, Draft(documents=DOCS[:2], question="which city ?"), index=index)
    later = shape(engine, Draft(messages=user(f"context : {DOCS[1]} so which city ?")), index=index)
    assert [(m.chunk, m.document) for m in later.matches] == [(later.matches[0].chunk, None)]
    assert later.layout.docs == (ids(engine, DOCS[1]),)


# ----- documents found in the text ----------------------------------------------------------
def test_matched_spans_become_documents_where_they_stand(engine: Engine) -> None:
    text = f"context : {DOCS[0]} and {DOCS[2]} so which city is blue ?"
    shaped = shape(engine, Draft(messages=user(text), system="answer ."), index=stored(engine))
    assert [(m.message, text[m.start : m.end], m.document) for m in shaped.matches] == [
        (1, DOCS[0], "d0"), (1, DOCS[2], "d2")]
    assert shaped.request.placement is not None and len(shaped.request.documents) == 2
    assert shaped.layout.gaps == (ids(engine, " and "),)


def test_the_layout_is_rendered_once_and_the_engine_reuses_it(engine: Engine, monkeypatch) -> None:
    shaped = shape(engine, Draft(messages=user(f"{DOCS[0]} which city ?")), index=stored(engine))

    def refuse(*_a, **_k):
        raise AssertionError("the engine rendered the layout again")

    monkeypatch.setattr(engine_module, "render_layout", refuse)
    prepared = engine.prepare(shaped.request)
    assert prepared.layout is shaped.layout and prepared.stats.prompt_tokens == shaped.prompt_tokens


def test_matching_turned_off_by_the_request_or_the_setting(engine: Engine) -> None:
    index, msgs = stored(engine), user(f"{DOCS[0]} which city ?")
    assert shape(engine, Draft(messages=msgs), index=index).matches
    assert not shape(engine, Draft(messages=msgs, match=False), index=index).matches
    off = shape(engine, Draft(messages=msgs), ShapeConfig(match=False), index=index)
    assert not off.matches and off.request.placement is None


def test_another_tenants_texts_are_never_found(engine: Engine) -> None:
    index = stored(engine, "alice")
    assert not shape(engine, Draft(messages=user(DOCS[0]), tenant="bob"), index=index).matches
    assert shape(engine, Draft(messages=user(DOCS[0]), tenant="alice"), index=index).matches


def test_matched_documents_hit_the_store_after_a_first_miss(engine: Engine) -> None:
    index, msgs = stored(engine), user(f"context : {DOCS[0]} {DOCS[1]} which city ?")
    first = engine.prepare(shape(engine, Draft(messages=msgs), index=index).request)
    assert [d.source for d in first.stats.docs] == ["chunk", "chunk"]
    engine.flush()
    again = engine.prepare(shape(engine, Draft(messages=user(f"{DOCS[1]} or {DOCS[0]} ?")), index=index).request)
    assert [d.source for d in again.stats.docs] == ["memory", "memory"]


# ----- discovery ----------------------------------------------------------------------------
def test_paragraphs_split_at_blank_lines_and_headings() -> None:
    text = "  intro line\nsame paragraph\n\n\n## heading\nbody one\n# other\n\n  last  "
    parts = [text[a:b] for a, b in paragraphs(text)]
    assert parts == ["intro line\nsame paragraph", "## heading\nbody one", "# other", "last"]


def test_discovery_finds_long_passages_but_those_matched_spans_mostly_cover(engine: Engine) -> None:
    msgs = [{"role": "system", "content": "answer ."}, {"role": "user", "content": f"q ?\n\n{DOCS[0]}\n\n{DOCS[1]}"},
            {"role": "assistant", "content": DOCS[2]}]
    found = discover(engine.tokenizer, msgs, 10)
    assert [(p.message, msgs[1]["content"][p.start : p.end]) for p in found] == [(1, DOCS[0]), (1, DOCS[1])]
    start, n = msgs[1]["content"].index(DOCS[0]), len(DOCS[0])
    most, little = (1, start, start + (3 * n) // 4), (1, start, start + n // 4)
    assert [msgs[1]["content"][p.start : p.end] for p in discover(engine.tokenizer, msgs, 10, [most])] == [DOCS[1]]
    assert len(discover(engine.tokenizer, msgs, 10, [little])) == 2  # a short run leaves it a passage
    assert discover(engine.tokenizer, msgs, 100) == []


def test_an_admitted_passage_replaces_the_short_stored_run_inside_it(engine: Engine) -> None:
    """A passage holding a short run of stored text is discovered whole on its second
    sighting (the run alone would reuse little, and the passage never be stored)."""
    config, seen = ShapeConfig(discover=True, discover_tokens=10), Sightings(after=2)
    run, filler = DOCS[0], " ".join(reversed(LONG.split()))
    content = f"context :\n\n{run} {filler}\n\nwhich city ?"
    stored_ids = ids(engine, f"{DOCS[1]} {run}")  # a stored chunk whose second half is the run

    class RunIndex(DocumentIndex):  # the run found where it stands (matching has its own tests)
        def match(self, tenant: str, messages: list[str]) -> list[Match]:
            indexed = super().match(tenant, messages)  # what discovery indexed wins
            if indexed:
                return indexed
            at = messages[-1].find(run)
            n = len(ids(engine, run))
            return [Match(len(messages) - 1, at, at + len(run), stored_ids[-n:], "c0", "d0", stored_ids,
                          len(stored_ids) - n)] if at >= 0 else []

    index, ask = RunIndex(), Draft(messages=user(content))
    first = shape(engine, ask, config, index=index, sightings=seen)
    assert [m.source for m in first.matches] == ["stored"]  # first sighting: the run only
    engine.warm([stored_ids], engine.sink_prefix)
    done = engine.prepare(first.request)  # the run is little of the prompt: an exact prefill, cached
    assert done.stats.fallback == "little-reuse"
    # repeats of that prompt are rendered as it was then (the run a document, the passage
    # text), served from the cache; the passage left as text is not indexed either
    for _ in range(2):
        again = shape(engine, ask, config, index=index, sightings=seen)
        assert [(m.source, m.chunk) for m in again.matches] == [("stored", "c0")]
        assert engine.prepare(again.request).stats.prefix_hit_tokens == len(done.layout) - 1
    # elsewhere, the admitted passage is a document, in place of the run inside it
    other = shape(engine, Draft(messages=user(f"the novel :\n\n{run} {filler}\n\nwhich river ?")), config, index=index,
                  sightings=seen)
    assert [(m.source, m.chunk.startswith("passage-")) for m in other.matches] == [("discovered", True)]


def test_a_discovered_passage_misses_once_then_hits_wherever_it_appears(engine: Engine) -> None:
    config, index = ShapeConfig(discover=True, discover_tokens=10), DocumentIndex()
    first = shape(engine, Draft(messages=user(f"context :\n\n{DOCS[0]}\n\nwhich city ?")), config, index=index)
    assert [m.source for m in first.matches] == ["discovered"]
    assert [d.source for d in engine.prepare(first.request).stats.docs] == ["chunk"]
    engine.flush()
    later = shape(engine, Draft(messages=user(f"see {DOCS[0]} then which river ?")), config, index=index)
    assert [m.source for m in later.matches] == ["stored"]  # indexed when discovered: found inside a paragraph
    assert [d.source for d in engine.prepare(later.request).stats.docs] == ["memory"]
    off = shape(engine, Draft(messages=user(f"context :\n\n{DOCS[1]}\n\nq ?")), ShapeConfig(discover=False), index=index)
    assert off.matches == ()


def test_discovery_admits_a_passage_only_from_its_second_sighting_per_tenant(engine: Engine) -> None:
    """Admission: text pasted once is never a document (never stored); the second time the
    same tenant sends it, it is; another tenant's count is its own."""
    config, index, seen = ShapeConfig(discover=True, discover_tokens=10), DocumentIndex(), Sightings(after=2)
    ask = Draft(messages=user(f"context :\n\n{DOCS[2]}\n\nwhich city ?"))
    assert shape(engine, ask, config, index=index, sightings=seen).matches == ()
    assert shape(engine, dataclasses.replace(ask, tenant="globex"), config, index=index, sightings=seen).matches == ()
    assert [m.source for m in shape(engine, ask, config, index=index, sightings=seen).matches] == ["discovered"]
    assert index.match("default", [f"see {DOCS[2]}"])  # indexed once admitted: found wherever it stands
    assert index.match("globex", [f"see {DOCS[2]}"]) == []  # globex sent it once: neither a document nor indexed


def test_sightings_forget_the_least_recently_seen_first() -> None:
    seen = Sightings(after=2, max_tracked=2)
    a, b, c = (Passage(0, 0, 1, (i,) * 12) for i in range(3))
    assert not seen.admit("t", a) and not seen.admit("t", b) and not seen.admit("t", c)
    assert len(seen) == 2
    assert not seen.admit("t", a)  # forgotten: counted from one again
    assert seen.admit("t", c)
    with pytest.raises(ValueError):
        Sightings(after=0)
