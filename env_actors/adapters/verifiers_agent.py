"""A verifiers v1 environment (0.4.x) run by verifiers itself, in agent mode: its harness owns the loop.

    Ref("env_actors.adapters.verifiers_agent:VerifiersV1AgentEnv",
        {"taskset": "my-taskset", "harness": {"id": "null"}, "runtime": {"type": "subprocess"}})
    # requested with mode="agent"

Where `verifiers_v1.VerifiersV1Env` cannot stand in for the agent (a harness that calls the model itself:
verifiers' chat loop as its own program, with MCP tool servers, a runtime, ...), this adapter runs the
whole episode the way `vf-eval` would (`Env.run_episode`: the task's setup, the harness program, verifiers'
interception server with the task's stops and limits, finalize, scoring), and points verifiers' model
client at the rollout's agent-mode endpoint. Every model call the harness makes passes verifiers'
interception and then reaches the plane as one turn of the rollout, rendered, sampled with the rollout's
own client and recorded token-exact; verifiers' own trace gives the reward and metrics.

`taskset`, `taskset_config` and `limit` are as for `VerifiersV1Env`, gated by the pool's `env_packages`,
as is a `harness` id that is not one of verifiers' own (`null`, `bash`, ...: `harness` is the agent's
`HarnessConfig`, default the plain chat loop `null`). `runtime` is where the harness runs (verifiers'
`RuntimeConfig`, default `subprocess`: the env server's own machine). `max_turns` is verifiers' own limit
(the rollout's `max_turns` bounds the calls as well). The taskset must play with verifiers' single agent
(`SingleAgentEnv`).

The rollout's key reaches verifiers' client the only way its client takes one, through an environment
variable, one per rollout (`RAY_ROLLOUTS_AGENT_KEY_<id>`), set for the episode and removed after it. The
key is valid for that rollout alone and is revoked when it ends.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

from env_actors.adapters import FrameworkLoop, PackageGate
from env_actors.adapters.verifiers_v1 import bounded_tasks, check_plugged, import_v1, plugin_module, task_of
from env_actors.agent import AgentEndpoint, AgentEnvironment, AgentFailed
from env_actors.interface import Reset, ScoreOut, check_index
from rollout_actors.kernel import CallerError, check_json

SERVING_START_TIMEOUT_S = 120.0  # verifiers' interception server and shared tool servers, at load
KEY_VARIABLE_PREFIX = "RAY_ROLLOUTS_AGENT_KEY_"


@dataclass
class _Run:
    task: Any
    trace: Any = None


class VerifiersV1AgentEnv(AgentEnvironment):
    def __init__(
        self,
        taskset: str,
        taskset_config: dict[str, Any] | None = None,
        harness: dict[str, Any] | None = None,
        runtime: dict[str, Any] | None = None,
        max_turns: int | None = None,
        limit: int | None = None,
    ) -> None:
        self._taskset_id = taskset
        self._taskset_config = dict(taskset_config or {})
        self._harness = dict(harness or {"id": "null"})
        self._runtime = dict(runtime or {"type": "subprocess"})
        self._max_turns = max_turns
        self._limit = limit
        self._gate = PackageGate()
        self._vf: Any = None
        self._env: Any = None
        self._tasks: list[Any] = []
        self._rows: list[dict[str, Any]] = []
        self._loop: FrameworkLoop | None = None
        self._serving = contextlib.AsyncExitStack()

    def allow_packages(self, prefixes: tuple[str, ...]) -> None:
        self._gate.allow(prefixes)

    def load(self) -> None:
        vf, loaders = import_v1()
        self._vf = vf
        self._gate.check(plugin_module(self._taskset_id))
        harness_id = str(self._harness.get("id") or "")
        if harness_id not in loaders.builtin_harness_ids():
            self._gate.check(plugin_module(harness_id, "harnesses"))
        check_plugged(self._gate, self._taskset_config)
        if loaders.environment_class(self._taskset_id) is not vf.SingleAgentEnv:
            raise CallerError(
                f"{self._taskset_id}: this adapter runs verifiers' single agent (SingleAgentEnv)"
            )
        config = vf.SingleAgentEnvConfig(
            taskset={**self._taskset_config, "id": self._taskset_id},
            agent={"harness": self._harness, "runtime": self._runtime, "max_turns": self._max_turns},
        )
        self._env = vf.load_environment(config)
        taskset = self._env.taskset
        taskset, self._tasks = bounded_tasks(taskset, self._limit, self._taskset_id)
        self._rows = [task.data.model_dump(mode="json", exclude_none=True) for task in self._tasks]
        check_json(self._rows, "tasks")
        self._loop = FrameworkLoop(f"verifiers-agent-{self._taskset_id}")
        # One interception server (and the taskset's shared tool servers) for the server's life: verifiers
        # keeps them on the env object, so concurrent episodes share them, as in `vf-eval`.
        self._loop.run_sync(self._serving.enter_async_context(self._env.serving()), SERVING_START_TIMEOUT_S)

    def num_tasks(self) -> int:
        return len(self._rows)

    def task(self, index: int) -> dict[str, Any]:
        return self._rows[check_index(index, len(self._rows))]

    async def reset(self, task: dict[str, Any]) -> Reset:
        run = task_of(self._tasks, task, self._taskset_id)
        data = run.data
        opening = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            opening.append({"role": "user", "content": data.prompt})
        return Reset(messages=opening, state=_Run(run))

    async def run_agent(self, state: _Run, endpoint: AgentEndpoint) -> None:
        assert self._loop is not None
        state.trace = await self._loop.run(self._episode(state.task, endpoint))

    async def score(self, state: _Run) -> ScoreOut:
        trace = state.trace
        if trace is None:
            raise AgentFailed("the verifiers episode did not run")
        rewards = {name: reward for name, reward in trace.rewards.items() if reward is not None}
        metrics: dict[str, Any] = dict(trace.metrics)
        metrics["stop_condition"] = trace.stop_condition
        return ScoreOut(
            reward=trace.reward,
            components={name: reward.score for name, reward in rewards.items()},
            metrics=metrics,
        )

    async def _episode(self, task: Any, endpoint: AgentEndpoint) -> Any:
        vf = self._vf
        variable = f"{KEY_VARIABLE_PREFIX}{uuid.uuid4().hex}"
        os.environ[variable] = endpoint.api_key
        try:
            client = vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=variable)
            episode = await self._env.run_episode(task, vf.ModelContext(model=endpoint.model, client=client))
        finally:
            os.environ.pop(variable, None)
        errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
        if not episode.ok or not episode.traces:
            detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no trace"
            tracebacks = "\n".join(e.traceback for e in errors if e.traceback)
            raise AgentFailed(f"the verifiers episode failed: {detail}\n{tracebacks}".strip())
        [trace] = episode.traces  # SingleAgentEnv: one agent, one trace
        return trace
