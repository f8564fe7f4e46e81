"""Start the bundled stand-in inference server as a subprocess and own it until `close()`.

    with StandinServer(StandinOptions(latency_s=0.05, correct_rate=1.0)) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x")
        ...

The server binds a free loopback port itself and reports it through a port file (no window in which
another process could take a port picked here). `start()` returns once `/health` answers 200, which the
server only does once its tokenizer is loaded (readiness means loaded); if the process dies first or the
deadline passes it raises `StandinStartupError` with the exit code and the tail of the server's log.
The server exits on its own if this process dies without stopping it (`--parent-pid`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import rollout_actors
from rollout_actors.inference.standin.server import StandinOptions
from rollout_actors.kernel.renamed import warn_renamed

__all__ = ["StandinOptions", "StandinServer", "StandinStartupError"]

READY_TIMEOUT_S = 120.0  # the first run on a machine builds the tokenizer cache (10-20 s, slower when busy)
STOP_GRACE_S = 5.0  # SIGTERM first: uvicorn drains for 2 s; then SIGKILL
POLL_S = 0.05
LOG_TAIL_CHARS = 4000


class StandinStartupError(RuntimeError):
    """The stand-in server died or did not become ready in time."""

    def __init__(self, message: str, exit_code: int | None, log_tail: str) -> None:
        super().__init__(f"{message} (exit code {exit_code}); server log tail:\n{log_tail}")
        self.exit_code = exit_code
        self.log_tail = log_tail


class StandinServer:
    """One stand-in server process. Owns the process and its log directory; `close()` releases both."""

    def __init__(
        self,
        options: StandinOptions = StandinOptions(),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready_timeout_s: float = READY_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: added to the server's environment (e.g. `VLLM_API_KEY`, which it reads as vLLM does).
        `port`: 0 (the default) lets the server bind a free one and report it."""
        self.options = options
        self.env = dict(env or {})
        self.host = host
        self.requested_port = port
        self.ready_timeout_s = ready_timeout_s
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._deadline = 0.0

    @property
    def url(self) -> str:
        """`http://host:port`, without `/v1` (health, metrics, admin endpoints live here)."""
        if self.port is None:
            raise RuntimeError("the stand-in server is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, ending in `/v1`."""
        return f"{self.url}/v1"

    @property
    def log_path(self) -> Path | None:
        return self._workdir / "server.log" if self._workdir else None

    @property
    def _port_file(self) -> Path:
        assert self._workdir is not None
        return self._workdir / "port"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, wait: bool = True) -> StandinServer:
        """Launch the process; with `wait` (the default) also `wait_ready()`. Launch several with
        `wait=False`, then wait for each: they load in parallel."""
        if self._process is not None:
            raise RuntimeError("the stand-in server is already started")
        self._workdir = Path(tempfile.mkdtemp(prefix="standin-"))
        command = [sys.executable, "-m", "rollout_actors.inference.standin", "--host", self.host]
        command += [
            "--port",
            str(self.requested_port),
            "--port-file",
            str(self._port_file),
            "--parent-pid",
            str(os.getpid()),
        ]
        command += self.options.to_argv()
        with open(self._workdir / "server.log", "wb") as log:
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_child_env() | self.env,
            )
        self._deadline = time.monotonic() + self.ready_timeout_s
        return self.wait_ready() if wait else self

    def wait_ready(self) -> StandinServer:
        """Block until `/health` answers 200. Raises `StandinStartupError` (and stops the process) if it
        exits first or the startup deadline passes."""
        if self._process is None:
            raise RuntimeError("the stand-in server is not started")
        try:
            self._wait_ready(self._port_file, self._deadline)
        except Exception as exc:
            tail, code = self.log_tail(), self._process.poll()  # code None: alive but not ready in time
            self.close()
            raise StandinStartupError(f"stand-in server did not become ready: {exc}", code, tail) from None
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, port_file: Path, deadline: float) -> None:
        assert self._process is not None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError("the process exited")
            if self.port is None and port_file.exists():
                self.port = int(port_file.read_text())
            if self.port is not None and _health_ok(self.url, max(0.1, deadline - time.monotonic())):
                return
            time.sleep(POLL_S)
        raise TimeoutError(f"not ready within {self.ready_timeout_s:g} s")

    def exit_code(self) -> int | None:
        """The process's exit code once it has exited; None while it runs (or was never started)."""
        return self._process.poll() if self._process is not None else None

    def session_counts(self) -> dict[str, int]:
        """Requests per `X-Session-ID` this server has seen (which rollouts it served)."""
        with _direct.open(f"{self.url}/admin/sessions", timeout=10.0) as response:
            return json.loads(response.read())["sessions"]

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - chars))
            return f.read().decode(errors="replace")

    def close(self) -> int | None:
        """SIGTERM, then SIGKILL after a grace period. Idempotent; returns the exit code (None if it was
        not running)."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self.port = None
        return code

    def stop(self) -> int | None:
        """The old name of `close` (docs/design.md, "Words": close is the one stop verb)."""
        warn_renamed("StandinServer.stop()", "close()")
        return self.close()

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _child_env() -> dict[str, str]:
    """The child imports the same `rollout_actors` as this process, installed or not."""
    env = dict(os.environ)
    root = str(Path(rollout_actors.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy


def _health_ok(url: str, timeout: float) -> bool:
    try:
        with _direct.open(f"{url}/health", timeout=min(timeout, 2.0)) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
