"""A heap probe for `_bench_worker_memory.py`, installed in every Ray worker process the bench starts
(`worker_process_setup_hook`). Nothing here is in the product. A thread waits for the trigger files the
bench writes under `$BENCH_HEAP_DIR`: `base` starts tracemalloc and takes the baseline (snapshot, RSS),
`snap` compares a second snapshot with it and writes the top lines to `<pid>.txt`."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

DIR_VAR = "BENCH_HEAP_DIR"


def install() -> None:
    folder = os.environ.get(DIR_VAR)
    if folder:
        threading.Thread(target=_watch, args=(folder,), daemon=True).start()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _watch(folder: str) -> None:
    import gc
    import tracemalloc

    base = os.path.join(folder, "base")
    snap = os.path.join(folder, "snap")
    while not os.path.exists(base):
        time.sleep(0.2)
    gc.collect()
    rss0, blocks0 = _rss(), sys.getallocatedblocks()
    if os.environ.get("BENCH_HEAP_FRAMES", "1") == "0":  # no tracemalloc: RSS, blocks, objects by type
        types0 = Counter(type(o).__name__ for o in gc.get_objects())
        while not os.path.exists(snap):
            time.sleep(0.2)
        n = int(open(snap).read() or "1")
        rss1, blocks1 = _rss(), sys.getallocatedblocks()
        types1 = Counter(type(o).__name__ for o in gc.get_objects())
        lines = [
            f"pid {os.getpid()} rss {rss0 >> 20} -> {rss1 >> 20} MiB ({(rss1 - rss0) / n / 1024:.1f} KB/rollout);"
            f" pymalloc blocks {(blocks1 - blocks0) / n:.0f}/rollout; n={n}"
        ]
        diff = sorted(((types1[t] - types0[t]) / n, t) for t in types1)[::-1][:25]
        lines += [f"{count:8.2f} {name}/rollout (gc-tracked)" for count, name in diff if count > 0]
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return
    tracemalloc.start(int(os.environ.get("BENCH_HEAP_FRAMES", "1")))
    before = tracemalloc.take_snapshot()
    while not os.path.exists(snap):
        time.sleep(0.2)
    n = int(open(snap).read() or "1")
    rss1 = _rss()
    traced = tracemalloc.get_traced_memory()[0]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    key = "lineno" if os.environ.get("BENCH_HEAP_FRAMES", "1") == "1" else "traceback"
    lines = [f"pid {os.getpid()} rss {rss0 >> 20} -> {rss1 >> 20} MiB; traced {traced >> 20} MiB; n={n}"]
    for stat in after.compare_to(before, key)[:60]:
        if stat.size_diff <= 0:
            continue
        where = " <- ".join(f.strip() for f in reversed(stat.traceback.format()[::2]))
        lines.append(f"{stat.size_diff / n:8.0f} B/rollout {stat.count_diff / n:6.2f} blocks {where}")
    with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
