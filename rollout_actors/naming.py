"""Names of the shared actors a plane starts, so its workers can find them.

A plane owns its renderer pool and env pools (they fate-share with the driver that runs the plane); the
names carry the plane's prefix so two planes in one cluster never share a pool by accident.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from rollout_actors.wire import Ref


@dataclass(frozen=True)
class PoolNames:
    prefix: str

    @property
    def renderer_pool(self) -> str:
        return f"{self.prefix}/renderer-pool"

    def env_pool(self, env: Ref) -> str:
        return f"{self.prefix}/env-pool/{env_key(env)}"


def env_key(env: Ref) -> str:
    """Canonical key of an environment Ref: same target and config -> same pool."""
    canonical = json.dumps(env.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(canonical.encode()).hexdigest()[:12]
