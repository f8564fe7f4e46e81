"""The collector policy of our actor processes (`kernel.collector`): what was loaded is frozen out of
collections, young collections run less often, and cyclic garbage is still collected on its own.

Each check runs in a fresh interpreter: the policy is process-wide, and pytest's own process keeps
CPython's defaults."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json, weakref
from rollout_actors.kernel.collector import YOUNG_THRESHOLD, collector_stats, settle

class Node:
    pass

loaded = [Node() for _ in range(50_000)]   # what an actor holds once it has loaded what it serves
before = gc.get_freeze_count()
settle()
frozen = gc.get_freeze_count() - before

alive = []
for _ in range(200_000):                   # cyclic garbage, made by a serving actor
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    alive.append(weakref.ref(a))
survivors = sum(ref() is not None for ref in alive)
stats = collector_stats()
print(json.dumps({"frozen": frozen, "threshold": gc.get_threshold()[0], "young": YOUNG_THRESHOLD,
                  "survivors": survivors, "collections": stats["collections"]}))
"""


def test_a_settled_process_freezes_what_it_loaded_and_still_collects_cycles():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["frozen"] >= 50_000, seen  # the loaded objects are out of every later scan
    assert seen["threshold"] == seen["young"], seen
    # 200k cycles (400k objects, more allocations than that): collected as they go, with far fewer
    # collections than CPython's default threshold of 700 would run (~600+ young collections).
    assert 0 < seen["collections"] < 100, seen
    assert seen["survivors"] < seen["young"], seen  # at most one threshold's worth waits for collection


def test_a_process_that_is_not_a_ray_actor_keeps_its_own_collector_settings():
    """Actors call `settle_actor`: a driver, an orchestrator or a test that builds an actor class in
    its own process (a `RendererActor` loads its tokenizer there too) is left as it was."""
    script = (
        "import gc, json; from rollout_actors.kernel.collector import settle_actor; "
        "before = (gc.get_threshold(), gc.get_freeze_count()); settle_actor(); "
        "print(json.dumps([before, (gc.get_threshold(), gc.get_freeze_count())]))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout)
    assert after == before, (before, after)
