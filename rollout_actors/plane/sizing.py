"""Fitting a plane's CPU requests to a cluster that cannot grow.

A plane needs, before any rollout can run, its smallest working set: every rollout worker, one renderer
and one env server per env pool it knows of. Their CPU requests are production defaults (a worker asks a
whole core); a plain `ray.init()` on a 2-core machine gives 2 CPUs, which the two workers of the default
lanes take, and every env server and renderer then waits for a CPU that never frees: rollouts end
`infrastructure` at their readiness deadlines. Ray only schedules, it cannot shrink a request; the plane
can, at `start()`:

    fit = cpu_fit(config, workers=2, free_cpus=ray.available_resources().get("CPU", 0.0))
    if fit.scale < 1:
        config = fit.config      # every CPU request scaled by `fit.scale`; `fit.describe()` says why

It does so where the cluster cannot grow (`PlaneConfig.fit_cpus`: by default, a local cluster this process
started, `ray.init()`'s; elsewhere an autoscaler may bring the CPUs, and shrinking the requests would pack
the actors where it should have added nodes). A set that does not fit and is not scaled is named in one
warning at start, with what it needs and what is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from env_actors.config import EnvPoolConfig
from rollout_actors.plane.config import PlaneConfig

CPU_QUANTUM = 1e-4  # Ray's resource precision: a scaled request is rounded down to it, so the set still fits


@dataclass(frozen=True)
class CpuFit:
    """What the plane's smallest working set asks of the cluster's free CPUs, and the config that fits."""

    parts: dict[str, float]
    """Each part of the smallest working set -> the CPUs it asks, as configured."""
    free: float
    """CPUs free in the cluster at start."""
    scale: float
    """The factor every CPU request is multiplied by in `config`: 1.0 where the set fits."""
    config: PlaneConfig

    @property
    def need(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{what}: {cpus:g}" for what, cpus in self.parts.items())
        return f"the plane's actors need {self.need:g} CPUs ({parts}); the cluster has {self.free:g} free"


def _scaled(cpus: float, scale: float) -> float:
    return math.floor(cpus * scale / CPU_QUANTUM) * CPU_QUANTUM


def cpu_fit(config: PlaneConfig, workers: int, free_cpus: float) -> CpuFit:
    """The smallest working set of a plane of `workers` rollout workers against `free_cpus`, and `config`
    with every CPU request (workers, renderers, env servers of every pool) scaled by the same factor so
    that the set fits, where it does not (and any CPU is free)."""
    pools = {"default": config.env_pool, **config.env_pools}
    parts = {
        f"{workers} rollout worker(s) x {config.worker_num_cpus:g}": workers * config.worker_num_cpus,
        "a renderer": config.renderer_pool.renderer_num_cpus,
        **{f"an env server ({name})": pool.num_cpus for name, pool in pools.items()},
    }
    need = sum(parts.values())
    if need <= free_cpus or free_cpus <= 0:
        return CpuFit(parts, free_cpus, 1.0, config)
    scale = free_cpus / need
    fitted = config.model_copy(
        update={
            "worker_num_cpus": _scaled(config.worker_num_cpus, scale),
            "renderer_pool": config.renderer_pool.model_copy(
                update={"renderer_num_cpus": _scaled(config.renderer_pool.renderer_num_cpus, scale)}
            ),
            "env_pool": _env_pool(config.env_pool, scale),
            "env_pools": {name: _env_pool(pool, scale) for name, pool in config.env_pools.items()},
        }
    )
    return CpuFit(parts, free_cpus, scale, fitted)


def _env_pool(pool: EnvPoolConfig, scale: float) -> EnvPoolConfig:
    return pool.model_copy(update={"num_cpus": _scaled(pool.num_cpus, scale)})


def started_here() -> bool:
    """Whether this process started the Ray cluster it is connected to (`ray.init()` without an address):
    a local cluster nothing will add a node to."""
    from ray._private import worker  # Ray's record of the node this process started or joined

    node = worker._global_node
    return node is not None and bool(node.head)
