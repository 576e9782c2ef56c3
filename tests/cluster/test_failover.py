"""A request whose model replica is lost before it streamed a token is sent once more, to
another replica, by the ingress (``cluster.remote.RemoteHandle``); one that streamed a
token ends with the 503 it always did. Two in-process ``ModelReplica`` over real
schedulers behind the ingress's app, a replica's loss cut into its stream (no Ray)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from kvblend.cluster.remote import RemoteScheduler, tenant_ledger
from kvblend.cluster.wire import Started
from kvblend.engine import Engine
from kvblend.generation.stream import StreamEvent
from kvblend.server import create_app
from kvblend.settings import Settings
from tests.cluster.test_model_replica import _Method
from tests.cluster.test_tenant_limits import _replicas
from tests.conftest import make_loaded

KEY = "failover-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"max_tokens": 4, "ignore_eos": True, "temperature": 0, "kvblend": {"method": "full"},
        "messages": [{"role": "user", "content": "what is kept where ?"}]}


class _Cut:
    """A streaming call whose replica dies right after it sent an item of type ``after``
    (None: never): Ray's error from then on, the replica's request dropped."""

    def __init__(self, agen, after: type | None) -> None:
        self._agen, self._after, self._dead = agen, after, False

    async def __anext__(self):
        if self._dead:
            await self._agen.aclose()
            raise RuntimeError("ActorDiedError: the actor died unexpectedly before finishing this task")
        item = await self._agen.__anext__()
        self._dead = self._after is not None and isinstance(item, self._after)
        return item

    def cancel(self) -> None:
        self._dead = True


class _Failover:
    """The model deployment's handle: a call goes to the first replica its ``avoid`` does
    not name; ``dies_after[replica]``: the item type after which that replica dies."""

    def __init__(self, replicas, dies_after: dict[str, type]) -> None:
        self.replicas = {r.replica: r for r in replicas}
        self.dies_after = dies_after
        self.sent: list = []  # (replica id, ModelCall)
        self.generate = _Method(self._generate)

    def _generate(self, call):
        rid = next(r for r in self.replicas if r not in getattr(call, "avoid", ()))
        self.sent.append((rid, call))
        return _Cut(self.replicas[rid].generate(call), self.dies_after.get(rid))

    def options(self, **_):
        return self


@pytest.fixture
def served(tmp_path):
    """``serve(dies_after, body) -> (response, handle, remote)`` over two fresh replicas r0, r1."""
    settings = Settings(state_dir=str(tmp_path / "state"), store={"tiers": ["memory"]}, api_keys={KEY: "metered"},
                        scheduler={"tenants": {"metered": {"max_queued": 8}}})
    made = []

    def serve(dies_after: dict[str, type], body: dict, *, scheds_hook=None):
        scheds, replicas = _replicas(2)
        made.extend(scheds)
        if scheds_hook is not None:
            scheds_hook(scheds)
        handle = _Failover(replicas, dies_after)
        engine = Engine(make_loaded())
        remote = RemoteScheduler(handle, engine, tenant_ledger(settings))
        with TestClient(create_app(engine, settings, scheduler=remote)) as client:
            response = client.post("/v1/chat/completions", json={**body, "model": settings.model_id}, headers=AUTH)
        return response, handle, remote

    yield serve
    for s in made:
        s.drain(5)


def _text(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def _sse(response) -> list:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_a_request_whose_replica_dies_before_its_first_token_is_answered_by_another(served):
    """Issue 40: it was a 503 "retry the request", though nothing had reached the client."""
    reference = _text(served({}, BODY)[0])
    response, handle, remote = served({"r0": Started}, BODY)  # r0 dies once the request left its queue
    assert _text(response) == reference
    (first, call), (again, retry) = handle.sent
    assert (first, again) == ("r0", "r1") and retry.avoid == ("r0",) and retry.call != call.call
    assert retry.request is call.request
    assert remote.ledger.waiting("metered") == 0 and remote.num_running == 0
    # the response names the replica that answered, not the one lost
    assert response.headers["X-Kvblend-Replica"] == "r1" and response.json()["kvblend"]["replica"] == "r1"

    stream, handle, _ = served({"r0": Started}, {**BODY, "stream": True})
    chunks = _sse(stream)
    assert stream.text.rstrip().endswith("data: [DONE]") and not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == reference
    assert [rid for rid, _ in handle.sent] == ["r0", "r1"]
    assert [c["kvblend"]["replica"] for c in chunks if "kvblend" in c] == ["r1"]


def test_a_request_that_streamed_a_token_ends_with_a_503_and_is_not_sent_again(served):
    response, handle, _ = served({"r0": StreamEvent}, BODY)
    assert response.status_code == 503 and "retry the request" in response.json()["error"]["message"]
    stream, handle_s, _ = served({"r0": StreamEvent}, {**BODY, "stream": True})
    assert _sse(stream)[-1]["error"]["code"] == 503  # after its first token: in-band, as before
    assert [rid for rid, _ in handle.sent] == [rid for rid, _ in handle_s.sent] == ["r0"]


def test_a_request_is_sent_again_only_once(served):
    response, handle, remote = served({"r0": Started, "r1": Started}, BODY)
    assert response.status_code == 503, response.text
    assert [rid for rid, _ in handle.sent] == ["r0", "r1"]
    assert remote.ledger.waiting("metered") == 0


def test_a_replica_whose_model_worker_died_hands_the_request_to_another(served):
    """The worker's death comes in-band (``Ended`` with ``WorkerDeadError``), the replica
    itself still answers until Ray replaces it."""
    def kill_r0_worker(scheds) -> None:
        def broken() -> None:
            raise RuntimeError("simulated persistent failure")

        scheds[0]._expire = broken
        scheds[0].submit(make_request(), _params())  # wakes the loop into its failures
        scheds[0]._thread.join(10)
        assert not scheds[0].alive

    response, handle, _ = served({}, BODY, scheds_hook=kill_r0_worker)
    assert _text(response)
    assert [rid for rid, _ in handle.sent] == ["r0", "r1"]


def make_request():
    from kvblend.engine import Request

    return Request(question="hi")


def _params():
    from kvblend.generation import SamplingParams

    return SamplingParams(max_tokens=2)
