"""Request fields bounded as OpenAI bounds them, each refused with a 400 naming the field
(in-process app over a tiny engine)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "who is the doctor ?"}],
        "documents": ["the doctor works in paris ."], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings.load(model="tiny", state_dir=str(tmp_path_factory.mktemp("state")))
    with TestClient(create_app(Engine(make_loaded()), settings)) as c:
        yield c


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_a_seed_outside_signed_64_bits_is_a_400_naming_seed(client, seed) -> None:
    r = client.post("/v1/chat/completions", json={**BODY, "seed": seed})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_a_seed_within_signed_64_bits_is_served(client, seed) -> None:
    assert client.post("/v1/chat/completions", json={**BODY, "seed": seed, "temperature": 1}).status_code == 200


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1.5"])
def test_a_ratio_that_is_not_a_finite_number_in_0_1_says_so(client, value) -> None:
    body = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            f'"kvblend": {{"ratio": {value}}}}}')
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kvblend.ratio"
    assert "ratio must be a finite number in [0, 1]" in err["message"] and "less than" not in err["message"]


def test_ratio_auto_and_numbers_still_pass(client) -> None:
    for ratio in ("auto", 0, 1, 0.5):
        r = client.post("/v1/chat/completions", json={**BODY, "kvblend": {"ratio": ratio}})
        assert r.status_code == 200, (ratio, r.text)


def test_recompute_fraction_with_a_prefix_hit_and_a_tiny_document_stays_within_0_1(client) -> None:
    body = {**BODY, "messages": [{"role": "user", "content": "who is the doctor ? where does the doctor work ?"}],
            "kvblend": {"ratio": 1.0}}
    # stores the document and the prefix; another ratio, so that the prompt is blended again
    # (the same blend of the same prompt would be served whole, its document not looked up)
    client.post("/v1/chat/completions", json={**body, "kvblend": {"ratio": 0.5}})
    r = client.post("/v1/chat/completions", json=body).json()
    block, n = r["kvblend"], r["usage"]["prompt_tokens"]
    assert block["prefix_hit_tokens"] > 0 and block["doc_hits"] == {"memory": 1}
    # ratio 1 recomputes every document token: everything but the prefix hit was computed
    assert block["recompute_fraction"] == pytest.approx((n - block["prefix_hit_tokens"]) / n, abs=1e-6)


@pytest.mark.parametrize("top_k", ["true", "3.0", '"3"', "2.5", "0", "101", "null"])
def test_a_retrieval_top_k_that_is_not_an_integer_in_1_100_is_a_400_naming_it(client, top_k) -> None:
    """``"retrieval": {"top_k": true}`` (or "3", or 3.0) was read as an integer."""
    body = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            f'"retrieval": {{"top_k": {top_k}}}}}')
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "retrieval.top_k", r.text


def _with(body: dict, path: str, value) -> dict:
    """``body`` with the field at ``path`` ("kvblend.sinks") set to ``value``."""
    out = {**body}
    *outer, name = path.split(".")
    inner = out
    for part in outer:
        inner[part] = {**inner.get(part, {})}
        inner = inner[part]
    inner[name] = value
    return out


COMPLETION = {"model": "tiny", "prompt": "who is the doctor ?", "max_tokens": 2, "temperature": 0}
CHAT_INTS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "top_logprobs", "kvblend.sinks")


@pytest.mark.parametrize("value", [True, False, "5", 5.0, 5.5])
@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", f) for f in CHAT_INTS]
                         + [("/v1/completions", f) for f in ("max_tokens", "n", "seed", "best_of")])
def test_an_integer_field_sent_as_a_bool_string_or_float_is_a_400_naming_it(client, path, field, value) -> None:
    """Every integer of a request body is a JSON integer: ``"top_k": "5"``, ``true`` and
    ``5.0`` were read as 5, 1 and 5 (``"n": true`` passed as n=1), as ``"retrieval":
    {"top_k": ...}`` no longer was."""
    r = client.post(path, json=_with(BODY if path.endswith("chat/completions") else COMPLETION, field, value))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (field, 400, "BadRequestError"), err
    assert err["message"].startswith(f"{field}: ") and "integer" in err["message"], err


def test_the_lists_of_integers_and_the_other_types_are_read_as_sent(client) -> None:
    for bad, param in ((["1"], "kvblend.check_layers.0"), ([True], "kvblend.check_layers.0")):
        r = client.post("/v1/chat/completions", json={**BODY, "kvblend": {"check_layers": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for field, value in (("stream", "true"), ("temperature", "0.5"), ("temperature", True), ("logprobs", "1")):
        r = client.post("/v1/chat/completions", json={**BODY, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)


def test_json_integers_and_nulls_still_pass(client) -> None:
    """What OpenAI clients send: integers where integers go (a number field takes one
    too), null for an optional field, arrays for the list knobs."""
    body = {**BODY, "max_tokens": None, "max_completion_tokens": 2, "n": 1, "seed": 7, "top_k": -1,
            "top_logprobs": 0, "logprobs": False, "temperature": 1, "top_p": 1, "presence_penalty": 0,
            "kvblend": {"sinks": 4, "check_layers": [1], "ratio": 1}, "stream": False}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    completion = {**COMPLETION, "n": None, "best_of": 1, "seed": None, "top_k": 3, "logprobs": None}
    assert client.post("/v1/completions", json=completion).status_code == 200
    doc = client.post("/v1/documents", json={"text": "the doctor works in paris .",
                                              "metadata": {"n": 1, "on": True, "x": 0.5, "none": None}})
    assert doc.status_code == 200, doc.text
