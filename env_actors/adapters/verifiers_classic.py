"""A verifiers classic environment served unchanged (`verifiers.legacy` of 0.3.x).

    Ref("env_actors.adapters.verifiers_classic:VerifiersClassicEnv",
        {"env_id": "my-math-env", "env_args": {"difficulty": 2}, "split": "train"})

`env_id` names the user's package as verifiers does (`my-math-env` -> module `my_math_env`), checked
against the pool's `env_packages` before anything is imported; its `load_environment(**env_args)` builds
the environment, and its formatted dataset (`split`: train or eval) is this adapter's task list.

The episode is verifiers' own `MultiTurnEnv.rollout` loop, turned inside out so that the plane makes
the model calls: reset = `init_state` + `setup_state` + the first prompt; each step = the sampled turn
as the model's response (`add_model_response`), the stop conditions (`is_completed`), then the
environment's response (`get_prompt_messages`, which calls `env_response` exactly once per turn); score =
`cleanup` + the rubric's `score_rollout`. Tools (ToolEnv, StatefulToolEnv) are offered as OpenAI tools,
and tool calls are translated both ways (verifiers' flat `{id, name, arguments}`, OpenAI's nested one).

Two departures from verifiers, both on purpose:

- A reward function that raises fails the score with its traceback; verifiers logs it and scores 0.0,
  which a trainer cannot tell from a wrong answer.
- A rubric with group reward functions (parameters `completions`, `states`, ...) is refused at load:
  this adapter scores one rollout at a time, and a group score silently computed over one rollout
  would be wrong.

verifiers runs on a loop of its own (`FrameworkLoop`): its reward functions may block on CPU.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import signal
import threading
import time
from collections.abc import Callable
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

NO_MODEL_URL = "http://model-calls-go-through-the-plane.invalid/v1"
"""verifiers demands a client per rollout; the plane makes the model calls, so this one reaches nothing
(an environment that calls a model itself, such as a judge, needs a client of its own)."""

_SCORE_FAILURES: contextvars.ContextVar[list[tuple[str, BaseException]] | None] = contextvars.ContextVar(
    "verifiers_score_failures", default=None
)


class RewardFunctionError(RuntimeError):
    """A reward function raised while scoring (verifiers itself would have scored it 0.0)."""


@dataclass
class _Session:
    state: Any
    prompt: list[Any]
    """The messages the next model turn answers (verifiers' `prompt_messages`)."""
    cleaned: bool = False


class VerifiersClassicEnv(Environment):
    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise CallerError(f"split is 'train' or 'eval', got {split!r}")
        self._env_id = env_id
        self._env_args = dict(env_args or {})
        self._split = split
        self._gate = PackageGate()
        self._vf: Any = None
        self._env: Any = None
        self._rows: list[dict[str, Any]] = []
        self._loop: FrameworkLoop | None = None

    def allow_packages(self, prefixes: tuple[str, ...]) -> None:
        self._gate.allow(prefixes)

    def load(self) -> None:
        self._vf = _import_verifiers_classic()
        module = self._gate.load(self._env_id.replace("-", "_").split("/")[-1])
        load_environment = getattr(module, "load_environment", None)
        if load_environment is None:
            raise CallerError(f"{module.__name__} has no load_environment()")
        with _signals_outside_main_thread_ignored():
            env = load_environment(**self._env_args)
        if env.rubric.has_group_rewards:
            raise CallerError(
                f"{self._env_id}: its rubric has group reward functions ({_group_funcs(env.rubric)}); "
                "they score a whole group together, and this adapter scores one rollout at a time"
            )
        _surface_reward_errors(env.rubric)
        dataset = env.get_dataset() if self._split == "train" else env.get_eval_dataset()
        self._rows = [_plain(dict(row)) for row in dataset]
        check_json(self._rows, "dataset")
        self._env = env
        self._loop = FrameworkLoop(f"verifiers-{self._env_id}")

    def num_tasks(self) -> int:
        return len(self._rows)

    def task(self, index: int) -> dict[str, Any]:
        return self._rows[check_index(index, len(self._rows))]

    async def reset(self, task: dict[str, Any]) -> Reset:
        if not isinstance(task.get("prompt"), list | str):
            raise CallerError("a verifiers task has a `prompt` (its formatted dataset row)")
        return await self._framework(self._reset(task))

    async def step(self, state: _Session, assistant_message: Message) -> StepOut:
        return await self._framework(self._step(state, assistant_message))

    async def score(self, state: _Session) -> ScoreOut:
        return await self._framework(self._score(state))

    async def close(self, state: _Session) -> None:
        if not state.cleaned:
            state.cleaned = True
            await self._framework(self._env.cleanup(state.state))

    # ---------------------------------------------------------------- on verifiers' own loop

    async def _framework(self, coro: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run(coro)

    async def _reset(self, task: dict[str, Any]) -> Reset:
        vf, env = self._vf, self._env
        client = vf.OpenAIChatCompletionsClient(_no_model_client())
        state = await env.init_state(task, client, "policy", {})
        try:
            setup = await env.setup_state(state)
            state = setup if setup is not None else state
        except vf.Error as exc:
            raise RuntimeError(f"setup_state failed: {exc!r}") from exc
        session = _Session(state, await env.get_prompt_messages(state))
        tools = [_openai_tool(tool) for tool in state.get("tool_defs") or []]
        return Reset(messages=[_wire(m) for m in session.prompt], state=session, tools=tools or None)

    async def _step(self, session: _Session, message: Message) -> StepOut:
        vf, env, state = self._vf, self._env, session.state
        seen = len(session.prompt)
        try:
            await env.add_model_response(state, session.prompt, _response(vf, message))
            seen += len(state["trajectory"][-1]["completion"])
            if not await env.is_completed(state):
                session.prompt = await env.get_prompt_messages(state)
                final = state.get("final_env_response")
                if final is None:
                    return StepOut(messages=[_wire(m) for m in session.prompt[seen:]], done=False)
        except vf.Error as exc:  # what verifiers' loop does with it: the episode stops on its error
            if isinstance(exc, vf.OverlongPromptError):
                state["prompt_too_long"] = state["is_truncated"] = True
            else:
                state["error"] = exc
        await env.is_completed(state)  # records why it stopped (`stop_condition`), as verifiers' loop does
        final = state.get("final_env_response") or []
        return StepOut(messages=[_wire(m) for m in final], done=True)

    async def _score(self, session: _Session) -> ScoreOut:
        env, state = self._env, session.state
        if not session.cleaned:
            session.cleaned = True
            await env.cleanup(state)
        failures: list[tuple[str, BaseException]] = []
        _SCORE_FAILURES.set(failures)  # this coroutine is its own task: the list is this score's alone
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        if failures:
            name, exc = failures[0]
            raise RewardFunctionError(f"reward function {name} raised {exc!r}") from exc
        return ScoreOut(reward=float(state["reward"]), metrics=_plain(dict(state["metrics"] or {})))


def _import_verifiers_classic() -> Any:
    vf = import_framework("verifiers", "verifiers>=0.3,<0.4")
    legacy = getattr(vf, "legacy", None)
    if legacy is None:
        try:
            import verifiers.legacy as legacy  # noqa: PLC0415 - a subpackage not imported by its parent
        except ImportError:
            legacy = vf if hasattr(vf, "MultiTurnEnv") else None  # 0.1-0.2: the classic API at the top
    if legacy is None:
        raise CallerError(
            f"verifiers {getattr(vf, '__version__', '?')} has no classic API (removed in 0.4); run this pool "
            "with verifiers>=0.3,<0.4, or use env_actors.adapters.verifiers_v1 for a 0.4 taskset"
        )
    return legacy


def _no_model_client() -> Any:
    from openai import AsyncOpenAI  # noqa: PLC0415 - verifiers' own dependency, in the pool's runtime env

    return AsyncOpenAI(base_url=NO_MODEL_URL, api_key="unused", max_retries=0)


class _signals_outside_main_thread_ignored:
    """verifiers installs SIGINT/SIGTERM handlers when an environment is built, which Python allows only on
    the main thread; an env server loads off it. There the handlers are skipped: the server's process
    belongs to Ray, which handles its signals itself."""

    def __enter__(self) -> None:
        self._signal = signal.signal
        if threading.current_thread() is not threading.main_thread():
            signal.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        signal.signal = self._signal


def _leaf_rubrics(rubric: Any) -> list[Any]:
    inner = getattr(rubric, "rubrics", None)
    if inner is None:
        return [rubric]
    return [leaf for r in inner for leaf in _leaf_rubrics(r)]


def _group_funcs(rubric: Any) -> str:
    names = [f.__name__ for r in _leaf_rubrics(rubric) for f in r.funcs if r._is_group_func(f)]
    return ", ".join(names)


def _surface_reward_errors(rubric: Any) -> None:
    for leaf in _leaf_rubrics(rubric):
        leaf.funcs = [_surfacing(func) for func in leaf.funcs]


def _surfacing(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, same name and signature (verifiers passes arguments by name), recording what it raises for
    the score that called it."""

    @functools.wraps(func)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            value = func(*args, **kwargs)
            return await value if inspect.isawaitable(value) else value
        except Exception as exc:
            failures = _SCORE_FAILURES.get()
            if failures is not None:
                failures.append((getattr(func, "__name__", repr(func)), exc))
            raise

    return call


def _response(vf: Any, message: Message) -> Any:
    """The plane's sampled turn as the model response verifiers records."""
    calls = sampled_tool_calls(vf, message)
    reply = vf.ResponseMessage(
        content=message.get("content"),
        reasoning_content=message.get("reasoning"),  # the plane's name for it, in every mode
        tool_calls=calls or None,
        finish_reason="tool_calls" if calls else "stop",
        is_truncated=False,
    )
    return vf.Response(id="plane-turn", created=int(time.time()), model="policy", message=reply)


def _wire(message: Any) -> Message:
    """A verifiers message as an OpenAI chat message (tool calls nested under `function`)."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if data.get("role") == "text":
        data["role"] = "user"
    calls = data.pop("tool_calls", None)
    if calls:
        data["tool_calls"] = openai_tool_calls(calls)
    data.pop("thinking_blocks", None)
    return _plain(data)


def _openai_tool(tool: Any) -> dict[str, Any]:
    spec = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else dict(tool)
    function = {k: spec[k] for k in ("name", "description", "parameters") if k in spec}
    return {"type": "function", "function": function}


def _plain(value: Any) -> Any:
    """JSON-ready: pydantic messages dumped, tuples listed."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
