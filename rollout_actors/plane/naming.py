"""Names of the shared actors a plane starts, so its workers can find them.

A plane owns its renderer pool and env pools (they fate-share with the driver that runs the plane); the
names carry the plane's prefix so two planes in one cluster never share a pool by accident.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import orjson

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
    """Canonical key of an environment Ref: same target and config -> same pool. Asked several times per
    dispatch, so encoded by orjson (the json module's sorted encoding was a tenth of a wave's driver CPU);
    a config orjson refuses (an int past 64 bits) takes the json module's spelling."""
    data = env.model_dump(mode="json")
    try:
        canonical = orjson.dumps(data, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha1(canonical).hexdigest()[:12]
