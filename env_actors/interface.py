"""The environment interface: what an environment implements, and what its answers look like on the wire.

An environment is a class named by a `Ref` (`Ref("pkg.module:MyEnv", {json config})`). The `EnvServer`
actor resolves the Ref (the config becomes keyword arguments of the constructor), awaits `load()`, and only
then counts as ready: heavy loading (datasets, sandboxes, models) belongs in `load()`, never in the
constructor or in the first `reset`.

A session is one rollout's episode. It lives on one `EnvServer` for its whole life::

    env = MathEnv()                       # cheap: keep config, no I/O
    await env.load()                      # heavy: read the dataset
    task = env.task(7)                    # a JSON dict; index in [0, env.num_tasks())
    start = await env.reset(task)         # Reset(messages, state, tools)
    out = await env.step(start.state, {"role": "assistant", "content": "... \\boxed{42}"})
    # out: StepOut(messages=[...new user/tool messages...], done=True)
    score = await env.score(start.state)  # ScoreOut(reward=1.0, components={...}, metrics={...})
    await env.close(start.state)

Rules an environment follows:

- `reset`, `step`, `score`, `close` (and `load`) may be coroutines, which run on the server's event loop
  (CPU-heavy work in them belongs in `asyncio.to_thread`: a loop blocked for `hang_timeout_s` is treated
  as wedged and killed), or plain functions, which the server runs in a thread, off its loop, so
  synchronous environment code (a CPU-bound reward) never makes the server look wedged. One session's
  calls never overlap; different sessions' plain methods may run at once, in different threads.
- `state` is whatever the environment likes (it never leaves the server); everything returned is JSON.
- A step adds `system`, `user` or `tool` messages (never `assistant`: the model speaks through its sampled
  token ids), with text content; rewards are finite. The server checks each answer (`StepOut`,
  `ResetOut`, `ScoreOut` validate), so a breach fails as the environment's bug, where it happens.
- A problem with the request itself (task index out of range, malformed task, a step after `done`) raises
  `rollout_actors.kernel.CallerError`, which the rollout reports as a `caller` result. Any other exception is
  the environment's fault and is reported as `infrastructure`, with its traceback.
- Messages use the OpenAI chat format. Assistant messages arrive as
  `{"role": "assistant", "content": ..., "reasoning": ..., "tool_calls": [{"id", "type": "function",
  "function": {"name", "arguments"}}]}` where `arguments` is a JSON string (or already a dict) and
  `reasoning` (vLLM 0.33's name, in every mode) is there when the model reasoned. A step's message also carries
  `raw_text` (`RAW_TEXT_KEY`): the completion as the model wrote it, reasoning and tool-call markup
  included, for environments that parse text themselves; it is not part of the conversation. Tools, if
  any, are OpenAI function tools: `{"type": "function", "function": {"name", "description",
  "parameters": {json schema}}}`; the environment answers a tool call with
  `{"role": "tool", "tool_call_id": ..., "content": "..."}`.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, field_validator

from rollout_actors.kernel import CallerError, Failure, check_json, ref_target
from rollout_actors.kernel.faults import Fault

Message = dict[str, Any]
"""One chat message in OpenAI format."""

RAW_TEXT_KEY = "raw_text"
"""Key of the assistant message `step` receives that holds the completion's raw text (token mode: the
sampled ids decoded, stop token left out; chat mode: the content the server returned, exact when it ran
no reasoning or tool parser). The rollout keeps it out of the conversation it renders."""


@dataclass
class Reset:
    """What `Environment.reset` returns: the opening messages, the per-session state, the tools."""

    messages: list[Message]
    """Opening messages (system and user) that the model sees first."""
    state: Any
    """Per-session state; stays on the server, handed back to `step`, `score` and `close`."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools offered to the model, or None."""


OPENING_ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Roles of a session's opening messages (a few-shot prompt may hold assistant turns: they are rendered)."""
STEP_ROLES = frozenset({"system", "user", "tool"})
"""Roles of the messages a step adds. Never `assistant`: the model's turns are its sampled token ids,
bridged as sampled (contract 7), so an environment cannot speak for it."""


def check_messages(messages: Any, roles: frozenset[str], where: str) -> list[Message]:
    """Refuse (ValueError) messages the renderer could not take: the environment's bug, reported as
    `infrastructure` with its traceback where it happens, not as the request's fault after the fact."""
    if not isinstance(messages, list):
        raise ValueError(f"{where} must be a list of chat messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}[{i}] must be a chat message (a dict), got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in roles:
            raise ValueError(f"{where}[{i}] has role {role!r}; an environment may send {sorted(roles)}")
        parts = isinstance(content, list) and all(isinstance(part, dict) for part in content)
        if not (content is None or isinstance(content, str) or parts):
            raise ValueError(
                f"{where}[{i}].content must be a string, null or a list of content parts, "
                f"got {type(content).__name__}"
            )
    check_json(messages, where)
    return messages


class ResetOut(BaseModel):
    """The wire form of a started session."""

    session_id: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    server_name: str | None = None
    """Which env server holds the session (for logs and fault tests)."""

    @field_validator("messages", mode="before")
    @classmethod
    def _opening(cls, messages: Any) -> Any:
        return check_messages(messages, OPENING_ROLES, "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_are_json(cls, tools: Any) -> Any:
        check_json(tools, "tools")
        return tools


class ScoreOut(BaseModel):
    """The reward of a finished (or abandoned) episode. Numbers are finite: a NaN or infinite reward is
    the environment's bug, not a score (and JSON could not carry it)."""

    model_config = ConfigDict(revalidate_instances="always")  # one an environment built is checked too

    reward: FiniteFloat
    components: dict[str, FiniteFloat] = Field(default_factory=dict)
    """Named parts of the reward, e.g. `{"correct": 1.0, "format": 1.0}`."""
    metrics: dict[str, Any] = Field(default_factory=dict)
    """Anything else worth logging (turns taken, tool calls); JSON values."""

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics_are_json(cls, metrics: Any) -> Any:
        check_json(metrics, "metrics")
        return metrics


class StepOut(BaseModel):
    """The environment's answer to one assistant message."""

    model_config = ConfigDict(revalidate_instances="always")  # one an environment built is checked too

    messages: list[Message] = Field(default_factory=list)
    """New messages to append (tool results, a follow-up user turn); empty when nothing is added."""
    done: StrictBool
    """True when the episode is over; the next call is `score` (unless this step already carries it)."""
    reward: FiniteFloat | None = None
    """This step's own reward, for environments that reward per step (skyrl-gym); kept per turn in the
    result (`Turn.reward`) and in `trainer_samples`. It is not the episode's reward (`score`)."""
    score: ScoreOut | None = None
    """Set by the server, never by the environment: the episode's score when the step was asked to score
    if done (`score_if_done`) and was done. The session has then ended on its server (`close` ran)."""

    @field_validator("messages", mode="before")
    @classmethod
    def _added(cls, messages: Any) -> Any:
        return check_messages(messages, STEP_ROLES, "messages")


EnvCallKind = Literal["ok", "env", "infrastructure", "caller"]


class EnvResponse(BaseModel):
    """The answer to every env call on the pool side: values and failures alike travel as data.

    `kind` is classified where the failure happened: `caller` for a `CallerError` raised by the environment
    (or a session the caller got wrong), `env` for the environment's own faults (it raised, answered
    something that is not its answer, missed its deadline), `infrastructure` for ours (a dead or wedged
    env server, no live server).
    """

    success: bool
    value: Any = None
    """`ResetOut`/`StepOut`/`ScoreOut` as a dict, a task count, or None."""
    error: Failure | None = None
    kind: EnvCallKind = "ok"
    server_exit: str | None = None
    """How the env server that held the call ended (Ray's exit detail, or why it was judged wedged)."""
    server_name: str | None = None

    @classmethod
    def ok(cls, value: Any = None, server_name: str | None = None) -> EnvResponse:
        return cls(success=True, value=value, server_name=server_name)

    @classmethod
    def failed(
        cls,
        failure: Failure,
        kind: EnvCallKind = "infrastructure",
        server_name: str | None = None,
        server_exit: str | None = None,
    ) -> EnvResponse:
        return cls(success=False, error=failure, kind=kind, server_name=server_name, server_exit=server_exit)

    @classmethod
    def of(cls, fault: Fault, server_name: str | None = None, server_exit: str | None = None) -> EnvResponse:
        """The answer that reports `fault` (`env_actors.failures`): its class says its kind."""
        return cls.failed(fault.failure, fault.kind, server_name=server_name, server_exit=server_exit)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # One per env call crosses Ray: a plain tuple pickles at a fraction of pydantic's default state
        # (fields dict, fields-set set, extras), and the far side builds it through the validating
        # constructor as before.
        return _env_response, self._wire_fields()

    def _wire_fields(self) -> tuple[Any, ...]:
        return self.success, self.value, self.error, self.kind, self.server_exit, self.server_name

    @classmethod
    def from_exception(cls, exc: BaseException, server_name: str | None = None) -> EnvResponse:
        # Raised while running environment code (the server's `_guard`): the environment's fault.
        kind: EnvCallKind = "caller" if isinstance(exc, CallerError) else "env"
        failure = Failure.from_exception(exc)
        failure.fault = failure.fault or kind
        return cls.failed(failure, kind, server_name=server_name)


def _env_response(
    success: bool,
    value: Any,
    error: Failure | None,
    kind: EnvCallKind,
    server_exit: str | None,
    server_name: str | None,
) -> EnvResponse:
    return EnvResponse(
        success=success, value=value, error=error, kind=kind, server_exit=server_exit, server_name=server_name
    )


SessionMethod = Literal["reset", "step", "score", "agent"]


@dataclass(frozen=True, slots=True)
class EnvCall:
    """One session call in an `EnvServer.call_many` batch (a plain slots dataclass: one per env step, so
    nothing is validated on the way)."""

    method: SessionMethod
    session_id: str
    args: tuple[Any, ...]
    """`reset`: (task_index, task); `step`: (assistant message,); `score`: (); `agent`: (endpoint,)."""
    timeout_s: float
    score_if_done: bool = False
    """`step` only: a step that ends the episode also scores it and ends the session."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A slots dataclass pickles through `dataclasses.fields()` on both sides; its fields in order are
        # all it is.
        return EnvCall, (self.method, self.session_id, self.args, self.timeout_s, self.score_if_done)


@dataclass(frozen=True, slots=True)
class EnvAnswer:
    """A batched call's answer by ticket; `response` is None while the call still runs (ask `collect`)."""

    ticket: int
    response: EnvResponse | None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The response travels flat beside its ticket: every object the pickler meets costs Ray's
        # pickler a few lookups in Python (about 2 us), and there is one answer per env call.
        if self.response is None:
            return EnvAnswer, (self.ticket, None)
        return _env_answer, (self.ticket, *self.response._wire_fields())


def _env_answer(ticket: int, *response: Any) -> EnvAnswer:
    return EnvAnswer(ticket, _env_response(*response))


@ref_target("environment")
class Environment(abc.ABC):
    """Base class of environments served by `EnvServer`. Subclasses take their config as keyword
    arguments and implement the dataset view (`num_tasks`, `task`) and the session calls."""

    async def load(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Load what the environment serves (dataset, sandbox pool). Readiness waits for this."""

    @abc.abstractmethod
    def num_tasks(self) -> int:
        """How many tasks the dataset view holds (valid after `load`)."""

    @abc.abstractmethod
    def task(self, index: int) -> dict[str, Any]:
        """The task at `index` as a JSON dict; raises `CallerError` when out of range."""

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any]) -> Reset:
        """Start a session for `task`; raises `CallerError` for a malformed task."""

    @abc.abstractmethod
    async def step(self, state: Any, assistant_message: Message) -> StepOut:
        """Answer one assistant message."""

    @abc.abstractmethod
    async def score(self, state: Any) -> ScoreOut:
        """Score the session as it stands (finished or not)."""

    async def close(self, state: Any) -> None:  # noqa: B027 - optional hook, empty by default
        """Release what the session holds. Called exactly once per started session, even after failures."""


def check_index(index: int, count: int) -> int:
    """Validate a task index against a dataset of `count` tasks (bool is not an index)."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise CallerError(f"task index {index!r} is out of range: this environment has {count} tasks")
    return index


def tool_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """The arguments of an OpenAI tool call as a dict; `arguments` may be a JSON string or a dict.

    Raises `ValueError` with a short reason the environment can show the model as the tool's answer.
    """
    raw = (call.get("function") or {}).get("arguments")
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        raise ValueError(f"arguments must be a JSON object, got {type(raw).__name__}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"arguments are not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value
