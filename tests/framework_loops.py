"""Each framework's own loop, driven with fixed assistant messages: the other side of the parity tests.

Run inside a stack's interpreter (`framework_stacks.py`), with `tests/` on `PYTHONPATH`:

    python tests/framework_loops.py skyrl-gym < case.json > outcome.json

`case.json` holds what the plane's rollout ran (or a list of such cases, answered with a list) (the task, the assistant turns it sampled); the outcome is
what the framework itself makes of the same turns: reward, metrics, and the messages the environment
added. No model and no network: where a framework insists on calling a model, a client answers it with the
given assistant messages, in order.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def skyrl_gym(case: dict[str, Any]) -> dict[str, Any]:
    import importlib

    import skyrl_gym

    importlib.import_module(case["package"])
    row = case["task"]
    env = skyrl_gym.make(row["env_class"], env_config=case.get("env_config") or {}, extras=row)
    messages, _ = env.init(row["prompt"])
    messages = list(messages)
    rewards = []
    for text in case["texts"]:
        out = env.step(text)
        rewards.append(out["reward"])
        messages.append({"role": "assistant", "text": text})
        messages.extend(out["observations"])
        if out["done"]:
            break
    metrics = env.get_metrics()
    env.close()
    return {"reward": sum(rewards), "step_rewards": rewards, "metrics": metrics, "messages": messages}


def verifiers_classic(case: dict[str, Any]) -> dict[str, Any]:
    """verifiers' own rollout and scoring (`_run_rollout_state`: `rollout`, then the rubric), with a chat
    client whose completions are the given assistant messages."""
    import asyncio
    import importlib
    import time

    import verifiers.legacy as vf
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletion

    env = importlib.import_module(case["module"]).load_environment(**case["env_args"])
    row = env.get_dataset()[case["index"]]
    answers = list(case["assistant"])

    class Scripted(vf.OpenAIChatCompletionsClient):
        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            message = answers.pop(0)
            body = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                body["tool_calls"] = message["tool_calls"]
            choice = {
                "index": 0,
                "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                "message": body,
            }
            return ChatCompletion.model_validate(
                {"id": "scripted", "object": "chat.completion", "created": int(time.time()), "model": model,
                 "choices": [choice]}
            )  # fmt: skip

    client = Scripted(AsyncOpenAI(base_url="http://scripted.invalid/v1", api_key="unused", max_retries=0))
    state = asyncio.run(env._run_rollout_state(row, client, "policy", {}))
    assert not answers, f"{len(answers)} assistant turns left unused"
    messages = [m.model_dump(exclude_none=True) for m in [*state["prompt"], *state["completion"]]]
    return {"reward": state["reward"], "metrics": state["metrics"], "messages": messages}


def verifiers_v1(case: dict[str, Any]) -> list[dict[str, Any]]:
    """verifiers' own episodes (`SingleAgentEnv.run_episode`: its rollout, interception server, stops
    and scoring), the chat loop in process (`framework_vf_chat`), and a model server on localhost whose
    completions are each episode's given assistant messages, in order. One outcome per episode."""
    import asyncio
    import os
    import time

    import verifiers.v1 as vf
    from aiohttp import web

    answers: list[dict[str, Any]] = []

    async def completion(request: web.Request) -> web.Response:
        body = await request.json()
        message = answers.pop(0)
        reply = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        return web.json_response(
            {"id": "scripted", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
             "choices": [{"index": 0, "message": reply, "finish_reason": finish}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        )  # fmt: skip

    async def episodes() -> list[dict[str, Any]]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completion)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        os.environ["SCRIPTED_MODEL_KEY"] = "unused"
        config = vf.SingleAgentEnvConfig(
            taskset={**case.get("taskset_config", {}), "id": case["taskset"]},
            agent={"harness": {"id": "framework-vf-chat"}, "runtime": {"type": "subprocess"}},
        )
        env = vf.load_environment(config)
        client = vf.EvalClientConfig(base_url=f"http://127.0.0.1:{port}/v1", api_key_var="SCRIPTED_MODEL_KEY")
        tasks = {t.data.idx: t for t in env.taskset}
        outcomes = []
        try:
            async with env.serving():
                for item in case["episodes"]:
                    answers[:] = item["assistant"]
                    result = await env.run_episode(
                        tasks[item["index"]], vf.ModelContext(model="policy", client=client)
                    )
                    assert not answers, f"{len(answers)} assistant turns left unused"
                    [trace] = result.traces
                    assert trace.ok, trace.errors
                    outcomes.append(
                        {"reward": trace.reward, "metrics": dict(trace.metrics),
                         "messages": [m.model_dump(mode="json", exclude_none=True) for m in trace.messages],
                         "stop_condition": trace.stop_condition}
                    )  # fmt: skip
        finally:
            await runner.cleanup()
        return outcomes

    return asyncio.run(episodes())


LOOPS = {"skyrl-gym": skyrl_gym, "verifiers-0.3": verifiers_classic, "verifiers-0.4": verifiers_v1}

if __name__ == "__main__":
    # One case, or a list of cases run in this one process (the framework is imported once: seconds each).
    case = json.load(sys.stdin)
    loop = LOOPS[sys.argv[1]]
    outcome = [loop(one) for one in case] if isinstance(case, list) else loop(case)
    json.dump(outcome, sys.stdout)
