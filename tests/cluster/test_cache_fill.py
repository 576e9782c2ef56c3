"""The cache fills where the traffic is, over Ray (issue #40): a document missed on a
replica is stored by the request that missed it, so three clients sending their own
documents at once each hit them on their second request."""

from __future__ import annotations

from tests.cluster.test_replicas import chat, passage, served
from tests.server.helpers import concurrently


def test_each_of_three_concurrent_clients_hits_its_documents_on_its_second_request(cluster):
    def client(i: int) -> list[list[str]]:
        docs = [{"text": passage(f"fill-{i}-a", 6)}, {"text": passage(f"fill-{i}-b", 6)}]
        with cluster.client() as c:
            return [served(chat(c, docs, question=f"Question {i}.{n}?", max_tokens=4))[1] for n in range(2)]

    got = concurrently(client, 3)
    for first, second in got.values():  # no pause between a client's two requests: the miss was stored by the first
        assert "memory" not in first and "redis" not in first, got
        assert all(s in ("memory", "disk", "redis") for s in second), got
