"""Failures that a healthy server cannot be made to show from outside, on the app built
in-process by ``create_app`` over a tiny engine: an internal error is a bare 500 (cause
logged, never sent), an error after a stream started is sent in-band before [DONE], and
a request's own failure leaves the worker, /health and the next request unharmed."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

import kvblend.engine.scheduler as scheduler_module
from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "who is the doctor ?"}],
        "documents": ["the doctor works in paris ."], "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def app_client(tmp_path):
    settings = Settings.load(model="tiny", state_dir=str(tmp_path))
    app = create_app(Engine(make_loaded()), settings)
    with TestClient(app) as client:  # raises if an exception escapes the app
        yield client, app.state.kvblend


def test_an_internal_error_is_a_bare_500_and_is_logged(app_client, monkeypatch, caplog) -> None:
    client, state = app_client

    def broken(request):
        raise RuntimeError("secret detail /etc/passwd")

    monkeypatch.setattr(state.engine, "layout", broken)
    with caplog.at_level(logging.ERROR, logger="kvblend.server"):
        r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert any("RuntimeError" in rec.getMessage() or rec.exc_info for rec in caplog.records)
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json={**BODY, "max_tokens": 2}).status_code == 200


def test_an_error_after_the_stream_started_is_sent_in_band_then_done(app_client, monkeypatch) -> None:
    """A decode step that fails for this stream (issue #20: it used to kill the worker):
    the stream gets an in-band 500 and [DONE], the server stays healthy, the failure is
    counted by stage, and the next request is served."""
    client, state = app_client
    real, calls = scheduler_module.forward_batch, []

    def dies_on_the_fourth_step(model, members):  # the batch, then its member alone
        calls.append(1)
        if len(calls) in (4, 5):
            raise RuntimeError("the accelerator fell over")
        return real(model, members)

    monkeypatch.setattr(scheduler_module, "forward_batch", dies_on_the_fourth_step)
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == 500 and "fell over" not in error["message"]
    contents = [json.loads(line[6:])["choices"][0]["delta"].get("content") for line in lines[1:-2]]
    assert any(contents)  # tokens did stream before the failure
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json={**BODY, "max_tokens": 3}).status_code == 200
    metrics = client.get("/metrics").text
    assert 'kvblend:request_failures_total{model_name="tiny",stage="decode"} 1.0' in metrics


@pytest.mark.parametrize("temperature", [1e-37, 1e-36, 1e-38])
def test_a_tiny_temperature_then_a_normal_request(app_client, temperature) -> None:
    """Issue #20: temperature 1e-37 overflowed the logits, multinomial raised in the
    batched step, the worker died and /health stayed 503 until a restart."""
    client, _ = app_client
    r = client.post("/v1/chat/completions", json={**BODY, "temperature": temperature, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert client.post("/v1/chat/completions", json={**BODY, "max_tokens": 3}).status_code == 200
    assert client.get("/health").status_code == 200


def test_a_prefill_failure_in_the_worker_is_a_500_for_that_request_only(app_client, monkeypatch) -> None:
    client, state = app_client
    real = state.engine.prepare_steps

    def fails_once(request, extra_capacity=0, slice_tokens=None):
        monkeypatch.setattr(state.engine, "prepare_steps", real)
        raise RuntimeError("secret detail in prefill")
        yield  # a step generator, as the real one

    monkeypatch.setattr(state.engine, "prepare_steps", fails_once)
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "InternalServerError"
    assert client.get("/health").status_code == 200  # the worker lives on
    assert client.post("/v1/chat/completions", json={**BODY, "max_tokens": 2}).status_code == 200
    assert 'stage="prepare"} 1.0' in client.get("/metrics").text


def test_document_precompute_is_a_job_of_the_worker_and_a_full_lane_is_a_429(tmp_path) -> None:
    """Issue #20: POST /v1/documents ran its prefill on a thread of its own, unbounded; now it
    is a job of the model worker's jobs lane, and a full lane answers 429 with Retry-After."""
    import threading

    settings = Settings.load(model="tiny", state_dir=str(tmp_path), scheduler={"max_jobs": 1})
    app = create_app(Engine(make_loaded()), settings)
    release, where = threading.Event(), []

    def blocker():
        while not release.is_set():
            yield None

    with TestClient(app) as client:
        state = app.state.kvblend
        held = state.scheduler.submit_job(blocker(), "held")
        r = client.post("/v1/documents", json={"text": "the doctor works in paris ."})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "RateLimitError"
        release.set()
        held.result(timeout=10)
        real = state.engine.compute_steps

        def watched(*args, **kwargs):
            where.append(threading.current_thread().name)
            return (yield from real(*args, **kwargs))

        state.engine.compute_steps = watched
        r = client.post("/v1/documents", json={"text": "the doctor works in paris ."})
        assert r.status_code == 200, r.text
        assert where == ["kvblend-worker"]  # the generator ran on the worker, not a request thread
        metrics = client.get("/metrics").text
        assert 'kvblend:jobs_total{lane="jobs",model_name="tiny",outcome="dropped"} 1.0' in metrics
        assert 'kvblend:jobs_total{lane="jobs",model_name="tiny",outcome="ok"}' in metrics


# a template whose roles must alternate (Gemma 3's and Mistral's instruct templates do this)
ALTERNATING = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def test_a_conversation_the_chat_template_refuses_is_a_400_naming_messages(tmp_path) -> None:
    loaded = make_loaded()
    loaded.tokenizer.chat_template = ALTERNATING
    app = create_app(Engine(loaded), Settings.load(model="tiny", state_dir=str(tmp_path)))
    with TestClient(app, raise_server_exceptions=False) as client:
        refused = client.post("/v1/chat/completions", json={**BODY, "documents": None, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "assistant", "content": "the doctor"}]})
        assert refused.status_code == 400, refused.text
        err = refused.json()["error"]
        assert err["param"] == "messages" and "alternate" in err["message"]
        # the system turn alone: this template drops it, and the cut before it; served all the same
        alone = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 2, "documents": None,
                                                           "messages": [{"role": "system", "content": "hi"}]})
        assert alone.status_code == 200, alone.text


def test_stored_metadata_that_utf8_cannot_encode_is_still_listed(app_client) -> None:
    """A row written before metadata was checked may hold a lone surrogate: its reads are
    escaped JSON, not a 500."""
    client, state = app_client
    assert client.post("/v1/documents", json={"text": "the nurse works in rome .", "id": "d1"}).status_code == 200
    row = state.registry.get("default", "d1")
    state.registry.put("default", row._replace(metadata={"a": "\ud800"}))
    for path in ("/v1/documents", "/v1/documents/d1"):
        r = client.get(path)
        assert r.status_code == 200 and "\\ud800" in r.text, r.text
