"""One tiny-model server shared by the API tests (started once per session)."""

from __future__ import annotations

import httpx
import pytest

from kvblend.store.localredis import LocalRedis
from tests.server.helpers import ADMIN, ALICE, BOB, CAROL, ServerProcess, save_tiny_model

MAIN_CONFIG = {
    "api_keys": {ALICE: "alice", BOB: "bob", CAROL: "carol"},
    "admin_key": ADMIN,
    "store": {"tiers": ["memory", "redis"], "memory_bytes": "64MiB"},
    "limits": {"max_documents": 4, "max_document_bytes": 4000, "max_document_tokens": 300,
               "max_body_bytes": 65536, "max_tokens": 2000, "max_stop": 4},
    "scheduler": {"max_running": 2, "max_queued": 2},
    "documents": {"chunk_tokens": 32},  # short documents stay one chunk; test_documents_chunked cuts longer ones
    "drain_timeout_s": 10,
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random model's folder, its self-check and shift test done here and stored
    under $KVBLEND_HOME: a server on it then blends with its verdict from the first
    request (it would otherwise test the shift on a thread and blend without it until
    then, so a test's first blends would depend on that thread's timing)."""
    import torch

    from kvblend.engine import Engine
    from kvblend.models.loader import load_model

    folder = str(save_tiny_model(tmp_path_factory.mktemp("tiny-model")))
    Engine(load_model(folder, "cpu", torch.float32)).close()
    return folder


@pytest.fixture(scope="session")
def redis_url():
    with LocalRedis() as r:
        yield r.url


def main_config(redis_url: str) -> dict:
    return {**MAIN_CONFIG, "store": {**MAIN_CONFIG["store"], "redis_url": redis_url}}


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory, redis_url):
    """The shared server: keys for tenants alice and bob, memory + redis tiers."""
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("server"), main_config(redis_url))
    yield proc
    proc.stop()


@pytest.fixture
def alice(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60) as c:
        yield c


@pytest.fixture
def bob(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {BOB}"}, timeout=60) as c:
        yield c
