"""/metrics, client disconnects and overload, on the shared tiny-model server
(max_running 2, max_queued 2)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import ADMIN


@pytest.fixture
def model_id(alice):
    return alice.get("/v1/models").json()["data"][0]["id"]


def scrape(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + ("{" + labels + "}" if labels else "")] = s.value
    return out


def long_body(model_id: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_metrics_need_the_admin_key_and_parse(server, alice, model_id) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer key-alice-0001"}).status_code == 401
    before = scrape(server)
    docs = ["the red city is oslo .", "the blue river is in rome ."]
    for doc in docs:  # stored synchronously: both requests below hit both documents
        assert alice.post("/v1/documents", json={"text": doc}).status_code == 200
    for question in ("which city ?", "which river ?"):  # two prompts: each blended (a repeat is served whole)
        r = alice.post("/v1/chat/completions", json={"model": model_id, "documents": docs, "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "messages": [{"role": "user", "content": question}]})
        assert r.status_code == 200
    bad = alice.post("/v1/chat/completions", json={"model": model_id, "messages": [], "n": 3})
    assert bad.status_code == 400
    after = scrape(server)
    assert after["kvblend:prompt_tokens_total"] - before.get("kvblend:prompt_tokens_total", 0) >= 2 * 14
    assert after["kvblend:generation_tokens_total"] - before.get("kvblend:generation_tokens_total", 0) == 6
    assert after["kvblend:time_to_first_token_seconds_count"] - before["kvblend:time_to_first_token_seconds_count"] == 2
    assert after["kvblend:e2e_request_latency_seconds_count"] > before["kvblend:e2e_request_latency_seconds_count"]
    assert after["kvblend:inter_token_latency_seconds_count"] - before["kvblend:inter_token_latency_seconds_count"] \
        == 4
    assert after["kvblend:recompute_fraction_count"] > before.get("kvblend:recompute_fraction_count", 0)
    for name in ("selection_score_mean", "selection_score_max", "selection_kept_fraction"):  # check layer 1
        key = f"kvblend:{name}_count{{layer=1}}"
        assert after[key] - before.get(key, 0) == 2
    assert after["kvblend:request_decode_time_seconds_count"] - before["kvblend:request_decode_time_seconds_count"] == 2
    assert after["kvblend:request_queue_time_seconds_count"] > before["kvblend:request_queue_time_seconds_count"]
    hits = "kvblend:document_lookups_total{outcome=hit,tier=memory}"
    assert after[hits] - before.get(hits, 0) >= 4  # each request hit both documents
    assert after["kvblend:store_entries{tier=memory}"] >= 2 and after["kvblend:store_bytes{tier=memory}"] > 0
    errors = "kvblend:request_errors_total{type=BadRequestError}"
    assert after[errors] - before.get(errors, 0) == 1
    assert after["kvblend:num_requests_running"] == 0 and after["kvblend:num_requests_waiting"] == 0
    for name in after:  # labels are bounded enums: never tenant names, ids or text
        assert "alice" not in name and "oslo" not in name


def test_disconnect_mid_stream_frees_the_slot(server, model_id) -> None:
    before = scrape(server)
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-alice-0001"}, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=long_body(model_id, 1900, stream=True)) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks: the request is decoding
            assert any("content" in line for line in got)
            assert scrape(server)["kvblend:num_requests_running"] == 1
    # the client closed the connection: the slot is freed long before 1900 tokens
    assert wait_for(lambda: scrape(server)["kvblend:num_requests_running"] == 0)
    after = scrape(server)
    assert after["kvblend:client_disconnects_total"] - before.get("kvblend:client_disconnects_total", 0) == 1
    assert after["kvblend:generation_tokens_total"] - before["kvblend:generation_tokens_total"] < 1900


def test_disconnect_of_a_non_streaming_request_frees_the_slot(server, model_id) -> None:
    before = scrape(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=long_body(model_id, 1900),
                   headers={"Authorization": "Bearer key-alice-0001"}, timeout=0.5)
    assert wait_for(lambda: scrape(server)["kvblend:num_requests_running"] == 0)
    after = scrape(server)
    assert after["kvblend:client_disconnects_total"] - before.get("kvblend:client_disconnects_total", 0) == 1


def test_a_bounded_flood_gets_429s_and_no_hang(server, alice, model_id) -> None:
    def one(_: int) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", json=long_body(model_id, 40),
                          headers={"Authorization": "Bearer key-bob-00001"}, timeout=60)

    started = time.monotonic()
    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    assert time.monotonic() - started < 60
    codes = sorted(r.status_code for r in results)
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2, codes
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == 429
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    assert wait_for(lambda: scrape(server)["kvblend:num_requests_running"] == 0)
    assert alice.post("/v1/chat/completions", json=long_body(model_id, 2)).status_code == 200
