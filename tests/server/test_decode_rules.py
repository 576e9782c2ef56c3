"""The server decodes by the engine's rules: the same text for a stop string held back
and then EOS, and a clear 500 when the model's logits are not finite.

The app is built in-process over a tiny engine; the answer is forced by a sampler that
follows a script, so that the served text and the engine's can be compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from kvblend.engine import Engine, Request
from kvblend.generation import SamplingParams
from kvblend.generation.sampling import Sampler
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded

QUESTION = "who is the doctor ?"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20,
        "temperature": 0, "stop": ["city of"]}


@pytest.fixture
def engine_and_client(tmp_path):
    engine = Engine(make_loaded())
    app = create_app(engine, Settings.load(model="tiny", state_dir=str(tmp_path)))
    with TestClient(app) as client:
        yield engine, client


def _script_sampler(monkeypatch, answer: list[int]) -> None:
    """Every request's sampler picks ``answer``'s tokens in order, whatever the logits."""

    def scripted(self: Sampler, logits: torch.Tensor) -> int:
        self.scripted_step = getattr(self, "scripted_step", -1) + 1
        return answer[self.scripted_step]

    monkeypatch.setattr(Sampler, "__call__", scripted)


def test_the_server_flushes_held_back_text_at_eos_as_the_engine_does(engine_and_client, monkeypatch) -> None:
    engine, client = engine_and_client
    tok = engine.tokenizer
    answer = tok("the red city", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    _script_sampler(monkeypatch, answer)
    expected = engine.generate(Request(messages=BODY["messages"], method="full"),
                               SamplingParams(max_tokens=20, stop=("city of",)))
    assert (expected.text, expected.finish_reason) == ("the red city", "stop")
    r = client.post("/v1/chat/completions", json={**BODY, "kvblend": {"method": "full"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == expected.text
    assert choice["finish_reason"] == "stop"


def test_non_finite_logits_are_a_500_that_says_so(engine_and_client, monkeypatch) -> None:
    engine, client = engine_and_client
    real = engine.prepare_steps

    def overflowed(request, extra_capacity=0, slice_tokens=None):
        prepared = yield from real(request, extra_capacity, slice_tokens)
        return prepared._replace(logits=torch.full_like(prepared.logits, float("nan")))  # (V,)

    monkeypatch.setattr(engine, "prepare_steps", overflowed)
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 500
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (500, "InternalServerError")
    assert "non-finite logits" in err["message"] and "token 1" in err["message"]
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json={**BODY, "max_tokens": 2}).status_code == 200  # serving on
