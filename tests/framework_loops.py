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


LOOPS = {"skyrl-gym": skyrl_gym, "verifiers-0.3": verifiers_classic}

if __name__ == "__main__":
    # One case, or a list of cases run in this one process (the framework is imported once: seconds each).
    case = json.load(sys.stdin)
    loop = LOOPS[sys.argv[1]]
    outcome = [loop(one) for one in case] if isinstance(case, list) else loop(case)
    json.dump(outcome, sys.stdout)
