"""``kvblend serve --replicas N`` sizes itself to the Ray cluster it runs on, and refuses at
once, in one line naming the setting, what that cluster cannot place (``cluster.placement``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvblend.cluster.placement import MIN_REPLICA_CPUS, Demand, place, replica_share, replicas_fitting
from kvblend.settings import ClusterSettings, SettingsError


def demand(replicas: int, **cluster) -> Demand:
    return Demand.of(ClusterSettings(**cluster), replicas)


def test_by_default_two_replicas_share_a_two_cpu_host_beside_the_ingress():
    assert place(demand(2), [{"CPU": 2.0}]) == 0.75  # (2 - 0.5 for the ingress) / 2
    assert place(demand(1), [{"CPU": 2.0}]) == 1.5
    assert place(demand(4), [{"CPU": 16.0}]) == 3.87  # rounded down to 0.01
    assert place(demand(6), [{"CPU": 2.0}]) == MIN_REPLICA_CPUS  # 1.5 / 6
    with pytest.raises(SettingsError, match=r"--replicas 7: 7 model replicas of at least 0.25 CPU"):
        place(demand(7), [{"CPU": 2.0}])


def test_the_share_is_per_node_and_leaves_the_pinned_ingress_its_node():
    head, workers = {"CPU": 1.0, "kvblend_ingress": 1.0}, [{"CPU": 16.0}, {"CPU": 16.0}]
    pinned = demand(4, ingress_resources={"kvblend_ingress": 0.01})
    assert place(pinned, [head, *workers]) == 8.0  # 2 on each worker; the head keeps the ingress
    assert place(demand(3), [{"CPU": 4.0}, {"CPU": 4.0}]) == 2.0  # 3.5 free on one node: 1 there, 2 on the other
    assert replica_share(3, [{"CPU": 3.5}, {"CPU": 4.0}]) == 2.0
    assert replicas_fitting(1.0, [{"CPU": 0.9999999}]) == 1  # Ray's 1e-4 units, not float noise


def test_what_does_not_fit_is_refused_in_one_line_naming_the_setting():
    with pytest.raises(SettingsError) as caught:
        place(demand(2, replica_cpus=1.0), [{"CPU": 2.0}])  # the 2-CPU host of issue 40
    message = str(caught.value)
    assert "\n" not in message
    assert "cluster.replica_cpus" in message and "KVBLEND_CLUSTER__REPLICA_CPUS" in message and "--replicas" in message
    assert "2 model replicas x 1 CPU" in message and "2 CPUs free" in message
    assert place(demand(2, replica_cpus=0.75), [{"CPU": 2.0}]) == 0.75  # set explicitly and fits: kept
    # two nodes of 1.5 free hold no 2-CPU replica, whatever their sum
    with pytest.raises(SettingsError, match="at most 1.5 free on one node"):
        place(demand(1, replica_cpus=2.0, ingress_cpus=0.0), [{"CPU": 1.5}, {"CPU": 1.5}])
    # the ingress goes to the node with least room that holds it: the replica keeps the 2-CPU node
    assert place(demand(1, replica_cpus=2.0, ingress_cpus=0.5), [{"CPU": 2.0}, {"CPU": 1.5}]) == 2.0


def test_an_ingress_resource_no_node_offers_is_named():
    with pytest.raises(SettingsError, match=r"kvblend_ingress 0.01: cluster.ingress_resources.*ray start --resources"):
        place(demand(1, ingress_resources={"kvblend_ingress": 0.01}), [{"CPU": 8.0}])
    with pytest.raises(SettingsError, match="cluster.ingress_cpus"):
        place(demand(1, ingress_cpus=4.0), [{"CPU": 2.0}])


def test_serve_on_too_few_cpus_exits_at_once_naming_the_setting(tmp_path):
    """Issue 40: ``--replicas`` that the host cannot place waited forever, silently (Ray
    logged "taken more than 30s to be scheduled" to its own files). Now: exit 2 within
    seconds, one line on stderr, and no Ray instance started."""
    from kvblend.cluster.placement import host_cpus

    replicas = int(host_cpus()) + 1  # 1 CPU each: one more than this host has, whatever it has
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBLEND_", "RAY_"))}
    env.update(KVBLEND_HOME=os.environ.get("KVBLEND_HOME", ""), KVBLEND_CLUSTER__REPLICA_CPUS="1",
               KVBLEND_STATE_DIR=str(tmp_path / "state"))
    if not env["KVBLEND_HOME"]:
        del env["KVBLEND_HOME"]
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvblend", "serve", "--replicas", str(replicas), "--port", "1"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    elapsed = time.monotonic() - started
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvblend: error:")]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(errors) == 1 and "cluster.replica_cpus" in errors[0] and f"--replicas {replicas}" in errors[0], errors
    assert "Started a local Ray instance" not in out.stderr
    assert elapsed < 60, elapsed  # the imports and the model's config: seconds, not a hang
