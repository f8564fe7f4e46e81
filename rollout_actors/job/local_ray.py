"""How the command line's drivers (`rollouts run`, `rollouts serve-env`) start or join Ray."""

from __future__ import annotations

import os


def init_ray(address: str | None) -> None:
    """Join `address` (or `$RAY_ADDRESS`), else start an embedded Ray of this process's own."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # Embedded means our own: `address="local"` never joins a cluster someone's `ray start` left on the
        # machine (join one with --ray-address auto). Rollout, renderer and env actors mostly wait: logical
        # CPUs above the physical count let them pack.
        ray.init(
            address="local",
            num_cpus=max(4, 2 * (os.cpu_count() or 2)),
            include_dashboard=False,
            log_to_driver=False,
        )
