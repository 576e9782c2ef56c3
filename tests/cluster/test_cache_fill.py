"""The cache fills where the traffic is, over Ray (issue #40): a document missed on a
replica is stored by the request that missed it, so three clients sending their own
documents at once each hit them on their second request."""

from __future__ import annotations

import threading

from tests.cluster.test_replicas import chat, passage, served


def test_each_of_three_concurrent_clients_hits_its_documents_on_its_second_request(cluster):
    got: dict[int, list[list[str]]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        docs = [{"text": passage(f"fill-{i}-a", 6)}, {"text": passage(f"fill-{i}-b", 6)}]
        try:
            with cluster.client() as c:
                got[i] = [served(chat(c, docs, question=f"Question {i}.{n}?", max_tokens=4))[1] for n in range(2)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    for i in range(3):  # no pause between a client's two requests: the miss was stored by the first
        first, second = got[i]
        assert "memory" not in first and "redis" not in first, got
        assert all(s in ("memory", "disk", "redis") for s in second), got
