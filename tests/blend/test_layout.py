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
