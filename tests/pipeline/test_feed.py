"""The loader thread on its own: layer-major reads ahead of the worker, one timed wait per
layer, per-document failures and timeouts."""

from __future__ import annotations

import threading

import torch

from kvblend.pipeline.loader import LayerFeed


class FakeChunk:
    """Duck-typed LayeredChunk: records reads; can fail at a layer or block until released."""

    def __init__(self, name: str, log: list, fail_at: int | None = None, gate: threading.Event | None = None):
        self.name, self.log, self.fail_at, self.gate = name, log, fail_at, gate
        self.tier_name, self.n_tokens, self.base_position, self.promoted = "disk", 4, 1, False

    def read(self, layer: int):
        if self.gate is not None:
            self.gate.wait()
        self.log.append((self.name, layer))
        if layer == self.fail_at:
            return None
        return torch.full((1, 4, 2), float(layer)), torch.zeros(1, 4, 2)

    def promote(self) -> bool:
        self.promoted = True
        return True


def test_reads_every_document_layer_by_layer_ahead_of_the_worker() -> None:
    log: list = []
    feed = LayerFeed(3, torch.device("cpu"), torch.float32)
    a, b = feed.add(FakeChunk("a", log)), feed.add(FakeChunk("b", log, fail_at=1))
    feed.start()
    assert a.layer(0)[0].eq(0).all() and b.layer(0) is not None
    assert a.layer(2)[0].eq(2).all()
    assert b.layer(1) is None and b.layer(2) is None
    assert b.failure().layer == 1
    assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]  # layer-major, b skipped after failing
    assert len(feed.wait_s) == 3 and all(w >= 0 for w in feed.wait_s)
    feed.close()
    feed._thread.join(5)  # promotion runs on the loader thread after the last layer
    assert feed._chunks[0].promoted and not feed._chunks[1].promoted


def test_a_document_still_loading_at_the_timeout_fails_alone() -> None:
    gate, log = threading.Event(), []
    feed = LayerFeed(2, torch.device("cpu"), torch.float32, timeout_s=0.05)
    fast = feed.add(FakeChunk("fast", log))
    stuck = feed.add(FakeChunk("stuck", log, gate=gate))
    feed.start()
    assert fast.layer(0) is not None
    assert stuck.layer(0) is None and stuck.failure().reason == "timeout"
    assert feed.wait_s[0] >= 0.05
    gate.set()  # the late read arrives and is discarded
    assert fast.layer(1) is not None and stuck.layer(1) is None
    feed.close()
