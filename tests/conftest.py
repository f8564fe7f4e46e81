"""One local Ray for the whole suite (it takes ~10 s to start here), sized for a 2-core machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ROLLOUTS_TEST", "1")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # Logical CPUs above the physical two: actors here mostly wait, and tests pack many of them.
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()
