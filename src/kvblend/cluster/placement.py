"""Whether the Ray cluster can place what ``kvblend serve --replicas N`` asks for, and the
CPUs a model replica takes when ``cluster.replica_cpus`` is not set.

Ray places an actor only on one node whose free resources cover its whole request, and
waits for room otherwise (logging "taken more than 30s to be scheduled" to its own files),
so the check is per node (``place``): the ingresses first (each ``cluster.ingress_cpus``
and ``cluster.ingress_resources``), each on the node with the least room that covers it,
then the N model replicas of ``cluster.replica_cpus`` each, as many on a node as fit. That
is what any placement needs, not what Ray will find (it places them in its own order), but
it catches at once what made a 2-CPU host wait forever: 2 replicas x 1 CPU + 0.5 CPU for the
ingress.

``cluster.replica_cpus`` unset (None, the default): each replica takes the largest equal
share of the CPUs the ingresses leave that places all N (``replica_share``: on one host,
``(CPUs - ingress CPUs) / N``), rounded down to 0.01 CPU and at least ``MIN_REPLICA_CPUS``
(four replicas per core; fewer CPUs are refused). A model replica runs torch on
``max(1, round(replica_cpus))`` threads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvblend.settings import ClusterSettings, SettingsError

Resources = Mapping[str, float]
MIN_REPLICA_CPUS = 0.25
EPS = 1e-6  # Ray keeps resources in 1e-4 units; sums of floats stay within this


class Demand(NamedTuple):
    """What ``--replicas N`` asks of the Ray cluster; ``replica_cpus`` None: a share of what is free."""

    replicas: int
    replica_cpus: float | None
    ingresses: int
    ingress: dict[str, float]  # one ingress's resources: CPU and custom ones

    @classmethod
    def of(cls, cluster: ClusterSettings, replicas: int, ingresses: int | None = None) -> Demand:
        ingress = {"CPU": cluster.ingress_cpus, **cluster.ingress_resources}
        return cls(replicas, cluster.replica_cpus, ingresses or cluster.ingress_replicas,
                   {k: v for k, v in ingress.items() if v > 0})


def _covers(free: Resources, need: Resources) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in need.items())


def place_ingresses(demand: Demand, nodes: Sequence[Resources]) -> list[dict[str, float]] | None:
    """Each node's free resources once the ingresses are placed (each on the covering node
    with the least free CPU), or None when one has no node."""
    free = [dict(n) for n in nodes]
    for _ in range(demand.ingresses):
        fits = [n for n in free if _covers(n, demand.ingress)]
        if not fits:
            return None
        node = min(fits, key=lambda n: n.get("CPU", 0.0))
        for k, v in demand.ingress.items():
            node[k] = node.get(k, 0.0) - v
    return free


def replicas_fitting(cpus: float, free: Sequence[Resources]) -> int:
    """How many replicas of ``cpus`` CPUs the nodes' ``free`` resources hold."""
    return sum(math.floor((n.get("CPU", 0.0) + EPS) / cpus) for n in free)


def replica_share(replicas: int, free: Sequence[Resources]) -> float:
    """The largest CPUs per replica that place ``replicas`` on ``free`` (0.0: none), rounded
    down to 0.01: a node's free CPUs split k ways, for the largest such that fits."""
    cpus = [n.get("CPU", 0.0) for n in free if n.get("CPU", 0.0) > EPS]
    candidates = sorted({c / k for c in cpus for k in range(1, replicas + 1)}, reverse=True)
    share = next((c for c in candidates if replicas_fitting(c, free) >= replicas), 0.0)
    return math.floor(share * 100 + EPS) / 100


def place(demand: Demand, nodes: Sequence[Resources]) -> float:
    """The CPUs each model replica takes (``demand.replica_cpus``, or the share of what is
    free); SettingsError, one line naming the setting to change, when ``nodes`` (each
    node's free resources) cannot hold the ingresses and the replicas."""
    free = place_ingresses(demand, nodes)
    if free is None:
        raise SettingsError(_no_ingress(demand, nodes))
    if demand.replica_cpus is None:
        share = replica_share(demand.replicas, free)
        if share < MIN_REPLICA_CPUS:
            raise SettingsError(_too_few(demand, nodes, free))
        return share
    if replicas_fitting(demand.replica_cpus, free) < demand.replicas:
        raise SettingsError(_too_few(demand, nodes, free))
    return demand.replica_cpus


def _cpus(nodes: Sequence[Resources]) -> str:
    each = [f"{n.get('CPU', 0.0):g}" for n in nodes]
    listed = f" ({' + '.join(each)} on {len(nodes)} nodes)" if 1 < len(nodes) <= 8 else ""
    return f"{sum(n.get('CPU', 0.0) for n in nodes):g} CPUs free{listed}"


def _too_few(demand: Demand, nodes: Sequence[Resources], free: Sequence[Resources]) -> str:
    n, ingress_cpus = demand.replicas, demand.ingress.get("CPU", 0.0)
    asked = (f"{n} model replicas x {demand.replica_cpus:g} CPU (cluster.replica_cpus)"
             if demand.replica_cpus is not None else
             f"{n} model replicas of at least {MIN_REPLICA_CPUS:g} CPU each")
    left = max((c.get("CPU", 0.0) for c in free), default=0.0)
    fix = ("lower cluster.replica_cpus (KVBLEND_CLUSTER__REPLICA_CPUS; unset, replicas share what is free) or"
           if demand.replica_cpus is not None else "")
    return (f"the Ray cluster cannot place --replicas {n}: {asked} + {demand.ingresses} ingress x {ingress_cpus:g} "
            f"CPU (cluster.ingress_cpus) on {_cpus(nodes)} (at most {left:g} free on one node once the ingress "
            f"is placed); {fix} lower --replicas, or start Ray with more CPUs")


def _no_ingress(demand: Demand, nodes: Sequence[Resources]) -> str:
    custom = {k: v for k, v in demand.ingress.items() if k != "CPU"}
    if custom and not any(_covers(n, custom) for n in nodes):
        names = ", ".join(f"{k} {v:g}" for k, v in custom.items())
        return (f"no node of the Ray cluster has the ingress's resources ({names}: cluster.ingress_resources); "
                f"start the node that should hold it with ray start --resources='{{\"{next(iter(custom))}\": 1}}', "
                f"or empty cluster.ingress_resources")
    return (f"the Ray cluster cannot place {demand.ingresses} ingress x {demand.ingress.get('CPU', 0.0):g} CPU "
            f"(cluster.ingress_cpus, cluster.ingress_replicas) on {_cpus(nodes)}; lower cluster.ingress_cpus "
            f"(KVBLEND_CLUSTER__INGRESS_CPUS) or cluster.ingress_replicas, or start Ray with more CPUs")


def host_cpus() -> float:
    """The CPUs a local Ray instance would offer on this host (Ray's own count: the
    container's CPU quota, else the CPUs this process may run on)."""
    try:
        from ray._private.utils import get_num_cpus

        return float(get_num_cpus())
    except Exception:  # noqa: BLE001 - Ray's private helper moved: count them ourselves
        import os

        return float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def free_per_node() -> list[dict[str, float]]:
    """Each live node's free resources, from the Ray cluster this process is connected to."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        return [dict(r) for r in available_resources_per_node().values()]
    except Exception:  # noqa: BLE001 - Ray's developer API moved: the cluster as one node
        return [dict(ray.available_resources())]


__all__ = ["MIN_REPLICA_CPUS", "Demand", "free_per_node", "host_cpus", "place", "place_ingresses",
           "replica_share", "replicas_fitting"]
