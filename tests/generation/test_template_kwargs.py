"""A client's extra chat-template variables (vLLM's ``chat_template_kwargs``, e.g. Qwen3's
``enable_thinking``): they reach the template, leave the cached documents as they are,
and anything that is not a plain variable is refused by name."""

from __future__ import annotations

import pytest

from kvblend.blend.layout import render_layout
from kvblend.errors import InvalidRequestError
from kvblend.generation.stream import RESERVED_TEMPLATE_KWARGS, chat_text, validate_template_kwargs
from tests.conftest import CHATML, make_tokenizer

THINKING = CHATML + "{% if enable_thinking is defined and not enable_thinking %}one two three{% endif %}"
MESSAGES = [{"role": "user", "content": "who is the doctor ?"}]
DOCS = ["the doctor works in paris ."]


@pytest.fixture
def tok():
    t = make_tokenizer()
    t.chat_template = THINKING
    return t


def test_a_variable_the_template_reads_changes_the_prompt_after_the_documents(tok) -> None:
    plain = render_layout(tok, DOCS, messages=MESSAGES)
    off = render_layout(tok, DOCS, messages=MESSAGES, template_kwargs={"enable_thinking": False})
    on = render_layout(tok, DOCS, messages=MESSAGES, template_kwargs={"enable_thinking": True})
    words = tuple(tok.convert_tokens_to_ids(["one", "two", "three"]))
    assert off.suffix == plain.suffix + words
    assert on.ids == plain.ids
    assert off.docs == plain.docs and off.prefix == plain.prefix  # the documents' cached KV still applies


def test_a_variable_the_template_does_not_read_changes_nothing(tok) -> None:
    assert render_layout(tok, DOCS, messages=MESSAGES, template_kwargs={"reasoning_effort": "low"}).ids == \
        render_layout(tok, DOCS, messages=MESSAGES).ids


@pytest.mark.parametrize("kwargs, says", [
    ({"tokenize": True}, "'tokenize'"),
    ({"add_generation_prompt": False}, "'add_generation_prompt'"),
    ({"messages": []}, "'messages'"),
    ({"chat_template": "{{ 1 }}"}, "'chat_template'"),
    ({"not a name": 1}, "template variable name"),
    ({"x" * 65: 1}, "template variable name"),
    ({f"v{i}": i for i in range(33)}, "at most 32"),
    ({"big": "a" * 20000}, "bytes as JSON"),
    ({"x": float("nan")}, "JSON values"),
    ({"x": "\ud800"}, "JSON values"),
    (["enable_thinking"], "must be an object"),
])
def test_anything_but_plain_variables_is_refused_by_field(kwargs, says) -> None:
    with pytest.raises(InvalidRequestError, match=says) as err:
        validate_template_kwargs(kwargs)
    assert err.value.field == "chat_template_kwargs"


def test_the_request_keeps_its_own_copy() -> None:
    given = {"nested": {"a": [1, 2]}}
    kept = validate_template_kwargs(given)
    given["nested"]["a"].append(3)
    assert kept == {"nested": {"a": [1, 2]}}


def test_a_template_that_fails_on_a_variable_names_the_variables_not_the_messages(tok) -> None:
    tok.chat_template = CHATML + "{{ budget + 1 }}"
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs") as err:
        chat_text(tok, MESSAGES, {"budget": "many"})
    assert err.value.field == "chat_template_kwargs"
    tok.chat_template = CHATML + "{% if messages | length > 1 %}{{ raise_exception('one turn only') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="one turn only") as err:
        chat_text(tok, MESSAGES * 2, {"budget": 1})
    assert err.value.field == "messages"


def test_a_deep_nest_is_refused_before_it_is_copied() -> None:
    """A 1.4 KB body nested 600 deep overflowed the copy's stack: a 500 and a long traceback."""
    deep: object = 1
    for _ in range(600):
        deep = [deep]
    with pytest.raises(InvalidRequestError, match="nest deeper than 16") as err:
        validate_template_kwargs({"x": deep})
    assert err.value.field == "chat_template_kwargs"
    ok: object = 1
    for _ in range(15):
        ok = {"a": ok}
    assert validate_template_kwargs({"x": ok})


def test_an_argument_of_apply_chat_template_is_not_a_template_variable(tok) -> None:
    """Names come from the tokenizer's own signature, whatever transformers adds next."""
    import inspect

    own = [p for p in inspect.signature(tok.apply_chat_template).parameters
           if p not in ("conversation", "tokenize", "add_generation_prompt", "self", "kwargs")]
    name = next(p for p in own if p not in RESERVED_TEMPLATE_KWARGS)  # one the fixed list does not name
    with pytest.raises(InvalidRequestError, match=repr(name)) as err:
        chat_text(tok, MESSAGES, {name: 1})
    assert err.value.field == "chat_template_kwargs"
