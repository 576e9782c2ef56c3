"""``kvblend:kv_cache_usage_perc`` (share of the store's memory-tier byte cap in use) and
``kvblend:num_background_jobs`` (the model worker's low-priority lane), on the app built
in-process over a tiny engine; and the guard's shadow checks running in that lane."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.server.metrics import kv_cache_usage
from kvblend.settings import Settings
from kvblend.store.config import StoreConfig, build_store
from tests.conftest import make_loaded

CAP = 4 * 2**20


def _scrape(client: TestClient) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {s.name + "".join(f"/{v}" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def test_cache_usage_and_background_gauges_move(tmp_path) -> None:
    store = build_store(StoreConfig(tiers=("memory",), memory_bytes=CAP))
    engine = Engine(make_loaded(), store=store, self_check=False)
    settings = Settings.load(model="tiny", state_dir=str(tmp_path), guard={"enabled": True, "shadow_fraction": 1.0})
    app = create_app(engine, settings)
    with TestClient(app) as client:
        before = _scrape(client)
        assert before["kvblend:kv_cache_usage_perc"] == 0.0 and before["kvblend:num_background_jobs"] == 0.0
        r = client.post("/v1/documents", json={"text": "the doctor works in paris and rides a red bike ."})
        assert r.status_code == 200, r.text
        after = _scrape(client)
        used = store.tier_stats()["memory"].bytes
        assert used > 0 and after["kvblend:kv_cache_usage_perc"] == used / CAP
        assert 0.0 < after["kvblend:kv_cache_usage_perc"] < 1.0
        hold = threading.Event()

        def held():  # a background job that keeps yielding until released
            while not hold.is_set():
                time.sleep(0.001)
                yield

        assert app.state.kvblend.scheduler.submit_background(held()) is not None
        assert _scrape(client)["kvblend:num_background_jobs"] == 1.0
        body = {"model": "tiny", "messages": [{"role": "user", "content": "who rides a bike ?"}], "max_tokens": 4,
                "documents": ["the doctor works in paris and rides a red bike ."], "kvblend": {"method": "blend"},
                "temperature": 0}
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # served beside the job
        assert _scrape(client)["kvblend:num_background_jobs"] == 2.0  # its shadow check waits in the lane
        hold.set()
        deadline = time.monotonic() + 30
        while (m := _scrape(client)).get("kvblend:shadow_checks_total/ok", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert m["kvblend:shadow_checks_total/ok"] == 1 and m["kvblend:num_background_jobs"] == 0.0
        hold.clear()  # another check waits behind a held job when the app shuts down
        assert app.state.kvblend.scheduler.submit_background(held()) is not None
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    text = generate_latest(app.state.kvblend.metrics.registry).decode()
    dropped = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvblend:shadow_checks_total" and s.labels["outcome"] == "dropped"]
    assert dropped == [1.0]  # drain dropped it (and did not wait for the held job)
    assert kv_cache_usage(object()) == 0.0  # a store without capped tiers reports 0


def test_a_blend_risk_reaches_the_response_and_the_histogram(tmp_path) -> None:
    """The default blend's risk (its own estimate of reuse's KV error left) is in the
    response's ``kvblend`` block and observed in ``kvblend:blend_risk``; reuse has none."""
    engine = Engine(make_loaded(), self_check=False)
    app = create_app(engine, Settings.load(model="tiny", state_dir=str(tmp_path)))
    docs = [" ".join(f"w{i}{j}" for j in range(40)) + " ." for i in range(2)]  # long enough for the shift's sample
    with TestClient(app) as client:
        for doc in docs:
            assert client.post("/v1/documents", json={"text": doc}).status_code == 200
        body = {"model": "tiny", "messages": [{"role": "user", "content": "which word ?"}], "max_tokens": 2,
                "documents": docs, "temperature": 0}
        blended = client.post("/v1/chat/completions", json=body).json()["kvblend"]
        reused = client.post("/v1/chat/completions", json={**body, "kvblend": {"method": "reuse"}}).json()["kvblend"]
        moved = client.post("/v1/chat/completions", json={**body, "kvblend": {"shift": False}}).json()["kvblend"]
        m = _scrape(client)
    assert blended["method"] == "blend" and 0.0 <= blended["risk"] < 10.0 and "risk" not in reused
    assert m["kvblend:blend_risk_count/shift"] == 1.0
    assert m["kvblend:blend_risk_sum/shift"] == pytest.approx(blended["risk"], abs=1e-5)
    assert "shift" not in moved["strategy"] and 0.0 < moved["risk"] <= 1.0  # without the shift: moved_risk
    assert m["kvblend:blend_risk_sum/moved"] == pytest.approx(moved["risk"], abs=1e-5)  # its own kind, not summed in
    assert moved["escalated"] is False and blended["escalated"] is False
    assert m["kvblend:blend_escalations_total"] == 0.0


def test_an_escalated_blend_says_so_and_is_counted(tmp_path) -> None:
    """Once the tenant has MIN_SAMPLES moved risks, a blend without the shift whose risk is
    above their ``blend.escalate`` quantile recomputes again: the response says so and
    ``kvblend:blend_escalations_total`` counts it; a blend at the top's level does not."""
    from kvblend.engine.escalation import MIN_SAMPLES

    engine = Engine(make_loaded(), self_check=False, calibrate=False)
    app = create_app(engine, Settings.load(model="tiny", state_dir=str(tmp_path), blend={"escalate": 1.0}))
    docs = [" ".join(f"w{i}{j}" for j in range(40)) + " ." for i in range(2)]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "which word ?"}], "max_tokens": 1,
            "documents": docs, "temperature": 0, "kvblend": {"shift": False}}
    with TestClient(app) as client:
        for doc in docs:
            assert client.post("/v1/documents", json={"text": doc}).status_code == 200
        first = client.post("/v1/chat/completions", json=body).json()["kvblend"]
        assert first["escalated"] is False  # no risks in yet
        for _ in range(MIN_SAMPLES):
            engine.escalation.add("default", first["risk"] / 2)  # the tenant's past risks, all below this prompt's
        escalated = client.post("/v1/chat/completions", json=body).json()["kvblend"]
        again = client.post("/v1/chat/completions", json=body).json()["kvblend"]  # its own risk is now the top
        m = _scrape(client)
    assert escalated["escalated"] is True and escalated["recompute_fraction"] > first["recompute_fraction"]
    assert again["escalated"] is False and again["risk"] == first["risk"]
    assert m["kvblend:blend_escalations_total"] == 1.0


def test_parked_streams_have_a_gauge(tmp_path) -> None:
    from types import SimpleNamespace

    from kvblend.server.app import server_metrics

    engine = Engine(make_loaded(), self_check=False)
    sched = SimpleNamespace(num_running=3, num_waiting=1, num_background=0, num_jobs=0, num_parked=2, observer=None)
    metrics = server_metrics("tiny", engine, sched)
    text = generate_latest(metrics.registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["kvblend:num_requests_parked"] == 2.0 and samples["kvblend:num_requests_running"] == 3.0
    remote = SimpleNamespace(num_running=1, num_waiting=0, num_background=0, num_jobs=0, observer=None)
    text = generate_latest(server_metrics("tiny", engine, remote).registry).decode()
    assert "kvblend:num_requests_parked{" in text  # a stand-in without parking reports 0, not an error
