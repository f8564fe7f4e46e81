"""InferenceServer actors and their supervisor, against real stand-in server processes.

vLLM cannot be installed here, so for vLLM only the command line and the Ray resources are checked; every
other test launches the bundled stand-in as the actor's subprocess and kills real processes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys

import psutil
import pytest
import ray
from waiting import runner, wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import (
    GPU_NODE_RESOURCE,
    InferenceServer,
    ServerSpec,
    ServerStartupError,
    server_actor_options,
    vllm_command,
    vllm_env,
)
from rollout_actors.inference.server_set import InferenceServerSet
from rollout_actors.kernel.supervision import RestartIntensity

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

DEADLINE_S = 90  # per test, well under the suite's 300 s: a hang fails here, with this test's name
STANDIN = ServerSpec(kind="standin", model=BUNDLED_MODEL, host="127.0.0.1", ready_timeout_s=60, num_cpus=0)


run = runner(DEADLINE_S)


async def stop(actor) -> None:
    try:
        await asyncio.wait_for(actor.close.remote(), 30)
    finally:
        ray.kill(actor)


# ------------------------------------------------------------------------------ vLLM: construction only


def test_vllm_command_serves_the_model_on_the_port_with_tensor_parallelism():
    spec = ServerSpec(model="Qwen/Qwen3-8B", tensor_parallel_size=2, extra_args=["--max-model-len", "8192"])
    command = vllm_command(spec, "10.0.0.5", 8123)
    assert command[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-8B"]
    flags = command[5:]
    assert flags[flags.index("--host") + 1] == "10.0.0.5"
    assert flags[flags.index("--port") + 1] == "8123"
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert flags[flags.index("--distributed-executor-backend") + 1] == "mp"
    assert "--enable-lora" in flags
    assert command[-2:] == ["--max-model-len", "8192"], "extra args go last, verbatim"
    assert vllm_env(spec)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_vllm_single_gpu_command_has_no_executor_override_and_lora_can_be_off():
    spec = ServerSpec(model="Qwen/Qwen3-8B", enable_lora=False)
    command = vllm_command(spec, "127.0.0.1", 8000)
    assert "--distributed-executor-backend" not in command
    assert "--enable-lora" not in command
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(spec)


def test_vllm_actor_requests_its_gpus_and_the_gpu_node_resource_from_ray():
    options = server_actor_options(ServerSpec(model="Qwen/Qwen3-8B", tensor_parallel_size=4))
    assert options["num_gpus"] == 4
    assert options["resources"] == {GPU_NODE_RESOURCE: 4}
    standin = server_actor_options(STANDIN)
    assert "num_gpus" not in standin and "resources" not in standin


# ------------------------------------------------------------------------------------ the actor


def test_ready_server_answers_and_stops_with_its_process(ray_session):
    async def scenario():
        actor = InferenceServer.options(**server_actor_options(STANDIN)).remote(STANDIN)
        try:
            status = await actor.start.remote()
            assert status.state == "ready", status
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                models = (await client.get(f"{status.url}/models")).json()
                assert BUNDLED_MODEL in [card["id"] for card in models["data"]]
                chat = await client.post(
                    f"{status.url}/chat/completions",
                    json={
                        "model": BUNDLED_MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 8,
                    },
                )
                assert chat.status_code == 200 and chat.json()["choices"][0]["message"]
            stopped = await actor.close.remote()
            assert stopped.state == "stopped"
            assert not os.path.exists(stopped.log_path), "close() cleans up the log directory"
            assert not psutil.pid_exists(status.pid) or psutil.Process(status.pid).status() == "zombie"
        finally:
            ray.kill(actor)

    run(scenario())


def test_startup_failure_raises_quickly_with_exit_code_and_log_tail(ray_session):
    spec = STANDIN.model_copy(update={"model": "/nonexistent/model"})

    async def scenario():
        servers = InferenceServerSet(spec, replicas=1)
        with pytest.raises(ServerStartupError) as caught:
            # A deadline, not a speed claim: the failure must be raised, not waited out.
            await asyncio.wait_for(servers.start(), 30)
        status = caught.value.status
        assert status.exit_code == 1
        assert "/nonexistent/model" in status.log_tail and "OSError" in status.log_tail
        assert "exit code 1" in str(caught.value) and status.log_tail[-200:] in str(caught.value)
        assert servers.endpoints() == [] and servers.actors() == []

    run(scenario())


def test_bogus_command_line_fails_at_once_with_the_usage_error(ray_session):
    spec = STANDIN.model_copy(update={"extra_args": ["--no-such-flag"]})

    async def scenario():
        with pytest.raises(ServerStartupError) as caught:
            await InferenceServerSet(spec, replicas=1).start()
        assert caught.value.status.exit_code == 2  # argparse
        assert "--no-such-flag" in caught.value.status.log_tail

    run(scenario(), deadline=30)


def test_server_not_ready_by_its_deadline_is_killed_and_reported(ray_session):
    spec = STANDIN.model_copy(update={"standin": {"startup_delay_s": 60.0}, "ready_timeout_s": 2.0})

    async def scenario():
        actor = InferenceServer.options(**server_actor_options(spec)).remote(spec)
        try:
            status = await actor.start.remote()
            assert status.state == "dead" and "ready_timeout_s" in status.reason
            assert status.exit_code == -signal.SIGKILL
            assert not psutil.pid_exists(status.pid) or psutil.Process(status.pid).status() == "zombie"
        finally:
            await stop(actor)

    run(scenario(), deadline=30)


def test_killing_the_actor_takes_its_server_process_down(ray_session):
    async def scenario():
        actor = InferenceServer.options(**server_actor_options(STANDIN)).remote(STANDIN)
        status = await actor.start.remote()
        assert status.state == "ready"
        ray.kill(actor)
        await wait_until(lambda: not psutil.pid_exists(status.pid), timeout=15)
        shutil.rmtree(os.path.dirname(status.log_path), ignore_errors=True)

    run(scenario())


# ---------------------------------------------------------------------------------- the supervisor


def test_sigkilled_server_is_detected_dropped_and_replaced_within_budget(ray_session):
    async def scenario():
        routed_when_prepared = {}

        async def before_routing(url: str) -> None:  # e.g. PolicyPublisher.load_current
            routed_when_prepared[url] = url in servers.endpoints()

        servers = InferenceServerSet(
            STANDIN,
            replicas=1,
            restart=RestartIntensity(max_restarts=2, window_s=60),
            before_routing=before_routing,
        )
        try:
            (first,) = await servers.start()
            (victim,) = servers.status()
            os.kill(victim.pid, signal.SIGKILL)
            await wait_until(lambda: first not in servers.endpoints(), timeout=5)
            dead = servers.status()[0]
            assert dead.state in ("dead", "starting")
            await wait_until(lambda: len(servers.endpoints()) == 1, timeout=60)
            assert servers.restarts == 1 and not servers.exhausted
            (replacement,) = servers.status()
            assert replacement.state == "ready" and replacement.pid != victim.pid
            # The hook ran for the first server and for the replacement, each time before it was routed.
            assert routed_when_prepared == {first: False, replacement.url: False}
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                assert (await client.get(f"{servers.endpoints()[0]}/models")).status_code == 200
        finally:
            await servers.aclose()
        assert not psutil.pid_exists(replacement.pid) or psutil.Process(replacement.pid).status() == "zombie"

    run(scenario())


def test_death_report_carries_the_exit_code_and_reason(ray_session):
    async def scenario():
        actor = InferenceServer.options(**server_actor_options(STANDIN)).remote(STANDIN)
        try:
            status = await actor.start.remote()
            os.kill(status.pid, signal.SIGKILL)
            dead = await asyncio.wait_for(actor.watch.remote(30.0), 10)
            assert dead.state == "dead" and dead.exit_code == -signal.SIGKILL
            assert "after startup" in dead.reason
            assert (await actor.status.remote()).state == "dead"
        finally:
            await stop(actor)

    run(scenario())


def test_spent_restart_budget_leaves_the_slot_empty_and_says_so(ray_session):
    async def scenario():
        servers = InferenceServerSet(
            STANDIN, replicas=1, restart=RestartIntensity(max_restarts=0, window_s=60)
        )
        try:
            await servers.start()
            os.kill(servers.status()[0].pid, signal.SIGKILL)
            await wait_until(lambda: servers.exhausted, timeout=10)
            assert servers.endpoints() == [] and servers.restarts == 0
            assert servers.status()[0].state == "dead"
        finally:
            await servers.aclose()

    run(scenario(), deadline=60)
