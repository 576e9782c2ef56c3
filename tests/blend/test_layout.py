"""Prompt layout: documents tokenized alone, concatenated, spans known; never re-tokenized."""

from __future__ import annotations

import pytest

from kvblend.blend.layout import render_layout
from kvblend.errors import InvalidRequestError
from tests.conftest import make_tokenizer

DOCS = ["the city of paris is blue .", "doctor alpha works in lisbon ."]


def test_layout_concatenates_documents_verbatim() -> None:
    tok = make_tokenizer()
    lay = render_layout(tok, DOCS, question="which city ?", system="answer .")
    for doc, ids, start in zip(DOCS, lay.docs, lay.doc_starts):
        assert ids == tuple(tok(doc, add_special_tokens=False)["input_ids"])
        assert tuple(lay.ids[start : start + len(ids)]) == ids
    assert len(lay) == len(lay.ids) == len(lay.prefix) + sum(map(len, lay.docs)) + len(lay.suffix)


def test_documents_sit_at_the_start_of_the_user_turn() -> None:
    tok = make_tokenizer()
    lay = render_layout(tok, DOCS, question="which city ?", system="answer .")
    assert tok.decode(lay.prefix).endswith("<|im_start|>user\n") or tok.decode(lay.prefix).endswith("user")
    assert "which city ?" in tok.decode(lay.suffix) and tok.decode(lay.suffix).rstrip().endswith("assistant")


def test_layout_without_chat_template_uses_bos_and_plain_text() -> None:
    tok = make_tokenizer()
    lay = render_layout(tok, DOCS, question="which city ?", use_chat_template=False)
    assert lay.prefix == (tok.bos_token_id,)


def test_bad_layouts_are_rejected() -> None:
    tok = make_tokenizer()
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        render_layout(tok, [[10**9]], question="q")
    with pytest.raises(InvalidRequestError, match="user message"):
        render_layout(tok, DOCS, messages=[{"role": "assistant", "content": "hi"}])


# ----- documents placed inside messages, with text between them -----------------------------
def _encode(tok, text: str) -> tuple[int, ...]:
    return tuple(tok(text, add_special_tokens=False)["input_ids"])


def test_placed_documents_split_the_message_and_each_segment_is_tokenized_alone() -> None:
    from kvblend.blend.layout import DocPlace

    tok = make_tokenizer()
    head, mid, tail = "answer using the context :\n\ndocument one :\n", "\n\ndocument two :\n", "\n\nwhich city ?"
    content = head + DOCS[0] + mid + DOCS[1] + tail
    a = len(head)
    b = a + len(DOCS[0]) + len(mid)
    places = [DocPlace(1, a, a + len(DOCS[0])), DocPlace(1, b, b + len(DOCS[1]))]
    lay = render_layout(tok, DOCS, messages=[{"role": "user", "content": content}], system="answer .",
                        placement=places)
    rendered = tok.apply_chat_template([{"role": "system", "content": "answer ."}, {"role": "user", "content": content}],
                                       tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(content)
    assert lay.prefix == _encode(tok, before + head)
    assert lay.gaps == (_encode(tok, mid),)
    assert lay.suffix == _encode(tok, tail + after)
    assert lay.docs == tuple(_encode(tok, d) for d in DOCS)
    assert lay.ids == list(lay.prefix + lay.docs[0] + lay.gaps[0] + lay.docs[1] + lay.suffix)
    for ids, start in zip(lay.docs, lay.doc_starts):
        assert tuple(lay.ids[start : start + len(ids)]) == ids
    assert len(lay) == len(lay.ids) and lay.text_tokens == len(lay) - sum(map(len, lay.docs))


def test_documents_in_the_system_message_at_message_start_and_end() -> None:
    from kvblend.blend.layout import DocPlace

    tok = make_tokenizer()
    system, question = DOCS[0] + " answer .", "which city ? " + DOCS[1]
    places = [DocPlace(0, 0, len(DOCS[0])), DocPlace(1, len(question) - len(DOCS[1]), len(question))]
    lay = render_layout(tok, DOCS, question=question, system=system, placement=places)
    assert tok.decode(lay.prefix).rstrip().endswith("system")
    assert "answer ." in tok.decode(lay.gaps[0]) and "which city ?" in tok.decode(lay.gaps[0])
    assert tok.decode(lay.suffix).rstrip().endswith("assistant")
    plain = render_layout(tok, DOCS, question=question, system=system, placement=places, use_chat_template=False)
    assert plain.prefix == (tok.bos_token_id,)
    assert plain.gaps == (_encode(tok, " answer .") + _encode(tok, "which city ? "),)
    assert plain.suffix == ()


def test_a_document_may_replace_or_be_inserted() -> None:
    from kvblend.blend.layout import DocPlace

    tok = make_tokenizer()
    inserted = render_layout(tok, DOCS[:1], question="which city ?", placement=[DocPlace(0, 5, 5)])
    assert tok.decode(inserted.prefix).endswith("which") and "city ?" in tok.decode(inserted.suffix)


def test_bad_placements_are_rejected() -> None:
    from kvblend.blend.layout import DocPlace

    tok = make_tokenizer()
    q = "which city is blue ?"
    for places, match in [([DocPlace(0, 0, 3)], "one place per document"),
                          ([DocPlace(3, 0, 1), DocPlace(0, 0, 1)], "does not exist"),
                          ([DocPlace(0, 5, 2), DocPlace(0, 6, 7)], "outside"),
                          ([DocPlace(0, 0, 6), DocPlace(0, 5, 7)], "overlaps"),
                          ([DocPlace(0, 10, 12), DocPlace(0, 0, 2)], "overlaps")]:
        with pytest.raises(InvalidRequestError, match=match):
            render_layout(tok, DOCS, question=q, placement=places)


def test_a_template_that_drops_a_placeholder_is_refused() -> None:
    from kvblend.blend.layout import DocPlace

    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'][:3] }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="placeholders"):
        render_layout(tok, DOCS, question="which city is blue ?", placement=[DocPlace(0, 0, 2), DocPlace(0, 8, 9)])
