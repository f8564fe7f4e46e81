"""Resource sampling for `bench_plane.py`, in a separate process so it never takes the GIL or the event
loop of the process being measured (psutil parses /proc/net/tcp in Python: tens of ms with 4k sockets).

    probe = Probe(server_pid=..., server_port=..., pids=[...]).start()
    ...                                   # the workload
    sample = probe.stop()                 # ProbeSample: peaks, distinct client ports

It samples every `interval_s`: the stand-in server's ESTABLISHED sockets on its port (count, and every
client port seen, i.e. connections opened) and the threads and RSS of the measured processes. A connection
that opens and closes between two samples is missed; each one here lives at least one model call (>= the
set latency), so sampling every 0.5 s sees them all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass, field

import psutil

SAMPLE_INTERVAL_S = 0.5
STOP_TIMEOUT_S = 30.0


@dataclass
class ProbeSample:
    peak_server_sockets: int = 0
    """Most ESTABLISHED sockets the server held on its port at one sample."""
    client_ports: set[int] = field(default_factory=set)
    """Every client port seen connected to the server: connections opened (ports are not reused while
    their previous socket sits in TIME_WAIT, 60 s on Linux)."""
    peak_threads: int = 0
    """Most OS threads summed over the measured processes at one sample."""
    peak_rss: int = 0
    """Most RSS (bytes) summed over the measured processes at one sample."""
    per_process: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """pid -> its own peaks: (OS threads, RSS bytes, open file descriptors); the server's fds included."""
    samples: int = 0


def _sample_loop(
    server_pid: int,
    server_port: int,
    pids: list[int],
    stop: mp.Event,
    out: mp.Queue,
    interval_s: float,
    server_sockets: bool,
) -> None:
    result = ProbeSample()
    server = psutil.Process(server_pid)
    procs = [psutil.Process(pid) for pid in pids]
    while True:
        try:
            _peak(result, server)
            if server_sockets:
                conns = [
                    c
                    for c in server.net_connections(kind="tcp")
                    if c.status == psutil.CONN_ESTABLISHED
                    and c.laddr
                    and c.laddr.port == server_port
                    and c.raddr
                ]
                result.peak_server_sockets = max(result.peak_server_sockets, len(conns))
                result.client_ports.update(c.raddr.port for c in conns)
        except psutil.Error:
            pass
        threads = rss = 0
        for proc in procs:
            try:
                proc_threads, proc_rss = _peak(result, proc)
            except psutil.Error:
                continue
            threads += proc_threads
            rss += proc_rss
        result.peak_threads = max(result.peak_threads, threads)
        result.peak_rss = max(result.peak_rss, rss)
        result.samples += 1
        if stop.wait(interval_s):
            break
    out.put(result)


def _peak(result: ProbeSample, proc: psutil.Process) -> tuple[int, int]:
    """Record one process's threads, RSS and open fds in its own peaks; returns (threads, RSS)."""
    with proc.oneshot():
        threads, rss, fds = proc.num_threads(), proc.memory_info().rss, proc.num_fds()
    old = result.per_process.get(proc.pid, (0, 0, 0))
    result.per_process[proc.pid] = (max(old[0], threads), max(old[1], rss), max(old[2], fds))
    return threads, rss


class Probe:
    """`server_sockets=False` skips the scan of the server's sockets (psutil parses every TCP socket of the
    machine in Python: a large share of a core with 16k connections each way); the server's open fds,
    sampled for every process, then stand for its connections."""

    def __init__(
        self,
        server_pid: int,
        server_port: int,
        pids: list[int],
        interval_s: float = SAMPLE_INTERVAL_S,
        server_sockets: bool = True,
    ) -> None:
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._out: mp.Queue = ctx.Queue()
        args = (server_pid, server_port, pids, self._stop, self._out, interval_s, server_sockets)
        self._process = ctx.Process(target=_sample_loop, args=args, daemon=True)

    def start(self) -> Probe:
        self._process.start()
        return self

    def stop(self) -> ProbeSample:
        self._stop.set()
        try:
            return self._out.get(timeout=STOP_TIMEOUT_S)
        finally:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()


def time_wait_count(port: int) -> int:
    """TCP sockets in TIME_WAIT to or from `port`, machine-wide (they belong to no process any more)."""
    return sum(
        1
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_TIME_WAIT
        and ((c.laddr and c.laddr.port == port) or (c.raddr and c.raddr.port == port))
    )


def process_resources(pid: int) -> tuple[int, int]:
    """(OS threads, RSS bytes) of one process now."""
    proc = psutil.Process(pid)
    return proc.num_threads(), proc.memory_info().rss


def _role(proc: psutil.Process, me: int, server_pid: int) -> str | None:
    cmdline = proc.cmdline()
    if not cmdline:
        return None
    first = cmdline[0].split()[0] if cmdline[0].strip() else ""
    if proc.pid == me:
        return "driver"
    if proc.pid == server_pid:
        return "stand-in"
    if first.startswith("ray::"):
        return first.split(".")[0].removeprefix("ray::")
    if any(part.endswith(("raylet", "gcs_server")) for part in cmdline[:1]) or "ray/" in " ".join(
        cmdline[:2]
    ):
        return "ray daemons"
    return None


def _ours() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def pids_by_role(server_pid: int, roles: tuple[str, ...]) -> dict[str, list[int]]:
    """The pids of this process and its descendants playing each of `roles` (see `cpu_by_role`)."""
    found: dict[str, list[int]] = {}
    me = os.getpid()
    for proc in _ours():
        try:
            role = _role(proc, me, server_pid)
        except psutil.Error:
            continue
        if role in roles:
            found.setdefault(role, []).append(proc.pid)
    return found


def cpu_by_role(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far, by role: this process, the stand-in server, each Ray actor
    class (`ray::EnvServer`, ...), and Ray's own daemons. Only this process and its descendants count (the
    local Ray cluster it started, the stand-ins it launched): other clusters on a shared machine are not
    ours. Diff two snapshots for a wave's cost; a process that exits between them (a retired renderer) is
    missed."""
    roles: dict[str, float] = {}
    me = os.getpid()
    for proc in _ours():
        try:
            role = _role(proc, me, server_pid)
            if role is None:
                continue
            times = proc.cpu_times()
        except psutil.Error:
            continue
        roles[role] = roles.get(role, 0.0) + times.user + times.system
    return roles
