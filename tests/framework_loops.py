"""Each framework's own loop, driven with fixed assistant messages: the other side of the parity tests.

Run inside a stack's interpreter (`framework_stacks.py`), with `tests/` on `PYTHONPATH`:

    python tests/framework_loops.py skyrl-gym < case.json > outcome.json

`case.json` holds what the plane's rollout ran (the task, the assistant turns it sampled); the outcome is
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


LOOPS = {"skyrl-gym": skyrl_gym}

if __name__ == "__main__":
    outcome = LOOPS[sys.argv[1]](json.load(sys.stdin))
    json.dump(outcome, sys.stdout)
