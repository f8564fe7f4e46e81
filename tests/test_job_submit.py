"""`ray job submit` end to end, as the docs' local development loop writes it (`docs/cluster.md`): a real head
started with the docs' `ray start --head --block ... &`, the `rollouts run` entrypoint submitted with their own
`ray job submit` command, followed with their `ray job logs`, its final status, logs and output file read
back, and the head stopped as their `kill $HEAD` stops it.

The head is this test's own: its own ports and its own `--temp-dir` (so its `ray_current_cluster` file
never redirects another process's `ray.init()` to it), never `ray stop` (which kills every Ray process of
the user, the suite's session Ray included). Its token auth is pinned on with a private token rather than
inferred from whether `~/.ray/auth_token` exists, so the test takes the same path on every machine and
never writes into the user's home. Every process the head starts, the job driver (its own session) and
the stand-in server under it included, inherits a marker variable; teardown kills exactly those.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from readme import argv, block, commands

from rollout_actors.wire import Result

pytestmark = pytest.mark.ray  # a Ray head of its own

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
"""`ray` and `rollouts` of this interpreter: a pyenv shim on PATH could pick another Python by cwd."""

TEST_BUDGET_S = 150.0  # head start + job + teardown; the job takes ~20 s and the head ~7 s on 2 idle cores
HEAD_START_TIMEOUT_S = 45.0  # one `ray start --head`; a port lost to a race is retried once
TEARDOWN_RESERVE_S = 15.0  # SIGTERM grace + SIGKILL + sweep, kept out of the job's share of the budget
TERM_GRACE_S = 1.0  # the driver and stand-in exit on SIGTERM; gcs_server and raylet ignore it for 10 s+
MARKER_VAR = "RAY_ROLLOUTS_JOB_TEST_HEAD"
CLIENT_ONLY_VARS = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE")
"""Dropped from the head's environment: a caller's cluster address or token must not leak into it."""
KINDS = ("ok", "model", "env", "infrastructure", "caller", "cancelled")
README_ADDRESS = "http://127.0.0.1:8275"
"""The job API address the docs' commands use; this test's head listens elsewhere."""
CLUSTER_PAGE = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"
DOCS_STOP_TIMEOUT_S = 40.0  # `ray start --block` drains for up to 30 s on SIGTERM; a second or two when idle

_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy


@dataclass
class LocalHead:
    dashboard_url: str
    token: str
    temp_dir: Path
    deadline: float
    """time.monotonic() by which the test must be done, teardown reserve excluded."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _free_ports(count: int) -> list[int]:
    """Distinct ports free on every interface (gcs_server binds 0.0.0.0). Racy by nature: see the retry."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _head_pids(marker: bytes, session_id: int | None) -> list[int]:
    """Live processes carrying the marker (read raw: psutil returns {} for retitled `ray::` processes)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                marked = marker in environ.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as stat:
                zombie = stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            in_session = session_id is not None and os.getsid(pid) == session_id
        except OSError:
            continue
        if (marked or in_session) and not zombie:
            pids.append(pid)
    return pids


def _kill_head(marker: bytes, session_id: int | None) -> list[int]:
    """SIGTERM, a short grace, then SIGKILL until nothing marked is left; returns the survivors."""
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0), (signal.SIGKILL, 5.0)):
        for pid in _head_pids(marker, session_id):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        until = time.monotonic() + wait_s
        while _head_pids(marker, session_id) and time.monotonic() < until:
            time.sleep(0.2)
    return _head_pids(marker, session_id)


PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--ray-client-server-port",
)
"""The ports the docs' `ray start` names; this test gives each a free one of its own."""


def _dev_loop() -> list[str]:
    loop = commands(block("Local development loop", "bash", path=CLUSTER_PAGE))
    assert "export RAY_AUTH_MODE=token" in loop and "kill $HEAD" in loop and "ray stop" not in loop, loop
    return loop


def _docs_head_command(temp_dir: Path) -> list[str]:
    """The docs' `ray start --head` as written, with this test's own ports and temp dir in place of theirs."""
    (start,) = [argv(c) for c in _dev_loop() if c.startswith("ray start --head")]
    assert start[-1] == "&" and "--block" in start, start  # in the background, as the head's parent
    flags = dict(arg.split("=", 1) for arg in start[3:-1] if "=" in arg)
    assert set(PORT_FLAGS) <= set(flags) and "--temp-dir" in flags, start  # its own ports and temp dir
    ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS)), strict=True))
    command = [str(BIN_DIR / "ray"), "start", "--head"]
    for arg in start[3:-1]:
        flag = arg.split("=", 1)[0]
        if flag in ports:
            arg = f"{flag}={ports[flag]}"
        elif flag == "--temp-dir":
            arg = f"--temp-dir={temp_dir}"
        command.append(arg)
    return command


def _start_head(temp_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """The docs' `ray start --head --block ... &` once; returns (its process, whose pid is the session id of
    every daemon and what `kill $HEAD` signals; the dashboard port)."""
    command = _docs_head_command(temp_dir)
    dashboard = int(next(arg for arg in command if arg.startswith("--dashboard-port=")).split("=")[1])
    log_path = temp_dir / "ray-start.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    # Its "Ray runtime started." sits in a pipe's buffer while it blocks: the dashboard's port answering
    # is the sign it is up (the job API itself is awaited next, with the token).
    until = time.monotonic() + HEAD_START_TIMEOUT_S
    while not _listening(dashboard):
        if process.poll() is not None or time.monotonic() > until:
            tail = log_path.read_text(errors="replace")[-3000:]
            rc = process.poll()
            raise RuntimeError(f"`ray start --head` {'timed out' if rc is None else f'exited {rc}'}:\n{tail}")
        time.sleep(0.2)
    return process, dashboard


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop_head_as_the_docs_do(process: subprocess.Popen, marker: bytes) -> list[int]:
    """`kill $HEAD`: SIGTERM to `ray start --block`, which drains and stops its head; returns what is left
    of the head once that is done (nothing, when the docs are right)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=DOCS_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    until = time.monotonic() + TERM_GRACE_S * 5
    while _head_pids(marker, process.pid) and time.monotonic() < until:
        time.sleep(0.2)
    return _head_pids(marker, process.pid)


def _wait_for_job_api(head: LocalHead) -> None:
    request = urllib.request.Request(f"{head.dashboard_url}/api/version", headers=head.headers)
    while True:
        try:
            with _direct.open(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if head.remaining() < 0:
            raise TimeoutError(f"job API at {head.dashboard_url} never answered")
        time.sleep(0.25)


@pytest.fixture
def local_head() -> Iterator[LocalHead]:
    started = time.monotonic()
    # Short: the head's unix sockets live under it, and their paths may not exceed ~107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    marker = f"{MARKER_VAR}={temp_dir}".encode()
    token = secrets.token_hex(32)
    (temp_dir / "auth_token").write_text(token)
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ONLY_VARS}
    env |= {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(temp_dir / "auth_token"),
        MARKER_VAR: str(temp_dir),
        "PATH": os.pathsep.join((str(BIN_DIR), env.get("PATH", ""))),
    }
    session_id, process, left_by_stop = None, None, []
    try:
        for attempt in range(2):
            try:
                process, dashboard_port = _start_head(temp_dir, env)
                session_id = process.pid
                break
            except RuntimeError:
                _kill_head(marker, session_id=None)  # a half-started head, before its ports are retried
                if attempt == 1:
                    raise
        head = LocalHead(
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
            token=token,
            temp_dir=temp_dir,
            deadline=started + TEST_BUDGET_S - TEARDOWN_RESERVE_S,
        )
        _wait_for_job_api(head)
        yield head
        left_by_stop = _stop_head_as_the_docs_do(process, marker)
    finally:
        survivors = _kill_head(marker, session_id)
        if not survivors:
            shutil.rmtree(temp_dir, ignore_errors=True)
        assert not survivors, f"processes of the test head outlived SIGKILL: {survivors}"
    assert not left_by_stop, f"`kill $HEAD` left processes of the head running: {left_by_stop}"


def _dev_loop_submit() -> tuple[list[str], list[str]]:
    """The docs' `ray job submit` and `ray job logs` commands of the local development loop."""
    loop = _dev_loop()
    (submit,) = [argv(c) for c in loop if c.startswith("ray job submit")]
    (logs,) = [argv(c) for c in loop if c.startswith("ray job logs")]
    return submit, logs


def submit_line() -> str:
    (line,) = [c for c in _dev_loop() if c.startswith("ray job submit")]
    return line


def _at(command: list[str], address: str) -> list[str]:
    """The command against this test's head: its `--address` is the head's, not the default port."""
    return [str(BIN_DIR / "ray"), *[address if arg == README_ADDRESS else arg for arg in command[1:]]]


@pytest.mark.slow
@pytest.mark.timeout(TEST_BUDGET_S + 50)  # backstop only: the test's own deadline fails it first
def test_the_readme_dev_loop_submits_a_rollouts_job_that_succeeds_and_logs_its_summary(local_head):
    """The docs' local development loop, command by command: their `ray start --head` with this test's own
    ports, temp dir and a private token, `export RAY_AUTH_MODE=token` in the commands' environment,
    `ray job submit` and `ray job logs` as written against it, `kill $HEAD` at teardown."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    # The head enforces token auth: the client side must send the token (docs/cluster.md, "Token authentication").
    with pytest.raises(urllib.error.HTTPError) as refused:
        _direct.open(f"{local_head.dashboard_url}/api/jobs/", timeout=10)
    assert refused.value.code == 401

    submit, follow = _dev_loop_submit()
    entrypoint = submit[submit.index("--") + 1 :]
    tasks, group_size = (
        int(entrypoint[entrypoint.index("--tasks") + 1]),
        int(entrypoint[entrypoint.index("--group-size") + 1]),
    )
    # The docs' `--output "$PWD/results.jsonl"`, as the submitting shell expands it: this test's folder.
    assert '"$PWD/results.jsonl"' in submit_line(), submit_line()
    submit = [arg.replace("$PWD", str(local_head.temp_dir)) for arg in submit]
    output = local_head.temp_dir / "results.jsonl"
    assert submit[submit.index("--output") + 1] == str(output), submit
    png = local_head.temp_dir / "report.png"
    submit = _at(submit, local_head.dashboard_url) + ["--report-png", str(png)]
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ONLY_VARS}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(local_head.temp_dir / "auth_token")}
    done = subprocess.run(
        submit, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=max(1, local_head.remaining())
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    job_id = re.search(r"Job '(\S+)' submitted successfully", printed).group(1)

    follow = [job_id if arg == "<job_id>" else arg for arg in _at(follow, local_head.dashboard_url)]
    followed = subprocess.run(follow, env=env, capture_output=True, text=True, timeout=60)
    logs = followed.stdout + followed.stderr
    assert followed.returncode == 0, logs[-4000:]
    client = JobSubmissionClient(address=local_head.dashboard_url, headers=local_head.headers)
    info = client.get_job_info(job_id)
    assert info.status == JobStatus.SUCCEEDED, f"{info.status}: {info.message}\n{logs}"
    assert info.driver_exit_code == 0
    assert info.runtime_env["working_dir"].startswith("gcs://")  # the tree went up with the job

    # The summary the CLI prints (the report's own), read back from the job's logs.
    total = tasks * group_size
    assert "stand-in inference server at http://127.0.0.1:" in logs
    assert f"done {total}/{total}  in flight" in logs  # the plain status line of --no-progress
    assert png.stat().st_size > 10_000, logs  # the run report's plots
    assert f"rollouts: {total} in " in logs, logs  # the report's summary, as `rollouts report` prints it
    assert f"results: {output}\n" in logs, logs  # where the results are, in full
    (by_kind,) = re.findall(r"^by kind: (.*)$", logs, re.MULTILINE)
    table = {kind: int(count) for kind, count in re.findall(r"(\w+)=(\d+)", by_kind)}
    assert set(table) == set(KINDS), logs

    results = [Result.model_validate(json.loads(line)) for line in output.read_text().splitlines()]
    assert len({r.request_id for r in results}) == len(results) == total
    assert sorted(Counter(r.group_id for r in results).values()) == [group_size] * tasks
    assert table == {kind: sum(r.kind == kind for r in results) for kind in KINDS}
    assert table["ok"] == total, logs  # the stand-in injects no faults unless asked to
