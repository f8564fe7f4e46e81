"""Agent environments: the environment owns the model loop, the rollout still owns every token.

An `AgentEnvironment` runs an agent program (an async function in this process, or a subprocess) that
calls an OpenAI-compatible endpoint itself, as often as it likes, with the whole conversation each time.
A rollout in agent mode (`RolloutRequest.mode = "agent"`) serves it that endpoint: a base URL and a key
valid for that rollout alone (`AgentEndpoint`); every call is one turn of the rollout, rendered, sampled
with the rollout's own client and recorded token-exact (`rollout_actors.rollout.agent`). The session's life on
the `EnvServer`::

    start = await env.reset(task)                 # Reset(messages, state): messages are for the record
    await env.run_agent(start.state, endpoint)    # the agent's whole episode; returns when it is done
    score = await env.score(start.state)
    await env.close(start.state)                  # also when the agent failed or the rollout was cancelled

`run_agent` runs under the rollout's deadline and is cancelled when the rollout ends (its session is
closed), so an agent never outlives its rollout: `run_program` kills a subprocess agent's whole process
group on every exit path. An agent that raises, exits non-zero, makes no call at all or runs out of time
fails the rollout as the environment's fault (`AgentFailed`, with its output tail, the key blanked out).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import signal
import ssl
import sys
import traceback
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psutil

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover - openai 1.x / 2.x
    import httpx

from env_actors.interface import Environment, Message, StepOut
from rollout_actors.kernel import REDACTED, CallerError

if TYPE_CHECKING:  # imported by `client()`: the SDK costs every env server ~1.5 s of start on 2 cores
    import openai

OUTPUT_TAIL_CHARS = 4000  # of an agent's output, kept for its failure message: the end is what explains it
KILL_GRACE_S = 2.0  # SIGTERM, then this long, then SIGKILL: an agent that ignores SIGTERM still ends
END_POLL_S = 0.02  # how often an ending program's processes are looked at: a few polls end most
AGENT_GUARD_SLACK_S = 1.0
"""The agent's own deadline ends this long before its call's (the `EnvServer`'s guard), so the agent's
failure, with its output tail, is what a rollout reports, not a bare deadline."""
AGENT_CLIENT_TIMEOUT_S = 600.0  # what `AgentEndpoint.client()` waits per call: the endpoint bounds it too


class AgentFailed(Exception):
    """The agent program failed: raised, exited non-zero, made no call, ran past its deadline. The
    environment's fault; the message carries the agent's output tail (its key blanked out)."""


@dataclass(frozen=True)
class AgentEndpoint:
    """What an agent is given: an OpenAI-compatible base URL and key valid for one rollout only, and the
    model name to send (the endpoint samples the rollout's model whatever name arrives)."""

    base_url: str
    api_key: str = field(repr=False)
    model: str
    _clients: list[openai.AsyncOpenAI] = field(default_factory=list, repr=False, compare=False)
    _output: deque[str] = field(default_factory=deque, repr=False, compare=False)
    """What the agent program wrote (stdout and stderr as they came), trimmed to `OUTPUT_TAIL_CHARS`."""

    def client(self, **options: Any) -> openai.AsyncOpenAI:
        """An `AsyncOpenAI` client for this endpoint, closed when the agent's run ends (an in-process
        agent need not close it; it may build its own instead). Cheap: no TLS state is built for it, and
        no proxy from the environment stands between the agent and its endpoint."""
        import openai

        options.setdefault("timeout", AGENT_CLIENT_TIMEOUT_S)
        options.setdefault("max_retries", 0)  # a retried call would be a second turn of the same prompt
        if "http_client" not in options:
            # A default client loads the CA bundle (~47 ms of CPU, docs/design.md contract 6): per rollout, on
            # the env server, that was most of agent mode's CPU per turn (scripts/bench_agent.py).
            options["http_client"] = httpx.AsyncClient(
                verify=_ssl_context(), timeout=options["timeout"], trust_env=False
            )
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **options)
        self._clients.append(client)
        return client

    def environ(self) -> dict[str, str]:
        """The variables the official SDKs read: a subprocess agent's `OpenAI()` finds its endpoint (and
        reaches it directly, whatever proxy the node's environment names)."""
        host = urlsplit(self.base_url).hostname or ""
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), host]))
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "OPENAI_MODEL": self.model,
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }

    def record_output(self, text: str) -> None:
        self._output.append(text)
        size = sum(map(len, self._output))
        while len(self._output) > 1 and size - len(self._output[0]) >= OUTPUT_TAIL_CHARS:
            size -= len(self._output.popleft())

    def output_tail(self) -> str:
        """The last `OUTPUT_TAIL_CHARS` the agent program wrote, its key blanked out."""
        return self.redact("".join(self._output)[-OUTPUT_TAIL_CHARS:])

    def redact(self, text: str) -> str:
        return text.replace(self.api_key, REDACTED) if self.api_key else text

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> AgentEndpoint:
        return cls(base_url=value["base_url"], api_key=value["api_key"], model=value["model"])

    async def aclose(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()


@cache
def _ssl_context() -> ssl.SSLContext:
    """One client SSL context per process, never mutated (an endpoint is plain HTTP; a client insists)."""
    return ssl.create_default_context()


class AgentEnvironment(Environment):
    """Base class of environments whose agent owns the loop. Implement `num_tasks`, `task`, `reset`,
    `run_agent` and `score` (and `close` if the session holds anything). `step` is refused: such an
    environment runs only in agent mode."""

    @abc.abstractmethod
    async def run_agent(self, state: Any, endpoint: AgentEndpoint) -> None:
        """Run the agent's whole episode against `endpoint`, keeping what `score` needs in `state`."""

    async def step(self, state: Any, assistant_message: Message) -> StepOut:
        raise CallerError(f"{type(self).__name__} runs its own agent: request it with mode='agent'")


async def run_agent_session(env: Any, state: Any, endpoint: AgentEndpoint, timeout: float) -> dict[str, Any]:
    """The `EnvServer`'s side of an agent session: run the environment's agent within `timeout` and turn
    every way it can fail into `AgentFailed` (redacted, with the program's output tail), never letting its
    clients outlive the run. Answers `{"output_tail": ...}` (the rollout reports it if the agent made no
    call)."""
    if not hasattr(env, "run_agent"):
        raise CallerError(f"{type(env).__name__} is not an agent environment: it has no run_agent")
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            await env.run_agent(state, endpoint)
    except TimeoutError as exc:
        why = f"the agent did not finish within its {timeout:.3g} s" if scope.expired() else _described(exc)
        raise AgentFailed(_with_tail(endpoint.redact(why), endpoint)) from None
    except CallerError as exc:
        raise CallerError(endpoint.redact(str(exc))) from None
    except Exception as exc:  # the agent's own bug: reported with its traceback text, key blanked out
        why = str(exc) if isinstance(exc, AgentFailed) else _described(exc)
        raise AgentFailed(_with_tail(endpoint.redact(why), endpoint)) from None
    finally:
        await endpoint.aclose()
    return {"output_tail": endpoint.output_tail()}


def _with_tail(message: str, endpoint: AgentEndpoint) -> str:
    tail = endpoint.output_tail()
    return f"{message}; output tail:\n{tail}" if tail and tail not in message else message


def _described(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"the agent raised {type(exc).__name__}: {exc}\n{text[-OUTPUT_TAIL_CHARS:]}"


# ------------------------------------------------------------------------------------ subprocesses


@dataclass
class ProgramRun:
    """A finished subprocess agent: its exit status and output."""

    returncode: int
    stdout: str
    """Everything the program wrote to stdout (bounded by `max_output_chars`)."""
    tail: str
    """The last `OUTPUT_TAIL_CHARS` of stdout and stderr together, as written."""


async def run_program(
    argv: Sequence[str],
    endpoint: AgentEndpoint,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    max_output_chars: int = 1_000_000,
) -> ProgramRun:
    """Run an agent program to its exit with the endpoint in its environment (`OPENAI_BASE_URL`,
    `OPENAI_API_KEY`, `OPENAI_MODEL`). A non-zero exit raises `AgentFailed` with the output tail. The
    program runs in its own process group, which is killed (SIGTERM, then SIGKILL after `KILL_GRACE_S`)
    whenever this coroutine ends, with the descendants that left it; the coroutine ends (returns, raises,
    or is cancelled) only once they are gone."""
    environ = {**os.environ, **(env or {}), **endpoint.environ()}
    stdout: list[str] = []
    kept = 0
    async with _process_group(argv, environ, stdin is not None) as process:

        async def pump(stream: asyncio.StreamReader, keep: bool) -> None:
            nonlocal kept
            while chunk := await stream.read(65536):
                text = chunk.decode("utf-8", "replace")
                endpoint.record_output(text)
                if keep and kept < max_output_chars:
                    stdout.append(text)
                    kept += len(text)

        assert process.stdout is not None and process.stderr is not None
        if stdin is not None:
            assert process.stdin is not None
            process.stdin.write(stdin.encode())
            with contextlib.suppress(ConnectionError):
                await process.stdin.drain()
            process.stdin.close()
        await asyncio.gather(pump(process.stdout, True), pump(process.stderr, False))
        returncode = await process.wait()
    if returncode != 0:
        how = f"signal {-returncode}" if returncode < 0 else f"status {returncode}"
        raise AgentFailed(f"agent program {argv[0]!r} exited with {how}")
    return ProgramRun(returncode, endpoint.redact("".join(stdout)), endpoint.output_tail())


@contextlib.asynccontextmanager
async def _process_group(argv: Sequence[str], environ: dict[str, str], stdin: bool) -> AsyncIterator[Any]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environ,
        start_new_session=True,  # its own process group: whatever it forks is killed with it
    )
    try:
        yield process
    finally:
        # Awaited to the end even through a second cancel: the run ends only once its processes did.
        ending = asyncio.ensure_future(_end_program(process))
        cancelled = False
        while not ending.done():
            try:
                await asyncio.shield(ending)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError


async def _end_program(process: Any) -> None:
    """End the agent program and every process it started: its process group (also when the program has
    exited, since a child it left behind is still in the group) and its descendants that left the group (a
    child that made a session of its own), found before any is signalled. SIGTERM, then SIGKILL after the
    grace; returns once the program is reaped and none of the others runs (an orphan is left a zombie at
    most: reaping it is its new parent's job), or after the grace of SIGKILL (a process stuck in the kernel).
    A descendant that left both the group and the tree (a double fork whose middle exited) is out of reach."""
    if process.returncode is not None and not _group_alive(process.pid):
        return  # the common end: the program exited and left nothing behind
    started: dict[int, psutil.Process] = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # Found again before SIGKILL (a child forked during the grace), keeping those found before SIGTERM:
        # once the program is gone, the descendants that left its group are no longer its descendants.
        started.update({p.pid: p for p in _started_by(process.pid) if p.pid not in started})
        for child in started.values():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(child.pid) != process.pid:  # the group's members get it from killpg, once
                    child.send_signal(sig)  # psutil checks the pid is still the process it found
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        if await _ended(process, list(started.values()), KILL_GRACE_S):
            return


def _started_by(leader: int) -> list[psutil.Process]:
    """The live processes of the program's group and of its process tree, the program included."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(leader)
        found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for candidate in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if candidate.pid not in found and os.getpgid(candidate.pid) == leader:
                found[candidate.pid] = candidate
    return list(found.values())


async def _ended(process: Any, started: list[psutil.Process], grace: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while True:
        if process.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), max(0.0, min(END_POLL_S, deadline - loop.time())))
        if process.returncode is not None and not any(_running(p) for p in started):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(END_POLL_S)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def python_program(path: str, *args: str) -> list[str]:
    """argv running a Python agent program with this interpreter (it sees this environment's packages)."""
    return [sys.executable, path, *args]


def last_json_line(stdout: str) -> Any:
    """The last line of a program's stdout that parses as JSON (a program's way to report its answer)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AgentFailed("the agent program printed no JSON answer on stdout")
