"""py-spy over a benchmark wave: one `py-spy record` per process of interest, started when the wave starts
and stopped when it ends, written as collapsed stacks (`-f raw`) and summarised per role.

    profiler = WaveProfiler(out_dir, roles={"RolloutWorker": [pid, ...], ...}).start()
    ...                                   # the wave
    profiler.stop()                       # writes <role>-<pid>.txt, then prints a summary per role

Sampling is `--nonblocking` (the measured process is never paused) and `--gil` (only stacks holding the
GIL: where a process spends its CPU, not where it waits). The summary of a role lists the functions with
the most samples on the stack ("inclusive") and at the top of it ("self").

    python scripts/_bench_profile.py DIR [--top 25]     # summarise files written earlier
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
from pathlib import Path

RATE_HZ = 100
STOP_TIMEOUT_S = 30.0


class WaveProfiler:
    def __init__(self, out_dir: str | Path, roles: dict[str, list[int]]) -> None:
        self.out_dir = Path(out_dir)
        self.roles = roles
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> WaveProfiler:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._threads_before = {pid: thread_cpu(pid) for pids in self.roles.values() for pid in pids}
        for role, pids in self.roles.items():
            for pid in pids:
                out = self.out_dir / f"{role}-{pid}.txt"
                cmd = ["py-spy", "record", "-p", str(pid), "-f", "raw", "-o", str(out), "-r", str(RATE_HZ)]
                cmd += ["--nonblocking", "--gil", "-F"]
                self._procs.append(
                    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
        return self

    def stop(self) -> None:
        threads: dict[str, collections.Counter[str]] = {}
        for role, pids in self.roles.items():
            per_name = threads.setdefault(role, collections.Counter())
            for pid in pids:
                before = self._threads_before.get(pid, {})
                for (tid, name), sec in thread_cpu(pid).items():
                    per_name[name] += sec - before.get((tid, name), 0.0)
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self._procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(summarise(self.out_dir))
        print("\nCPU seconds of the wave by thread name (all threads, native ones included):")
        for role, per_name in threads.items():
            shown = ", ".join(f"{name} {sec:.1f}" for name, sec in per_name.most_common() if sec >= 0.05)
            print(f"  {role}: {sum(per_name.values()):.1f} s: {shown}")


def thread_cpu(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds (user + system) of each thread of `pid` so far, keyed by (tid, thread name)."""
    out: dict[tuple[int, str], float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _frames(stack: str) -> list[str]:
    return [frame.split(" (")[0].strip() + " " + _where(frame) for frame in stack.split(";") if frame]


def _where(frame: str) -> str:
    inside = frame[frame.find("(") + 1 : frame.rfind(")")] if "(" in frame else ""
    return f"({os.path.basename(inside.split(':')[0])})" if inside else ""


def summarise(out_dir: str | Path, top: int = 25) -> str:
    by_role: dict[str, list[Path]] = collections.defaultdict(list)
    for path in sorted(Path(out_dir).glob("*.txt")):
        by_role[path.stem.rsplit("-", 1)[0]].append(path)
    lines = []
    for role, paths in by_role.items():
        inclusive: collections.Counter[str] = collections.Counter()
        own: collections.Counter[str] = collections.Counter()
        total = 0
        for path in paths:
            for line in path.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if not count.isdigit():
                    continue
                n = int(count)
                total += n
                frames = _frames(stack)
                for frame in set(frames):
                    inclusive[frame] += n
                if frames:
                    own[frames[-1]] += n
        lines.append(
            f"\n--- {role}: {total} samples at {RATE_HZ} Hz ({total / RATE_HZ:.1f} CPU-s holding the GIL)"
        )
        lines.append("  inclusive:")
        lines += [f"    {n / max(total, 1):6.1%}  {frame}" for frame, n in inclusive.most_common(top)]
        lines.append("  self:")
        lines += [f"    {n / max(total, 1):6.1%}  {frame}" for frame, n in own.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    sys.stdout.write(summarise(args.dir, args.top) + "\n")
