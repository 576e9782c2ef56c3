"""One local Ray instance (2 CPUs) per pytest session, and on it the kvblend application:
two replicas of the default model (half a CPU each) behind one ingress, memory + Redis
tiers (a throwaway loopback redis-server), the document-affinity router, the quality
guard on."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from kvblend.settings import Settings
from kvblend.store.localredis import LocalRedis, free_port

KEY = "cluster-alice-key"


@dataclass
class Cluster:
    url: str
    settings: Settings

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout)


@pytest.fixture(scope="session")
def ray_instance():
    import ray

    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def cluster(ray_instance, tmp_path_factory, smollm2_calibrated):
    from kvblend.cluster.app import shutdown, start_local, wait_ready

    with LocalRedis() as redis:
        settings = Settings(
            port=free_port(), state_dir=str(tmp_path_factory.mktemp("cluster-state")), log_level="warning",
            api_keys={KEY: "alice"}, drain_timeout_s=5,
            store={"tiers": ["memory", "redis"], "memory_bytes": "64MiB", "redis_url": redis.url},
            # a token rate no test reaches: the ingress keeps alice's ledger, so her calls name
            # its inbox and a cancelled one's charges come back through it (cluster.settle)
            scheduler={"max_running": 4, "max_queued": 16, "tenants": {"alice": {"tokens_per_s": 1e9}}},
            # every blend is shadow-checked on a replica, one at a time; no quality bound,
            # so no test's answers depend on the guard switching to fallback
            guard={"enabled": True, "shadow_fraction": 1.0, "min_f1": None, "max_pending": 1},
            cluster={"replica_cpus": 0.5, "ingress_cpus": 0.25, "routing_stats_period_s": 0.5,
                     "health_check_period_s": 1.0},
        )
        running = start_local(settings, replicas=2, router="affinity")
        wait_ready(running.base_url)
        yield Cluster(running.base_url, settings)
        shutdown(running)
