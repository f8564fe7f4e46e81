"""The agent endpoint, the history matcher and subprocess agents on their own: no Ray, real HTTP, real
processes. (The end-to-end agent-mode specifications are in `test_agent_mode.py`.)"""

from __future__ import annotations

import asyncio
import sys
import time

import openai
import psutil
import pytest

from env_actors.agent import AgentEndpoint as AgentAccess
from env_actors.agent import AgentFailed, run_agent_session, run_program
from rollout_actors.rollout.agent.endpoint import AgentEndpoint
from rollout_actors.rollout.agent.history import Seen, continuation, tools_key

TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'},
}


class Recorder:
    """A route's handler that answers every call with its own name (stands for one rollout)."""

    def __init__(self, name: str) -> None:
        self.name, self.bodies = name, []

    async def chat_completion(self, body):
        self.bodies.append(body)
        message = {"role": "assistant", "content": self.name}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}

    def model_list(self):
        return {"object": "list", "data": []}


async def ask(base_url: str, api_key: str, stream: bool = False) -> str:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        if not stream:
            reply = await client.chat.completions.create(model="m", messages=messages)
            return reply.choices[0].message.content
        chunks = await client.chat.completions.create(model="m", messages=messages, stream=True)
        parts, finish = [], None
        async for chunk in chunks:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop"
        return "".join(parts)
    finally:
        await client.close()


def test_a_route_serves_only_its_own_rollouts_key_and_refuses_calls_once_revoked():
    async def scenario():
        endpoint = AgentEndpoint()
        a, b = Recorder("a"), Recorder("b")
        grant_a, grant_b = await endpoint.register(a), await endpoint.register(b)
        try:
            assert await ask(grant_a.base_url, grant_a.api_key) == "a"
            assert await ask(grant_b.base_url, grant_b.api_key, stream=True) == "b"  # one delta, then the end
            with pytest.raises(openai.AuthenticationError):  # b's key on a's route: refused, a sees nothing
                await ask(grant_a.base_url, grant_b.api_key)
            assert len(a.bodies) == 1 and len(b.bodies) == 1 and b.bodies[0]["stream"] is True
            assert endpoint.stats()["routes"] == 2
            await grant_a.revoke()
            with pytest.raises(openai.APIStatusError) as ended:
                await ask(grant_a.base_url, grant_a.api_key)
            assert ended.value.status_code == 410
            assert await ask(grant_b.base_url, grant_b.api_key) == "b"  # the other rollout is untouched
            await grant_b.revoke()
            await asyncio.sleep(0.1)
            stats = endpoint.stats()
            assert stats["routes"] == 0 and stats["connections"] == 0, stats
        finally:
            await endpoint.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_call_extends_what_was_seen_or_forks_with_the_reason():
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "compute 1+2"}]
    answered = {"role": "assistant", "content": None, "reasoning": "think", "tool_calls": [CALL]}
    seen = Seen([*opening, answered], tools_key([TOOL]))
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    # The SDK's echo: content "" or missing, reasoning dropped, arguments re-spaced, another call id.
    echoed = {
        "role": "assistant",
        "tool_calls": [
            {**CALL, "id": "other", "function": {**CALL["function"], "arguments": '{"expression":"1+2"}'}}
        ],
    }
    assert continuation(seen, [*opening, echoed, tool], [TOOL]).new_messages == [tool]
    rewritten = [{"role": "system", "content": "summary"}, *opening[1:], echoed, tool]
    assert continuation(seen, rewritten, [TOOL]).fork_reason == "the call rewrites message 0 (system)"
    invented = {"role": "assistant", "content": "I said this"}
    assert "did not sample" in continuation(seen, [*opening, echoed, invented], [TOOL]).fork_reason
    assert continuation(seen, [*opening, echoed, tool], None).fork_reason == "the agent changed its tools"
    assert continuation(seen, opening, [TOOL]).new_messages is None  # a retried call re-sends the past
    other_args = {
        "role": "assistant",
        "tool_calls": [{**CALL, "function": {"name": "calculator", "arguments": "{}"}}],
    }
    assert continuation(seen, [*opening, other_args, tool], [TOOL]).new_messages is None


CHILD_AND_SLEEP = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"pids {os.getpid()} {child.pid}", flush=True)
time.sleep(600)
"""

CHILD_THAT_LEFT_THE_GROUP = """
import os, subprocess, sys, time
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
child = subprocess.Popen(
    [sys.executable, "-c", ignore],
    stdout=subprocess.PIPE,
    start_new_session=True,  # a session and process group of its own, as a daemonising tool makes
)
child.stdout.readline()  # it ignores SIGTERM from here on
print(f"pids {os.getpid()} {child.pid}", flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaping is its new parent's business), without a race between
    looking the pid up and reading its state."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _started(access: AgentAccess) -> list[int]:
    deadline = time.monotonic() + 30
    while "pids" not in access.output_tail():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    pids = [int(p) for p in access.output_tail().split("pids", 1)[1].split()[:2]]
    assert all(_running(pid) for pid in pids)
    return pids


def test_a_subprocess_agent_and_what_it_forked_end_with_its_run():
    access = AgentAccess(base_url="http://127.0.0.1:9/v1", api_key="sk-agent-key-0123456789", model="m")

    async def scenario():
        run = asyncio.ensure_future(run_program([sys.executable, "-c", CHILD_AND_SLEEP], access))
        pids = await _started(access)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        # The run ends only once its processes did: looked at right away, no wait that could hide a race.
        assert not any(_running(pid) for pid in pids)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_child_that_left_the_agents_group_and_ignores_sigterm_ends_with_a_twice_cancelled_run():
    access = AgentAccess(base_url="http://127.0.0.1:9/v1", api_key="sk-agent-key-0123456789", model="m")

    async def scenario():
        run = asyncio.ensure_future(run_program([sys.executable, "-c", CHILD_THAT_LEFT_THE_GROUP], access))
        leader, child = await _started(access)
        run.cancel()
        deadline = time.monotonic() + 30
        while _running(leader):  # SIGTERM sent: the run is ending its processes (the child outlives it)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        run.cancel()  # a second cancel while it waits out the child's grace
        with pytest.raises(asyncio.CancelledError):
            await run
        assert not _running(leader) and not _running(child)

    asyncio.run(asyncio.wait_for(scenario(), 60))


class Env:
    def __init__(self, argv):
        self.argv = argv

    async def run_agent(self, state, endpoint):
        await run_program(self.argv, endpoint)


def test_a_failing_agent_reports_its_exit_and_output_tail_with_its_key_redacted():
    key = "sk-agent-key-abcdef0123456789"
    access = AgentAccess(base_url="http://127.0.0.1:9/v1", api_key=key, model="m")
    script = "import os, sys; print('my key is', os.environ['OPENAI_API_KEY']); sys.exit(3)"
    with pytest.raises(AgentFailed) as failed:
        asyncio.run(run_agent_session(Env([sys.executable, "-c", script]), None, access, timeout=30))
    message = str(failed.value)
    assert "exited with status 3" in message and "my key is [redacted]" in message and key not in message
