"""One tiny-model server shared by the API tests (started once per session)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import ADMIN, ALICE, BOB, ServerProcess, save_tiny_model

MAIN_CONFIG = {
    "api_keys": {ALICE: "alice", BOB: "bob"},
    "admin_key": ADMIN,
    "store": {"tiers": ["memory"], "memory_bytes": "64MiB"},
    "limits": {"max_documents": 4, "max_document_bytes": 4000, "max_document_tokens": 300,
               "max_body_bytes": 65536, "max_tokens": 2000, "max_stop": 4},
    "scheduler": {"max_running": 2, "max_queued": 2},
    "drain_timeout_s": 10,
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("server"), MAIN_CONFIG)
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
