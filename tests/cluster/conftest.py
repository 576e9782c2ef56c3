"""One local Ray instance (2 CPUs) per pytest session: ``ray_instance`` (the same fixture as
part A's tests/cluster/conftest.py, which adds the kvblend application on top of it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_instance():
    import ray

    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()
