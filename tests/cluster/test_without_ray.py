"""The single-process server never imports ray, and errors keep their HTTP shapes across
the ingress-replica hop (``cluster.wire``) without a Ray instance."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvblend.cluster.wire import WireError, rebuild, to_wire
from kvblend.engine.scheduler import DeadlineExceededError, DrainingError, InternalRequestError, QueueFullError
from kvblend.errors import ContextLengthError
from kvblend.server.errors import from_exception
from tests.server.helpers import save_tiny_model


def test_single_process_serve_imports_no_ray(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    code = textwrap.dedent(f"""
        import sys
        from fastapi.testclient import TestClient
        import kvblend.cli
        from kvblend.server.app import create_app
        from kvblend.server.main import build_engine
        from kvblend.settings import Settings

        s = Settings(model={str(model)!r}, state_dir={str(tmp_path / 'state')!r}, store={{"tiers": ["memory"]}})
        with TestClient(create_app(build_engine(s), s)) as c:
            r = c.post("/v1/chat/completions", json={{"model": s.model_id, "max_tokens": 2,
                       "messages": [{{"role": "user", "content": "hi"}}], "documents": [{{"text": "a b c"}}]}})
            assert r.status_code == 200, r.text
            assert "replica" not in r.json()["kvblend"] and "x-kvblend-replica" not in r.headers
            assert c.get("/metrics").status_code == 200
        print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(("error", "status"), [
    (QueueFullError("busy", 7), 429), (DrainingError("stopping"), 503), (DeadlineExceededError("late"), 504),
    (ContextLengthError("too long"), 400), (InternalRequestError("boom"), 500), (KeyError("secret detail"), 500),
])
def test_errors_cross_the_hop_with_their_status(error, status):
    wire = to_wire(error)
    assert isinstance(wire, WireError)
    local, remote = from_exception(error), from_exception(rebuild(wire))
    assert (remote.status, remote.type) == (local.status, local.type) == (status, remote.type)
    assert remote.headers == local.headers  # Retry-After of a 429 included
    if status == 500:
        assert "secret" not in remote.message and "boom" not in remote.message


def test_a_bad_field_keeps_its_name_and_a_subclass_its_status_across_the_hop():
    """``param`` was lost (the wire carried no field), and an error class the wire did not
    list became a 500 where one process answers 400."""
    from kvblend.errors import InvalidRequestError

    class TemplateRefused(InvalidRequestError):
        pass

    remote = from_exception(rebuild(to_wire(InvalidRequestError("too hot", "temperature"))))
    assert (remote.status, remote.param) == (400, "temperature")
    error = TemplateRefused("no", "messages")
    local, remote = from_exception(error), from_exception(rebuild(to_wire(error)))
    assert (remote.status, remote.param) == (local.status, local.param) == (400, "messages")


def test_replica_flags_merge_into_the_cluster_settings(tmp_path, monkeypatch, capsys):
    import json

    from kvblend.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster:\n  replicas: 5\n  ingress_replicas: 2\n  router: default\n")
    monkeypatch.setenv("KVBLEND_CLUSTER__REPLICA_CPUS", "0.5")
    assert main(["serve", "--config", str(cfg), "--replicas", "3", "--ray-address", "10.0.0.1:6379",
                 "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out)["cluster"]
    assert (data["replicas"], data["ray_address"], data["router"]) == (3, "10.0.0.1:6379", "default")
    assert (data["ingress_replicas"], data["replica_cpus"]) == (2, 0.5)  # the rest of the section is kept


def test_the_guard_runs_with_replicas_and_its_checks_have_room_on_a_replica():
    from kvblend.cluster.app import check_settings
    from kvblend.cluster.model import max_ongoing
    from kvblend.settings import Settings, SettingsError

    guarded = Settings(guard={"enabled": True}, scheduler={"max_background": 5}, cluster={"replicas": 2})
    check_settings(guarded)  # accepted (it was refused before the checks could run on replicas)
    deep = Settings(blend={"check_layers": [1, 99]}, cluster={"replicas": 2})
    with pytest.raises(SettingsError, match="must be below the model's 30 layers"):
        check_settings(deep)  # before any replica starts (and fails in Ray's logs)
    # every ingress's checks may wait in a replica's background lane, not only one's max_pending
    assert max_ongoing(guarded) == max_ongoing(Settings(cluster={"replicas": 2})) + 5


def test_ingress_health_follows_the_running_model_replicas(tmp_path):
    """/health answers 503 while no model replica runs (a load balancer then stops sending
    to this ingress), 200 once one runs again; the count comes from serve.status()."""
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus
    from starlette.testclient import TestClient

    from kvblend.cluster.remote import RemoteScheduler, running_replicas
    from kvblend.engine import Engine
    from kvblend.server import create_app
    from kvblend.settings import Settings
    from tests.conftest import make_loaded

    def status(running: int, starting: int) -> ServeStatus:
        overview = DeploymentStatusOverview(
            status=DeploymentStatus.HEALTHY, status_trigger=DeploymentStatusTrigger.UNSPECIFIED,
            replica_states={ReplicaState.RUNNING: running, ReplicaState.STARTING: starting}, message="")
        app = ApplicationStatusOverview(status="RUNNING", message="", last_deployed_time_s=0.0,
                                        deployments={"KvblendModel": overview})
        return ServeStatus(applications={"kvblend": app})

    assert running_replicas(status(2, 1), "kvblend", "KvblendModel") == 2
    assert running_replicas(status(0, 2), "kvblend", "KvblendModel") == 0
    assert running_replicas(status(2, 0), "other", "KvblendModel") is None

    class Handle:  # the model deployment's handle is never called here
        def options(self, **_):
            return self

    engine = Engine(make_loaded())
    remote = RemoteScheduler(Handle(), engine)
    app = create_app(engine, Settings(state_dir=str(tmp_path / "state")), scheduler=remote)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200  # not known yet: up
        remote.replicas_running = running_replicas(status(0, 2), "kvblend", "KvblendModel")
        assert client.get("/health").status_code == 503
        remote.replicas_running = running_replicas(status(1, 1), "kvblend", "KvblendModel")
        assert client.get("/health").status_code == 200
