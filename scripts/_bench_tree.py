"""CPU seconds and peak RSS of a process and all its descendants over a benchmark's load, sampled from a
thread; and stopping such a tree. For `bench_serve_env.py`.

    meter = TreeMeter(server.pid, kind_of=lambda proc: proc.name())
    meter.begin()                 # the first sample: what each process had spent before the load
    ...                           # the load
    by_kind = meter.end()         # {kind: (processes, CPU seconds during the load)}; meter.peak_rss
    stop_tree(server)             # SIGTERM, then SIGKILL whatever of its tree is left

A process that exits during the load keeps its last sample; one that lives less than `SAMPLE_S` may go
uncounted. RSS sums each process's resident set (shared pages counted in each).
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SAMPLE_S = 1.0
STOP_WAIT_S = 60.0  # a server's own shutdown (Ray's included) before it is killed


@dataclass
class TreeMeter:
    """CPU seconds and peak RSS of a process and its descendants, sampled from a thread."""

    root: int
    kind_of: Callable[[Any], str]
    start: dict[tuple[int, float], float] = field(default_factory=dict)
    last: dict[tuple[int, float], tuple[str, float]] = field(default_factory=dict)
    peak_rss: int = 0
    peak_rss_by_kind: dict[str, int] = field(default_factory=dict)
    kinds_at_start: dict[tuple[int, float], str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self) -> dict[tuple[int, float], tuple[str, float, int]]:
        import psutil

        seen = {}
        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return seen
        for proc in procs:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    key = (proc.pid, proc.create_time())
                    seen[key] = (self.kind_of(proc), times.user + times.system, proc.memory_info().rss)
            except psutil.Error:
                continue
        return seen

    def begin(self) -> None:
        seen = self._sample()
        self.start = {key: cpu for key, (_, cpu, _) in seen.items()}
        self.kinds_at_start = {key: kind for key, (kind, _, _) in seen.items()}
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            seen = self._sample()
            self.last.update({key: (kind, cpu) for key, (kind, cpu, _) in seen.items()})
            if (total := sum(rss for _, _, rss in seen.values())) > self.peak_rss:
                self.peak_rss, self.peak_rss_by_kind = total, {}
                for kind, _, rss in seen.values():
                    self.peak_rss_by_kind[kind] = self.peak_rss_by_kind.get(kind, 0) + rss
            if self._stop.wait(SAMPLE_S):
                return

    def end(self) -> dict[str, tuple[int, float]]:
        """CPU seconds spent during the load, by kind of process: {kind: (processes, seconds)}."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        seen = self._sample()
        self.last.update({key: (kind, cpu) for key, (kind, cpu, _) in seen.items()})
        kinds: dict[str, tuple[int, float]] = {}
        for key, (kind, cpu) in self.last.items():
            n, total = kinds.get(kind, (0, 0.0))
            kinds[kind] = (n + 1, total + cpu - self.start.get(key, 0.0))
        return kinds


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the side's server (each ends its own children), then SIGKILL whatever of its tree is left."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    _, alive = psutil.wait_procs(descendants, timeout=20)
    for leftover in alive:
        try:
            leftover.kill()
        except psutil.Error:
            pass
