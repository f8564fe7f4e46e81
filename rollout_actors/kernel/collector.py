"""How our long-lived actor processes collect garbage, and what it costs them.

A rollout worker holds thousands of rollouts at once, each with its client, connection pool, tasks and
token lists; a renderer holds a tokenizer's vocabulary. CPython's cyclic collector rescans what survives,
and with the default thresholds it ran about 1,400 times per worker in one wave of 2,048 three-turn
rollouts on two cores, taking 3.0 s of the worker's 18 s of CPU (2.2 s of it full collections that walk
every live object, the imported modules included). So an actor, once it has loaded what it serves,
`settle`s: what is alive then (modules, Ray, the tokenizer, the environment) lives as long as the
process and is frozen out of every later scan, and the youngest generation collects every
`YOUNG_THRESHOLD` allocations instead of 700. Cyclic garbage still goes, a little later: at most that
many objects' worth waits for it.

A worker makes almost no cyclic garbage (its collections freed nothing in a wave): what a collection
costs is walking the live objects of the rollouts in flight that it finds in the young generations, and
an object that dies before a collection reaches it costs nothing. At 20,000 a worker still ran ~27
collections taking ~1.45 s of CPU in a wave of 2,048 three-turn rollouts on two cores; at 100,000 more
of them (a model call's, which last seconds) die before a collection reaches them, and it ran 4 taking
~0.6 s (a young collection: ~0.15 s).

Only for processes we own: actors call `settle_actor`, which leaves any other process (a driver, an
orchestrator, a test that builds an actor class in-process) with its own settings. Imports nothing of
the project.
"""

from __future__ import annotations

import gc
import time
from typing import Any

YOUNG_THRESHOLD = 100_000
"""Allocations (net of frees) between two young-generation collections; CPython's default is 700."""
OLDER_THRESHOLDS = (10, 10)
"""CPython's own: a middle collection every 10 young ones, a full one every 10 middle ones (and only
when the survivors since the last one are a quarter of the long-lived objects)."""

_spent: dict[str, Any] = {
    "collections": 0,
    "seconds": 0.0,
    "full": 0,
    "full_seconds": 0.0,
    "middle": 0,
    "middle_seconds": 0.0,
    "collected": 0,
}
"""Every collection since the first `settle`; of them the full ones (generation 2), which walk every
live object that is not frozen (a worker's thousands of rollouts in flight), and the middle ones
(generation 1); and the objects they freed (cyclic garbage: few, so the time goes on walking survivors)."""
_started = 0.0


def settle() -> None:
    """Freeze what this process holds now out of later collections, and collect less often. Call it
    when an actor has loaded what it serves (again after a later load: only what is new is frozen)."""
    if _measure not in gc.callbacks:
        gc.callbacks.append(_measure)
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)


def settle_actor() -> None:
    """`settle` this process if it is a Ray actor's; any other process keeps its own settings."""
    import ray  # Ray is the engine, not the project

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        settle()


def collector_stats() -> dict[str, Any]:
    """Collections run and seconds they took since this process first `settle`d, and how many objects
    are frozen out of them: for `debug_resources` and the benches."""
    return {**_spent, "frozen": gc.get_freeze_count(), "thresholds": gc.get_threshold()}


def _measure(phase: str, info: dict[str, Any]) -> None:
    global _started
    # The collecting thread's own CPU (it holds the GIL throughout): wall time would count the moments
    # a loaded machine gave the process no core.
    if phase == "start":
        _started = time.thread_time()
    else:
        seconds = time.thread_time() - _started
        _spent["collections"] += 1
        _spent["seconds"] += seconds
        _spent["collected"] += info.get("collected", 0)
        if info["generation"] == 1:
            _spent["middle"] += 1
            _spent["middle_seconds"] += seconds
        elif info["generation"] == 2:
            _spent["full"] += 1
            _spent["full_seconds"] += seconds
