"""``kvblend serve --replicas N`` as a process: a signal while its replicas are still being
placed and loaded stops it, and every process of the Ray instance it started with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvblend.store.localredis import free_port

MARK = "KVB_TEST_RAY_MARK"  # inherited by every process the command starts: Ray's, and theirs


def marked(mark: str) -> dict[int, str]:
    """The live processes carrying ``MARK=mark`` in their environment: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def wait_for(what: Callable[[], bool], timeout_s: float) -> bool:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if what():
            return True
        time.sleep(0.5)
    return what()


def test_sigterm_while_the_replicas_start_stops_every_ray_process(tmp_path):
    """Issue 40: a SIGTERM while the replicas were being placed only logged "draining" and
    the command went on waiting for them; the Ray instance (GCS, raylet, dashboard, the
    replicas) lived as long as it. Now it stops at once, with all of them."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBLEND_", "RAY_"))}
    if os.environ.get("KVBLEND_HOME"):
        env["KVBLEND_HOME"] = os.environ["KVBLEND_HOME"]
    env.update({MARK: mark, "KVBLEND_STATE_DIR": str(tmp_path / "state")})
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvblend", "serve", "--replicas", "1", "--port", str(free_port())],
                            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        loading = wait_for(lambda: any("ServeReplica" in c for c in marked(mark).values()), 240)
        assert loading and proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        assert len(marked(mark)) > 5  # GCS, raylet, dashboard, ... and the replica
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
        output = (tmp_path / "serve.log").read_text()
        assert rc == 128 + signal.SIGTERM, output[-3000:]
        assert "SIGTERM while starting" in output and '"serving ' not in output
        gone = wait_for(lambda: not marked(mark), 30)
        assert gone, marked(mark)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in marked(mark):  # whatever a failure left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        log.close()


def test_while_starting_what_serve_says_of_waiting_replicas_is_logged_once(monkeypatch, caplog):
    """Ray logged its "taken more than 30s to be scheduled" to its own files only: the
    terminal said nothing while the command waited."""
    from ray import serve
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    from kvblend.cluster.app import APP_NAME, startup_reports

    waiting = "Deployment 'KvblendModel' has 1 replicas that have taken more than 30s to be scheduled."

    def status() -> ServeStatus:
        model = DeploymentStatusOverview(status=DeploymentStatus.UPDATING,
                                         status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
                                         replica_states={ReplicaState.STARTING: 1}, message=waiting)
        ingress = DeploymentStatusOverview(status=DeploymentStatus.HEALTHY,
                                           status_trigger=DeploymentStatusTrigger.UNSPECIFIED,
                                           replica_states={ReplicaState.RUNNING: 1}, message="all fine")
        app = ApplicationStatusOverview(status="DEPLOYING", message="", last_deployed_time_s=0.0,
                                        deployments={"KvblendModel": model, "KvblendIngress": ingress})
        return ServeStatus(applications={APP_NAME: app})

    monkeypatch.setattr(serve, "status", status)
    with caplog.at_level("WARNING", logger="kvblend.cluster"), startup_reports(0.02):
        time.sleep(0.3)
    logged = [r.getMessage() for r in caplog.records if r.name == "kvblend.cluster"]
    assert logged == [f"KvblendModel: {waiting}"]  # once, and not the healthy deployment's
