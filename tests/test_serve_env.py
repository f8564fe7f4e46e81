"""`rollouts serve-env`, judged by verifiers' own code: verifiers 0.4.0's `EnvClient` (prime-rl's client),
in the verifiers stack's interpreter, runs the same tasks with the same sampling against the same stand-in
through the front and through verifiers' own `serve_env` (a lone `EnvServer` and its elastic pool); the
assembled `WireEpisode`s are equal field by field except ids and times. Faults kill real actors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from framework_stacks import (
    FRAMEWORK_ENVS,
    FRAMEWORK_VF_AGENT,
    FRAMEWORK_VF_CHAT,
    FRAMEWORK_VF_TASKS,
    FRAMEWORK_VF_TOOLS,
    stack_python,
)

from env_actors.config import EnvPoolConfig
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.serve_env.front import CANCELLED_ERROR, ServeEnvConfig, ServeEnvFront

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TESTS = Path(__file__).parent
CLIENT = TESTS / "serve_env_client.py"
DEADLINE_S = 420  # a client run: the pools' first start imports verifiers, tens of seconds here
KEY_VAR = "SERVE_ENV_TEST_KEY"  # the stand-in takes any key; verifiers' client wants the variable set
TASKSET = {"id": "framework-vf-tasks"}
ENV_CONFIG = {
    "taskset": TASKSET,
    "agent": {"harness": {"id": "framework-vf-chat"}, "runtime": {"type": "subprocess"}},
}
PACKAGES = (
    "framework_envs.",
    "framework_vf_tasks",
    "framework_vf_chat",
    "framework_vf_tools",
    "framework_vf_agent",
)
SHIPPED = [FRAMEWORK_ENVS, FRAMEWORK_VF_TASKS, FRAMEWORK_VF_CHAT, FRAMEWORK_VF_TOOLS, FRAMEWORK_VF_AGENT]
TIME_KEYS = {"time", "timing", "timestamp", "start", "end", "created", "duration"}
IDS = re.compile(r"[0-9a-f]{32}|chatcmpl-[\w-]+")


def vf04_python() -> str:
    """The verifiers-0.4 stack's interpreter; `SERVE_ENV_STACK_PYTHON` names a prepared one instead (a
    machine whose stack cache cannot be built)."""
    return os.environ.get("SERVE_ENV_STACK_PYTHON") or stack_python("verifiers-0.4")


def stack_env() -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=f"{FRAMEWORK_ENVS.parent}{os.pathsep}{TESTS.parent}", **{KEY_VAR: "unused"}
    )


def pool_config(packages: tuple[str, ...] = PACKAGES) -> EnvPoolConfig:
    return EnvPoolConfig(
        num_cpus=0.25,
        env_packages=packages,
        runtime_env={
            "py_executable": vf04_python(),
            "py_modules": [str(path) for path in SHIPPED],
            "env_vars": {KEY_VAR: "unused"},
        },
    )


def episodes(address: str, standin, runs: list[dict[str, Any]], headers=None, **case: Any) -> list[dict]:
    """verifiers' `EnvClient` runs `runs` at once against `address`; one outcome per run."""
    # Seeded: the stand-in samples unseeded requests at random, as vLLM does.
    client = {"type": "eval", "base_url": standin.base_url, "api_key_var": KEY_VAR, "headers": headers or {}}
    case = {"address": address, "taskset": TASKSET, "client": client, "model": BUNDLED_MODEL,
            "sampling": {"max_tokens": 128, "seed": 7}, "runs": runs, **case}  # fmt: skip
    done = subprocess.run(
        [vf04_python(), str(CLIENT), "client"],
        input=json.dumps(case), capture_output=True, text=True, timeout=DEADLINE_S, env=stack_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def comparable(value: Any) -> Any:
    """An episode without what differs between two runs of it: ids (and strings carrying them) and times."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in TIME_KEYS}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, str):
        return IDS.sub("<id>", value)
    return value


class Front:
    """A `ServeEnvFront` on a loop of its own thread, as the CLI's process would hold it."""

    def __init__(self, config: ServeEnvConfig) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.front = ServeEnvFront(config)
        self.call(self.front.start())

    def call(self, coro: Any, timeout: float = DEADLINE_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.front.aclose(), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)


class VerifiersServer:
    """verifiers' own `serve_env` in the stack's interpreter: a lone EnvServer (1) or its elastic pool."""

    def __init__(self, port: int, max_workers: int, env_config: dict[str, Any] = ENV_CONFIG) -> None:
        self.address = f"tcp://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [vf04_python(), str(CLIENT), "server", self.address, str(max_workers)],
            stdin=subprocess.PIPE, env=stack_env(), start_new_session=True, text=True,
        )  # fmt: skip
        self.process.stdin.write(json.dumps(env_config))
        self.process.stdin.close()

    def close(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(env_config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The front, verifiers' lone EnvServer and its elastic pool, each serving `env_config`."""
    front = Front(ServeEnvConfig(address="tcp://127.0.0.1:0", env_config=env_config, pool=pool_config()))
    lone, pool = VerifiersServer(free_port(), 1, env_config), VerifiersServer(free_port(), 2, env_config)
    try:
        yield {"front": front, "lone": lone, "pool": pool}
    finally:
        lone.close()
        pool.close()
        front.close()


def same_episodes_as_verifiers(servers, standin, runs: list[dict[str, Any]], **case: Any) -> list[dict]:
    """`runs` through the front, then through verifiers' lone server and its pool: every outcome an
    episode, equal field by field but ids and times. The front's outcomes."""
    ours = episodes(servers["front"].front.address, standin, runs, **case)
    assert servers["front"].front.pool is not None  # health answered: the environment had loaded
    for label in ("lone", "pool"):
        theirs = episodes(servers[label].address, standin, runs, **case)
        for mine, own in zip(ours, theirs, strict=True):
            assert own["error"] is None and mine["error"] is None, (own["error"], mine["error"])
            assert mine["deltas"] > 0 and own["deltas"] > 0
            assert comparable(mine["episode"]) == comparable(own["episode"]), label
    return ours


@pytest.fixture(scope="module")
def servers(ray_session, standin):
    with served(ENV_CONFIG) as three:
        yield three


def test_episodes_match_verifiers_own_server_and_pool(servers, standin):
    ours = same_episodes_as_verifiers(servers, standin, [{"index": i} for i in range(4)])
    traces = [trace for outcome in ours for trace in outcome["episode"]["traces"]]
    assert all(trace["nodes"] for trace in traces), "the stand-in's turns should be recorded"


def test_64_concurrent_runs_are_all_answered_as_verifiers_answers_them(servers, standin):
    runs = [{"index": i % 4} for i in range(64)]
    ours = episodes(servers["front"].front.address, standin, runs)
    theirs = episodes(servers["lone"].address, standin, runs)
    assert [o["error"] for o in ours] == [None] * 64
    for mine, own in zip(ours, theirs, strict=True):
        assert comparable(mine["episode"]) == comparable(own["episode"])


def test_a_cancelled_run_still_gets_verifiers_cancelled_reply(servers, standin):
    slow = {"X-Standin-Latency": "10"}  # the model call outlives the cancel, even on a loaded machine
    ours = episodes(servers["front"].front.address, standin, [{"index": 0, "cancel": True}], slow)
    theirs = episodes(servers["lone"].address, standin, [{"index": 0, "cancel": True}], slow)
    assert ours[0]["deltas"] >= 1
    expected = {"success": False, "error": CANCELLED_ERROR}
    assert theirs[0]["replies"] == [expected]
    assert ours[0]["replies"] == [expected]


TOOLS_TASKSET = {"id": "framework-vf-tools"}
HARNESSES = {
    "toolset": "framework-vf-chat",  # the chat loop in process, its tools the rollout's MCP servers
    "agent program": "framework-vf-agent",  # the same loop as a program of its own, in the runtime
}


def tools_config(harness: str) -> dict[str, Any]:
    return {
        "taskset": TOOLS_TASKSET,
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
    }


ROLLOUT_PROGRAMS = {
    "toolset": {"framework_vf_tools.toolset"},
    "agent program": {"framework_vf_tools.toolset", "framework_vf_agent.program"},
}
"""The processes verifiers starts for each rollout of a case (`python -m MODULE`)."""


@pytest.fixture(scope="module", params=list(HARNESSES))
def tool_servers(request, ray_session, standin):
    """The multi-turn cases, one harness each."""
    with served(tools_config(HARNESSES[request.param])) as three:
        yield {**three, "case": request.param}


def test_multi_turn_tool_episodes_match_verifiers_own_server_and_pool(tool_servers, standin):
    """Each episode is a model call, a call of the rollout's own `calculator` MCP server (launched by
    verifiers in the env server's runtime), and a model call on its answer; through the front exactly as
    through verifiers' own servers."""
    runs = [{"index": i} for i in range(3)]
    ours = same_episodes_as_verifiers(tool_servers, standin, runs, taskset=TOOLS_TASKSET)
    for outcome in ours:
        [trace] = outcome["episode"]["traces"]
        roles = [node["message"]["role"] for node in trace["nodes"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
        assert [c["name"] for c in trace["nodes"][2]["message"]["tool_calls"]] == ["calculator"]
        assert trace["metrics"]["tool_calls"] == 1.0 and trace["errors"] == [] and trace["ok"]


def rollout_programs() -> set[str]:
    """The modules of the live `python -m MODULE` processes that rollouts of the tool cases start."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:  # exited while we looked
            continue
        found.update(
            a.decode() for a in argv if a.startswith((b"framework_vf_tools.", b"framework_vf_agent."))
        )
    return found


def test_a_cancelled_multi_turn_run_leaves_no_tool_server_or_agent_program(tool_servers, standin):
    """Cancelling a run mid-episode ends what verifiers started for it: its tool server, its agent program."""
    seen: set[str] = set()
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            seen.update(rollout_programs())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        slow = {"X-Standin-Latency": "10"}  # the first model call outlives the cancel
        # Delta 1 is the trace, 2 its tools (the tool server is up), 3 the first model call's request.
        run = [{"index": 0, "cancel": True, "cancel_at_delta": 3}]
        [ours] = episodes(tool_servers["front"].front.address, standin, run, slow, taskset=TOOLS_TASKSET)
    finally:
        watching.set()
        watcher.join()
    assert ours["replies"] == [{"success": False, "error": CANCELLED_ERROR}] and ours["deltas"] >= 3
    assert seen == ROLLOUT_PROGRAMS[tool_servers["case"]], "the run should have started them"
    deadline = time.monotonic() + 30
    while left := rollout_programs():
        assert time.monotonic() < deadline, f"still running after the cancel: {left}"
        time.sleep(0.2)


def test_an_env_server_killed_mid_episode_ends_the_run_with_a_reply_naming_it(servers, standin):
    import ray

    front = servers["front"]
    slow = {"X-Standin-Latency": "20"}
    outcome: list[Any] = []
    client = threading.Thread(
        target=lambda: outcome.extend(episodes(front.front.address, standin, [{"index": 1}], slow))
    )
    client.start()
    pool = front.front.pool
    deadline = time.monotonic() + DEADLINE_S
    while not [s for s in ray.get(pool.stats.remote(), timeout=10).servers if s.sessions]:
        assert time.monotonic() < deadline, "the run never reached an env server"
        time.sleep(0.2)
    time.sleep(2.0)  # its first deltas are out; the model call is in flight
    [server] = [s for s in ray.get(pool.stats.remote(), timeout=10).servers if s.sessions]
    os.kill(server.pid, signal.SIGKILL)
    client.join(DEADLINE_S)
    [result] = outcome
    assert result["episode"] is None and result["deltas"] >= 1
    assert "PartLost" in result["error"] and "env server" in result["error"] and "died" in result["error"]
    assert "not dispatched again" in result["error"]


def test_an_environment_that_fails_to_import_answers_every_run_with_its_load_failure(ray_session, standin):
    broken = dict(ENV_CONFIG, taskset={"id": "framework-vf-missing"})
    config = ServeEnvConfig(
        address="tcp://127.0.0.1:0",
        env_config=broken,
        pool=pool_config((*PACKAGES, "framework_vf_missing")),
    )
    front = Front(config)
    try:
        runs = [{"index": i} for i in range(3)]
        outcomes = episodes(front.front.address, standin, runs, wait_for_startup=False)
        assert front.front.loads == 2  # two loads, then remembered: not one per run
        for outcome in outcomes:
            assert outcome["episode"] is None
            assert "LoadFailed" in outcome["error"] and "failed to load 2 time(s)" in outcome["error"]
    finally:
        front.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
