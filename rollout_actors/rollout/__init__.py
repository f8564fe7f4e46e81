"""The rollout itself: the `RolloutWorker` actor, the rollout loop, its turn strategies and model
calls (agent mode, where the environment's agent drives the turns, in `agent/`), its per-rollout client,
and how a failure is classified before it leaves the worker."""

from __future__ import annotations

import importlib
from typing import Any

from rollout_actors.kernel.renamed import warn_renamed


def __getattr__(name: str) -> Any:
    # This folder took the name of the old `rollout_actors.rollout` module, now `rollout.loop`.
    loop = importlib.import_module(f"{__name__}.loop")

    if name.startswith("__") or not hasattr(loop, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_renamed(f"{__name__}.{name}", f"{loop.__name__}.{name}")
    return getattr(loop, name)
