"""A verifiers v1 taskset (0.4.x) served unchanged, its agent a plain chat loop.

    Ref("env_actors.adapters.verifiers_v1:VerifiersV1Env",
        {"taskset": "my-taskset", "taskset_config": {"difficulty": 2}, "max_turns": 8})

`taskset` is the id verifiers loads it by (`my-taskset` -> module `my_taskset`, exporting its `Taskset`
via `__all__`), checked against the pool's `env_packages` before anything is imported, as is every
function the config plugs in (`taskset_config.task.rewards.<name>.fn`, ...). `taskset_config` is its
`TasksetConfig` (the `--env.taskset.*` of `vf-eval`); `limit` bounds an infinite taskset.

The agent is the plain chat loop of verifiers' `null` harness, with the plane making the model calls:
reset = the task's system prompt and prompt; each step = the sampled turn as the model's response, then
what verifiers' interception does around a model call (the task's `@vf.stop`s on the response, the
commit into the trace's message graph, the stops over the tool calls, then, before the next call, the
framework limits and the trace and request stops); score = the task's own `score` (`@vf.reward`s with
their weights, `@vf.metric`s) over that trace. The chat loop ends on a reply without tool calls, as the
`null` harness's does. It is verifiers' own code that runs (`RolloutSession`, `graph`, `Task.score`);
this adapter only stands where the harness program and the model would.

What the adapter cannot give, a taskset is refused for at load, with the need named, never run with a
reward silently missing: its own `Env` (a `run()` of its own) or a bundled harness (a program that
calls the model itself: run it in agent mode), tool servers (MCP toolsets), a runtime (a container, a
`setup`/`finalize` hook, a reward or metric that takes `runtime`: verifiers would skip that reward with
only an INFO log), judges (model calls of their own), `@vf.intercept` hooks, a task with no prompt (a
user to open the conversation). A reward function that raises fails the score with its traceback.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import time
from dataclasses import dataclass
from typing import Any

from env_actors.adapters import (
    FrameworkLoop,
    PackageGate,
    import_framework,
    openai_tool_calls,
    sampled_tool_calls,
)
from env_actors.interface import Environment, Message, Reset, ScoreOut, StepOut, check_index
from rollout_actors.kernel import CallerError, check_json

CHAT_HARNESS = "null"
"""verifiers' plain chat loop: the agent this adapter stands in for."""


@dataclass
class _Episode:
    task: Any
    trace: Any
    session: Any
    """verifiers' `RolloutSession`: the task's stops and the limits, as its interception runs them."""
    messages: list[Any]
    """The conversation the next model call sends (verifiers messages)."""
    ended: bool = False
    """A stop refused the next model call: the episode is over, whatever the model says."""


class VerifiersV1Env(Environment):
    def __init__(
        self,
        taskset: str,
        taskset_config: dict[str, Any] | None = None,
        max_turns: int | None = None,
        limit: int | None = None,
    ) -> None:
        self._taskset_id = taskset
        self._taskset_config = dict(taskset_config or {})
        self._max_turns = max_turns
        self._limit = limit
        self._gate = PackageGate()
        self._vf: Any = None
        self._tasks: list[Any] = []
        self._rows: list[dict[str, Any]] = []
        self._stops: list[tuple[type, Any]] = []
        self._loop: FrameworkLoop | None = None

    def allow_packages(self, prefixes: tuple[str, ...]) -> None:
        self._gate.allow(prefixes)

    def load(self) -> None:
        vf, loaders = import_v1(", or use env_actors.adapters.verifiers_classic for a classic environment")
        self._vf = vf
        self._gate.check(plugin_module(self._taskset_id))
        check_plugged(self._gate, self._taskset_config)
        env_cls = loaders.environment_class(self._taskset_id)
        if env_cls is not vf.SingleAgentEnv:
            raise CallerError(
                f"{self._taskset_id}: its Env ({env_cls.__name__}) runs episodes of its own (run()), which "
                "this adapter cannot drive; run it in agent mode"
            )
        if loaders.default_harness_id(self._taskset_id) != "bash":
            raise CallerError(
                f"{self._taskset_id}: it ships a harness of its own, a program that calls the model "
                "itself; run it in agent mode"
            )
        config_type = loaders.taskset_config_type(self._taskset_id)
        config = config_type.model_validate({**self._taskset_config, "id": self._taskset_id})
        taskset = loaders.load_taskset(config)
        taskset, self._tasks = bounded_tasks(taskset, self._limit, self._taskset_id)
        if not self._tasks:
            raise CallerError(f"{self._taskset_id} loaded no tasks")
        self._refuse_needs(taskset, config)
        self._rows = [task.data.model_dump(mode="json", exclude_none=True) for task in self._tasks]
        check_json(self._rows, "tasks")
        from verifiers.v1.session import hook_boundary  # noqa: PLC0415

        self._stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in self._tasks[0].hooks("stop")]
        self._loop = FrameworkLoop(f"verifiers-v1-{self._taskset_id}")

    def num_tasks(self) -> int:
        return len(self._rows)

    def task(self, index: int) -> dict[str, Any]:
        return self._rows[check_index(index, len(self._rows))]

    async def reset(self, task: dict[str, Any]) -> Reset:
        return await self._framework(self._reset(task_of(self._tasks, task, self._taskset_id)))

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        return await self._framework(self._step(state, assistant_message))

    async def score(self, state: _Episode) -> ScoreOut:
        return await self._framework(self._score(state))

    # ---------------------------------------------------------------- checks at load

    def _refuse_needs(self, taskset: Any, config: Any) -> None:
        vf, sample = self._vf, self._tasks[0]
        task_cls = type(sample)
        needs: list[str] = []
        if task_cls.NEEDS_CONTAINER:
            needs.append("a container runtime (Task.NEEDS_CONTAINER)")
        if task_cls.toolsets(config.task) or type(taskset).toolsets(config):
            needs.append("tool servers (MCP toolsets)")
        for hook in ("setup", "finalize", "stage_verifier"):
            if getattr(task_cls, hook) is not getattr(vf.Task, hook):
                needs.append(f"a runtime for its {hook}()")
        for kind in ("reward", "metric"):
            for fn in sample.hooks(kind):
                param = inspect.signature(fn).parameters.get("runtime")
                if param is not None and param.default is inspect.Parameter.empty:
                    needs.append(f"a runtime for its {kind} {fn.__name__}")
        if sample.config.judges:
            needs.append("judges (model calls of their own)")
        if any(True for _ in _decorated(sample, "intercept")):
            needs.append("@vf.intercept hooks")
        if any(task.data.prompt is None for task in self._tasks):
            needs.append("a user to open the conversation (a task without a prompt)")
        if needs:
            raise CallerError(f"{self._taskset_id} needs what this adapter cannot give: {'; '.join(needs)}")

    # ---------------------------------------------------------------- on verifiers' own loop

    async def _framework(self, coro: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run(coro)

    async def _reset(self, task: Any) -> Reset:
        from verifiers.v1.session import RolloutLimits, RolloutSession  # noqa: PLC0415
        from verifiers.v1.state import state_cls  # noqa: PLC0415

        vf = self._vf
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(
                config=vf.AgentConfig(harness={"id": CHAT_HARNESS}, max_turns=self._max_turns)
            ),
        )
        session = RolloutSession(
            ctx=None,  # the model client is the plane's: verifiers' session never calls one here
            trace=trace,
            trace_stops=[fn for kind, fn in self._stops if kind is vf.Trace],
            limits=RolloutLimits(max_turns=self._max_turns),
            request_stops=[fn for kind, fn in self._stops if kind is vf.Request],
            response_stops=[fn for kind, fn in self._stops if kind is vf.Response],
            gates_tools=True,  # the chat loop asks the tool gate before each call
        )
        data = task.data
        messages: list[Any] = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append(vf.UserMessage(content=data.prompt))
        else:
            messages.extend(data.prompt)
        episode = _Episode(task, trace, session, messages)
        episode.ended = await self._refused(episode)
        return Reset(messages=[_wire(m) for m in messages], state=episode)

    async def _refused(self, episode: _Episode) -> bool:
        """What verifiers' interception runs before a model call: the limits and trace stops, then the
        request stops. A refused call ends the episode with its prompt committed."""
        from verifiers.v1 import graph  # noqa: PLC0415

        session, trace = episode.session, episode.trace
        if await session.refused() is not None:
            return True
        request = self._vf.Request(messages=episode.messages)
        request, rewrites, stopped = await session.rewrite_request(request)
        trace.request_rewrites.extend(rewrites)
        if stopped is None:
            return False
        graph.prepare_turn(trace, request.messages, request.tools).commit_prompt()
        trace.stop(stopped)
        return True

    async def _step(self, episode: _Episode, message: Message) -> StepOut:
        from verifiers.v1 import graph  # noqa: PLC0415

        if episode.ended:  # a stop refused this call: in verifiers the harness got an error, not a turn
            return StepOut(done=True)
        session, trace = episode.session, episode.trace
        response = _response(self._vf, message)
        turn = graph.prepare_turn(trace, episode.messages, None)
        response, rewrites, stopped = await session.rewrite_response(response)
        node = turn.commit(response)
        trace.response_rewrites.extend(rewrites)
        if stopped is None:
            stopped = await session.gate_tool_calls(node)
        if stopped is not None:
            trace.stop(stopped)
            return StepOut(done=True)
        episode.messages.append(response.message)
        calls = response.message.tool_calls or []
        if not calls:  # the chat loop's end: a reply without tool calls
            trace.stop("agent_completed")
            return StepOut(done=True)
        answers = [self._vf.ToolMessage.model_validate(_unknown_tool(call)) for call in calls]
        episode.messages.extend(answers)
        done = await self._refused(episode)
        return StepOut(messages=[_wire(m) for m in answers], done=done)

    async def _score(self, episode: _Episode) -> ScoreOut:
        trace = episode.trace
        await episode.task.score(trace, None)  # raises verifiers' TaskError, with the reward's traceback
        rewards = {name: reward for name, reward in trace.rewards.items() if reward is not None}
        metrics: dict[str, Any] = dict(trace.metrics)
        metrics["stop_condition"] = trace.stop_condition
        return ScoreOut(
            reward=trace.reward,
            components={name: reward.score for name, reward in rewards.items()},
            metrics=metrics,
        )


def import_v1(hint: str = "") -> tuple[Any, Any]:
    """verifiers' v1 API and its loaders: the pool's own verifiers, imported at load. A verifiers without
    them is the pool's configuration at fault (`hint`: what else the caller could do)."""
    import_framework("verifiers", "verifiers>=0.4,<0.5")
    try:
        import verifiers.v1 as vf  # noqa: PLC0415
        from verifiers.v1.utils import loaders  # noqa: PLC0415
    except ImportError as exc:
        raise CallerError(
            f"this verifiers has no v1 API ({exc}); run this pool with verifiers>=0.4,<0.5{hint}"
        ) from exc
    return vf, loaders


def bounded_tasks(taskset: Any, limit: int | None, taskset_id: str) -> tuple[Any, list[Any]]:
    """The taskset cut to `limit`, and its tasks: an infinite taskset needs a limit."""
    if limit is not None:
        taskset = taskset.take(limit)
    elif not taskset.bounded:
        raise CallerError(f"{taskset_id} is infinite: give the adapter a `limit`")
    return taskset, list(taskset)


def task_of(tasks: list[Any], task: dict[str, Any], taskset_id: str) -> Any:
    """A request's task row as a task of the taskset (`tasks`, as loaded), or a `CallerError`."""
    template = tasks[0]
    try:
        data = type(template).data_type().model_validate(task)
    except Exception as exc:  # pydantic's ValidationError: the request's task is not this taskset's
        raise CallerError(f"not a task of {taskset_id}: {exc}") from exc
    return type(template)(data, template.config)


def check_plugged(gate: PackageGate, taskset_config: dict[str, Any]) -> None:
    """Functions a config plugs in are imported by verifiers: they pass the same gate as the taskset."""
    task = taskset_config.get("task") or {}
    for kind in ("stops", "metrics", "rewards"):
        for name, spec in (task.get(kind) or {}).items():
            fn = (spec or {}).get("fn")
            if fn is None:
                continue
            module = fn.split(":")[0] if ":" in fn else fn.rpartition(".")[0]
            if module.endswith(".py") or "/" in module:
                raise CallerError(f"{kind}.{name}: a function from a file ({fn!r}) is not importable here")
            gate.check(module)
    for judge in task.get("judges") or []:
        if isinstance(judge, dict) and judge.get("id"):
            gate.check(plugin_module(judge["id"], "judges"))


def plugin_module(plugin_id: str, group: str = "tasksets") -> str:
    """The module verifiers imports for a plugin id (its loaders' rule: a built-in of that name first)."""
    module = plugin_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    namespaced = f"verifiers.v1.{group}.{module}"
    try:
        builtin = importlib.util.find_spec(namespaced) is not None
    except ModuleNotFoundError:
        builtin = False
    return namespaced if builtin else module


def _decorated(obj: Any, attr: str) -> list[Any]:
    from verifiers.v1.utils.decorators import discover_decorated  # noqa: PLC0415

    return discover_decorated(obj, attr)


def _unknown_tool(call: Any) -> dict[str, Any]:
    """The chat loop's answer to a call of a tool it was not given (this adapter gives none)."""
    from verifiers.v1.harnesses.utils.compaction import bound_tool_message  # noqa: PLC0415

    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as exc:
        content = f"error: invalid JSON in tool arguments ({exc}); resend the call with valid JSON"
    else:
        if not isinstance(arguments, dict):
            content = f"error: tool arguments must be a JSON object, got {type(arguments).__name__}; resend as an object"
        else:
            content = f"error: unknown tool {call.name!r}"
    return bound_tool_message(
        {"role": "tool", "tool_call_id": call.id, "content": content, "name": call.name}
    )


def _response(vf: Any, message: Message) -> Any:
    """The plane's sampled turn as the model response verifiers records."""
    calls = sampled_tool_calls(vf, message)
    reply = vf.AssistantMessage(
        content=message.get("content"),
        reasoning_content=message.get("reasoning"),  # the plane's name for it, in every mode
        tool_calls=calls or None,
    )
    finish = "tool_calls" if calls else "stop"
    return vf.Response(
        id="plane-turn", created=int(time.time()), model="policy", message=reply, finish_reason=finish
    )


def _wire(message: Any) -> Message:
    """A verifiers message as an OpenAI chat message (tool calls nested under `function`)."""
    data = message.model_dump(mode="json", exclude_none=True)
    calls = data.pop("tool_calls", None)
    if calls:
        data["tool_calls"] = openai_tool_calls(calls)
    data.pop("provider_state", None)
    return data
