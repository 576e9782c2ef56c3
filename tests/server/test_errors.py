"""Every bad input gets its status and a named problem in the OpenAI error shape, and the
server keeps serving after each one."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import ALICE

GOOD_Q = [{"role": "user", "content": "who is the doctor ?"}]


def chat(model: str, **fields) -> dict:
    return {"model": model, "messages": GOOD_Q, "max_tokens": 4, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def model_id(server):
    return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {ALICE}"}).json()["data"][0]["id"]


# (case name, body builder taking the model id, expected status, expected param)
CASES = [
    ("missing messages", lambda m: {"model": m}, 400, "messages"),
    ("wrong type", lambda m: chat(m, temperature="hot"), 400, "temperature"),
    ("out of range", lambda m: chat(m, top_p=1.5), 400, "top_p"),
    ("bad message role", lambda m: chat(m, messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    ("image content part", lambda m: chat(m, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content"),
    ("unknown model", lambda m: chat("gpt-9"), 404, "model"),
    ("n over the limit", lambda m: chat(m, n=17), 400, "n"),
    ("top_logprobs over 20", lambda m: chat(m, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs without logprobs", lambda m: chat(m, top_logprobs=2), 400, "top_logprobs"),
    ("a chat's logprobs as a count", lambda m: chat(m, logprobs=3), 400, "logprobs"),
    ("logit_bias key outside the vocabulary", lambda m: chat(m, logit_bias={"99999999": 1}), 400,
     "logit_bias.99999999"),
    ("logit_bias key not a token id", lambda m: chat(m, logit_bias={"the": 1}), 400, "logit_bias.the"),
    ("logit_bias value past 100", lambda m: chat(m, logit_bias={"5": 150}), 400, "logit_bias.5"),
    ("presence_penalty past 2", lambda m: chat(m, presence_penalty=-2.5), 400, "presence_penalty"),
    ("repetition_penalty 0", lambda m: chat(m, repetition_penalty=0), 400, "repetition_penalty"),
    ("tools", lambda m: chat(m, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("response_format of an unknown type", lambda m: chat(m, response_format={"type": "xml"}), 400,
     "response_format"),
    # the tiny word-level vocabulary has no "{": the format cannot be followed, said at the first token
    ("response_format the vocabulary cannot spell", lambda m: chat(m, response_format={"type": "json_object"}), 400,
     "response_format"),
    ("frequency_penalty past 2", lambda m: chat(m, frequency_penalty=3), 400, "frequency_penalty"),
    ("bad kvblend method", lambda m: chat(m, kvblend={"method": "magic"}), 400, "kvblend.method"),
    ("unknown kvblend option", lambda m: chat(m, kvblend={"ratoi": 0.1}), 400, "kvblend.ratoi"),
    ("check layer past the model", lambda m: chat(m, kvblend={"check_layers": [5]}), 400, "kvblend.check_layers"),
    ("increasing schedule", lambda m: chat(m, kvblend={"check_layers": [1], "schedule": [0.1, 0.5]}), 400,
     "kvblend.schedule"),
    ("check layer 0", lambda m: chat(m, kvblend={"check_layers": [0]}), 400, "kvblend.check_layers"),
    ("schedule past 1", lambda m: chat(m, kvblend={"check_layers": [1], "schedule": [1.5]}), 400, "kvblend.schedule"),
    ("oracle selection is eval-only", lambda m: chat(m, kvblend={"selection": "oracle"}), 400, "kvblend.selection"),
    ("too many sinks", lambda m: chat(m, kvblend={"sinks": 10_000}), 400, "kvblend.sinks"),
    ("check layers with question selection", lambda m: chat(m, kvblend={"selection": "question", "check_layers": [1]}),
     400, "kvblend.check_layers"),
    ("signal with question selection", lambda m: chat(m, kvblend={"selection": "question", "signal": "k"}), 400,
     "kvblend.signal"),
    ("ratio neither number nor auto", lambda m: chat(m, kvblend={"ratio": "most"}), 400, "kvblend.ratio"),
    ("too many documents", lambda m: chat(m, documents=["one"] * 5), 400, "documents"),
    ("document too large", lambda m: chat(m, documents=["ok", "x " * 2500]), 413, "documents.1"),
    ("document too many tokens", lambda m: chat(m, documents=["one " * 1000]), 413, "documents.0"),
    ("document without text or id", lambda m: chat(m, documents=[{"title": "t"}]), 400, "documents.0"),
    ("unknown stored document", lambda m: chat(m, documents=[{"id": "nope"}]), 404, "documents.0.id"),
    ("prompt over the context", lambda m: chat(m, messages=[{"role": "user", "content": "one " * 2100}]), 400,
     "input_tokens"),
    ("max_tokens over the cap", lambda m: chat(m, max_tokens=5000), 400, "max_tokens"),
    ("max_tokens over the context", lambda m: chat(m, messages=[{"role": "user", "content": "one " * 1500}],
                                                    max_tokens=1000), 400, "max_tokens"),
    ("too many stop strings", lambda m: chat(m, stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("completions: echo", lambda m: {"model": m, "prompt": "x", "echo": True}, 400, "echo"),
    ("completions: logprobs over 20", lambda m: {"model": m, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions: top_logprobs (a chat's)", lambda m: {"model": m, "prompt": "x", "top_logprobs": 2}, 400,
     "top_logprobs"),
    # vLLM's extensions change the answer: refused by name, never dropped (their defaults pass, below)
    ("min_p", lambda m: chat(m, min_p=0.9), 400, "min_p"),
    ("min_tokens", lambda m: chat(m, min_tokens=5), 400, "min_tokens"),
    ("stop_token_ids", lambda m: chat(m, stop_token_ids=[5]), 400, "stop_token_ids"),
    ("use_beam_search", lambda m: chat(m, use_beam_search=True), 400, "use_beam_search"),
    ("structured_outputs", lambda m: chat(m, structured_outputs={"choice": ["a"]}), 400, "structured_outputs"),
    ("chat echo", lambda m: chat(m, echo=True), 400, "echo"),
    ("add_generation_prompt false", lambda m: chat(m, add_generation_prompt=False), 400, "add_generation_prompt"),
    ("continue_final_message", lambda m: chat(m, continue_final_message=True), 400, "continue_final_message"),
    ("stream_options without stream", lambda m: chat(m, stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("chat add_special_tokens", lambda m: chat(m, add_special_tokens=True), 400, "add_special_tokens"),
    ("completions: add_special_tokens false", lambda m: {"model": m, "prompt": "x", "add_special_tokens": False},
     400, "add_special_tokens"),
    ("completions: several prompts", lambda m: {"model": m, "prompt": ["a", "b"]}, 400, "prompt"),
]


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(alice: httpx.Client, model: str) -> None:
    r = alice.post("/v1/chat/completions", json=chat(model, max_tokens=1))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name,build,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_named_and_the_server_keeps_serving(alice, model_id, name, build, status, param) -> None:
    path = "/v1/completions" if name.startswith("completions") else "/v1/chat/completions"
    assert_error(alice.post(path, json=build(model_id)), status, param)
    assert_still_serving(alice, model_id)


@pytest.mark.parametrize("content,param", [
    (b'{"model": "x", "messages": [', "body"),
    (b'{"model": "\xff\xfe"}', "body"),
    (b"[1, 2, 3]", "body"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udc80"}]}', "messages.0.content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"1" * 5000 + b"}", "body"),
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
], ids=["malformed JSON", "invalid UTF-8", "not an object", "lone surrogate", "integer of 5000 digits",
        "lone surrogate in the model's name"])
def test_malformed_bodies(alice, model_id, content, param) -> None:
    content = content.replace(b'"m"', f'"{model_id}"'.encode())
    r = alice.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert_error(r, 404 if param == "model" else 400, param)  # an unknown model quoted back, not a 500
    assert_still_serving(alice, model_id)


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "stop_token_ids": [], "bad_words": [],
     "use_beam_search": False, "echo": False, "add_generation_prompt": True, "continue_final_message": False,
     "skip_special_tokens": True, "include_stop_str_in_output": False, "add_special_tokens": False},
    {"stream_options": {"include_usage": True}, "stream": True},
], ids=["vLLM defaults sent explicitly", "stream_options with stream"])
def test_neutral_values_of_refused_options_are_served(alice, model_id, fields) -> None:
    r = alice.post("/v1/chat/completions", json=chat(model_id, **fields))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "who is the doctor ?"}],
    [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "the doctor"}],
], ids=["system only", "system and assistant"])
def test_a_chat_without_a_user_turn_and_without_documents_is_served(alice, model_id, messages) -> None:
    r = alice.post("/v1/chat/completions", json=chat(model_id, messages=messages))
    assert r.status_code == 200, r.text
    docs = alice.post("/v1/chat/completions", json=chat(model_id, messages=messages, documents=["the doctor"]))
    assert_error(docs, 400, None)  # documents still need a user turn to stand in


def test_body_over_the_limit_is_refused_before_reading(alice, model_id) -> None:
    big = b'{"pad": "' + b"x" * 70000 + b'"}'
    assert_error(alice.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"}),
                 413, "body")

    def chunks():  # no Content-Length: bounded while reading
        yield b'{"pad": "'
        for _ in range(20):
            yield b"x" * 5000
        yield b'"}'

    assert_error(alice.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}),
                 413, "body")
    assert_still_serving(alice, model_id)


def test_unknown_route_and_method_are_openai_shaped(alice) -> None:
    assert_error(alice.get("/v1/nothing-here"), 404, None)
    r = alice.get("/v1/chat/completions")
    assert assert_error(r, 405, None)["type"] == "MethodNotAllowedError"
    assert r.headers["allow"] == "POST"


def test_keys_are_required_on_every_v1_path(server) -> None:
    for path in ("/v1/models", "/v1/chat/completions", "/v1/documents", "/v1/nothing-here"):
        for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": f"Basic {ALICE}"}):
            r = httpx.post(server.url + path, json={}, headers=headers) if "chat" in path else \
                httpx.get(server.url + path, headers=headers)
            err = assert_error(r, 401, None)
            assert err["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/health").status_code == 200
