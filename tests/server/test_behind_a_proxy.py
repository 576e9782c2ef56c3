"""The app behind Ray Serve's proxy answers as it does alone under uvicorn: a client that
leaves a non-streamed request is counted and logged however the server learns of it
(uvicorn sends ``http.disconnect``, tests/server/test_load_and_metrics.py; the proxy
cancels the handler's task, as here), and a response carries one request id."""

from __future__ import annotations

import json
import logging
import time

import httpx
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.conftest import make_loaded

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "who is the doctor ?"}], "max_tokens": 200,
        "temperature": 0, "ignore_eos": True, "kvblend": {"method": "full"}}


ACCESS = "kvblend.server.requests"


def _metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_cancelled_handler_cancels_its_request_and_is_counted(tmp_path, caplog) -> None:
    app = create_app(Engine(make_loaded()), Settings.load(model="tiny", state_dir=str(tmp_path)))
    with TestClient(app) as client, caplog.at_level(logging.INFO, logger=ACCESS):
        before = _metric(client, "kvblend:client_disconnects_total")

        async def post() -> None:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
                await c.post("/v1/chat/completions", json=BODY)

        task = client.portal.start_task_soon(post)
        deadline = time.monotonic() + 30
        while _metric(client, "kvblend:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        task.cancel()  # as Ray Serve's proxy does when the client goes away
        while _metric(client, "kvblend:num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _metric(client, "kvblend:num_requests_running") == 0  # the slot is freed
        assert _metric(client, "kvblend:client_disconnects_total") - before == 1
        assert _metric(client, "kvblend:generation_tokens_total") < 200
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS]
    assert [line["status"] for line in lines if line.get("route") == "chat"] == [499]


def test_behind_ray_serves_proxy_a_response_has_one_request_id(tmp_path, caplog) -> None:
    """Ray Serve wraps every app in its RequestIdMiddleware, which appends X-Request-ID:
    with the app's own, a client saw two ("chatcmpl-..., 567e...")."""
    from ray.serve._private.http_util import RequestIdMiddleware

    app = create_app(Engine(make_loaded()), Settings.load(model="tiny", state_dir=str(tmp_path)))
    body = {**BODY, "max_tokens": 2}
    with TestClient(app) as client, caplog.at_level(logging.INFO, logger=ACCESS):
        alone = client.post("/v1/chat/completions", json=body)
        assert alone.headers.get_list("x-request-id") == [alone.json()["id"]]  # one process: the completion's id
        app.state.kvblend.request_id_header = False  # as the Ray Serve ingress sets it
        proxied = TestClient(RequestIdMiddleware(app))
        r = proxied.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "client-42"})
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["client-42"]
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == ACCESS]
    # the log line ties the completion's id to the one the client saw
    assert [(line["id"], line.get("request_id")) for line in lines] == [
        (alone.json()["id"], None), (r.json()["id"], "client-42")]
