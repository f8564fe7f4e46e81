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
    """Canonical key of an environment Ref: same target and config -> same pool."""
    return hashlib.sha1(canonical_json(env.model_dump(mode="json"))).hexdigest()[:12]


def canonical_json(data: object) -> bytes:
    """`data` as JSON with sorted keys and no spaces, the spelling the plane hashes into keys (pool names,
    prefix keys). orjson, as a few keys are hashed per dispatch (the json module's sorted encoding was a
    tenth of a wave's driver CPU); what orjson refuses (an int past 64 bits) takes the json module's."""
    try:
        return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
