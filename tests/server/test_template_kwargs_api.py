"""``chat_template_kwargs`` through the API, as vLLM takes it (a Qwen3 client sends
``{"enable_thinking": false}``): the variables reach the template, the documents stay
documents (their chunk KV serves both), and what cannot be a template variable is a 400 naming it."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import CHATML, make_loaded

THINKING = CHATML + "{% if enable_thinking is defined and not enable_thinking %}one two three{% endif %}"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "who is the doctor ?"}],
        "documents": ["the doctor works in paris ."], "max_tokens": 2, "temperature": 0}


@pytest.fixture
def client(tmp_path):
    loaded = make_loaded()
    loaded.tokenizer.chat_template = THINKING
    app = create_app(Engine(loaded), Settings.load(model="tiny", state_dir=str(tmp_path)))
    with TestClient(app) as c:
        yield c


def test_a_template_variable_reaches_the_template_and_the_documents_are_still_reused(client) -> None:
    plain = client.post("/v1/chat/completions", json=BODY)
    off = client.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": {"enable_thinking": False}})
    assert plain.status_code == off.status_code == 200, off.text
    assert off.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + 3
    # the document is still one document of the same tokens: its chunk KV serves both
    assert [d["tokens"] for d in off.json()["kvblend"]["documents"]] == \
        [d["tokens"] for d in plain.json()["kvblend"]["documents"]] == [6]
    for neutral in ({}, None, {"reasoning_effort": "low"}):  # a variable this template does not read
        r = client.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": neutral})
        assert r.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"], neutral


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False}, ["x"], {"1x": 1}])
def test_what_cannot_be_a_template_variable_is_a_400_naming_the_field(client, kwargs) -> None:
    r = client.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": kwargs})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_value_the_template_cannot_use_is_a_400_naming_the_field(client) -> None:
    client.app.state.kvblend.engine.tokenizer.chat_template = CHATML + "{{ budget + 1 }}"
    r = client.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": {"budget": "many"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_completion_renders_no_template_so_its_variables_are_refused(client) -> None:
    body = {"model": "tiny", "prompt": "who is the doctor ?", "max_tokens": 2}
    r = client.post("/v1/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert client.post("/v1/completions", json={**body, "chat_template_kwargs": {}}).status_code == 200
