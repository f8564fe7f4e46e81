"""A plane fits its actors' CPU requests to a cluster that cannot hold its smallest working set (every
rollout worker, one renderer, one env server per pool), scaling them all by one factor; one that fits is
left as configured. Ray-free: `cpu_fit` is arithmetic on the config."""

from __future__ import annotations

import pytest

from rollout_actors.plane import PlaneConfig
from rollout_actors.plane.sizing import cpu_fit

README_LANES = {"train": 1024, "eval": 128}  # the README's example: two workers of one CPU each


def requests(config: PlaneConfig, workers: int) -> float:
    pools = [config.env_pool, *config.env_pools.values()]
    return (
        workers * config.worker_num_cpus
        + config.renderer_pool.renderer_num_cpus
        + sum(pool.num_cpus for pool in pools)
    )


@pytest.mark.parametrize("free", [2.0, 1.0, 0.5])
def test_a_working_set_larger_than_the_free_cpus_is_scaled_to_fit_them(free):
    config = PlaneConfig(lanes=README_LANES, env_pools={"my.env:Env": {"num_cpus": 0.5}})
    fit = cpu_fit(config, workers=2, free_cpus=free)
    assert fit.need == 2 * 1.0 + 0.5 + 0.25 + 0.5 and fit.scale < 1
    assert requests(fit.config, 2) <= free  # every part of it can start: none waits for a CPU
    shares = (fit.config.worker_num_cpus, fit.config.renderer_pool.renderer_num_cpus)
    assert shares[0] == pytest.approx(2 * shares[1], rel=1e-3)  # one factor: each keeps its share
    assert fit.config.env_pools["my.env:Env"].num_cpus > fit.config.env_pool.num_cpus > 0
    assert f"the cluster has {free:g} free" in fit.describe() and "2 rollout worker(s) x 1" in fit.describe()


@pytest.mark.parametrize("free", [2.75, 8.0, 0.0])
def test_a_working_set_that_fits_or_a_cluster_with_no_cpu_free_keeps_the_configured_requests(free):
    config = PlaneConfig(lanes=README_LANES)
    fit = cpu_fit(config, workers=2, free_cpus=free)
    assert fit.scale == 1.0 and fit.config == config  # nothing to fit into: left to an autoscaler
