"""`CalculatorAgentEnv`: the calculator task as an agent environment. The agent, not the plane, runs the loop.

    RolloutRequest(env=Ref("env_actors.examples.calculator_agent:CalculatorAgentEnv", {}), mode="agent", ...)

The agent is an ordinary OpenAI-SDK chat loop (`AsyncOpenAI.chat.completions.create` with tools), run on
the env server against the endpoint its rollout serves: it calls the model, runs the calculator for each
tool call, and stops at an answer without one (or after `max_turns` calls). The tasks, the tool and the
reward are `CalculatorEnv`'s, so the same task scores the same in token mode and in agent mode.
"""

from __future__ import annotations

from typing import Any

from env_actors.agent import AgentEndpoint, AgentEnvironment
from env_actors.examples.calculator_env import CalculatorEnv
from env_actors.interface import Reset, ScoreOut


class CalculatorAgentEnv(AgentEnvironment):
    twin = CalculatorEnv
    """The token-mode environment whose tasks, tools and reward this agent shares."""

    def __init__(self, max_turns: int = 4, **config: Any) -> None:
        self._env = self.twin(max_turns=max_turns, **config)
        self._max_turns = max_turns

    async def load(self) -> None:
        await self._env.load()

    def num_tasks(self) -> int:
        return self._env.num_tasks()

    def task(self, index: int) -> dict[str, Any]:
        return self._env.task(index)

    async def reset(self, task: dict[str, Any]) -> Reset:
        start = await self._env.reset(task)
        return Reset(messages=start.messages, state=(start, start.state), tools=start.tools)

    async def run_agent(self, state: Any, endpoint: AgentEndpoint) -> None:
        start, episode = state
        client = endpoint.client()  # closed when the run ends
        messages = list(start.messages)
        for _ in range(self._max_turns):
            reply = await client.chat.completions.create(
                model=endpoint.model, messages=messages, tools=start.tools
            )
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            out = await self._env.step(episode, message)  # runs the tool calls, or takes the answer
            messages.extend(out.messages)
            if out.done:
                break

    async def score(self, state: Any) -> ScoreOut:
        return await self._env.score(state[1])
