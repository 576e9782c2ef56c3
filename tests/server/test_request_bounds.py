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
    client.post("/v1/chat/completions", json=body)  # stores the document and the prefix
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
