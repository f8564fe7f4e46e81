"""Wire types shared by every part of ray-rollouts.

This module imports nothing of the project, so `renderer_actors` and `env_actors` may import it without
depending on the rest of `rollout_actors` (DESIGN.md, "Dependency direction"). Everything here is a
pydantic model that serialises to JSON: work is data, code is named by `Ref`, never pickled.
"""

from __future__ import annotations

import importlib
import traceback as traceback_module
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JSON = Any
"""A JSON value: scalars, lists, dicts (and, inside `Ref.config`, nested Refs)."""

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("rollout_actors.", "renderer_actors.", "env_actors.")
"""Module prefixes a Ref may name unless the caller widens the allowlist explicitly."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class CallerError(ValueError):
    """The request itself is invalid (bad Ref, bad task, bad sampling args): a `caller` result."""


# --------------------------------------------------------------------------------------------- Refs


class Ref(BaseModel):
    """Names code on the far side: `"package.module:attr"` plus a JSON config passed as keyword arguments.

    Config values are JSON scalars, lists, dicts or nested Refs; a nested Ref is resolved (and called)
    before the outer target is called with it.
    """

    model_config = ConfigDict(frozen=True)

    target: str
    """`"package.module:attr"`: the attribute is a class or a callable."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the target; JSON values and nested Refs only."""

    @field_validator("target")
    @classmethod
    def _target_shape(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr or not all(p.isidentifier() for p in module.split(".")):
            raise ValueError(f"Ref target must look like 'package.module:attr', got {value!r}")
        return value

    @field_validator("config", mode="before")
    @classmethod
    def _config_is_json(cls, value: Any) -> Any:
        _check_json(value, "config")
        return value


def _is_ref_dict(value: Any) -> bool:
    return isinstance(value, dict) and set(value) <= {"target", "config"} and "target" in value


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (str, int, float, bool, Ref)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings, got {key!r}")
            _check_json(item, f"{where}.{key}")
        return
    raise ValueError(f"{where}: {type(value).__name__} is not JSON; name code with a Ref instead")


def resolve_ref(ref: Ref | dict, allowed_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES) -> Any:
    """Import `ref.target` (only under an allowed module prefix) and call it with its resolved config.

    Raises `CallerError` for a target outside the allowlist, a module or attribute that does not exist,
    or a config the target rejects: these are the caller's mistakes, not ours.
    """
    ref = Ref.model_validate(ref) if isinstance(ref, dict) else ref
    target = load_target(ref.target, allowed_prefixes)
    kwargs = {key: _resolve_value(value, allowed_prefixes) for key, value in ref.config.items()}
    try:
        return target(**kwargs)
    except TypeError as exc:
        raise CallerError(f"Ref {ref.target} rejected its config: {exc}") from exc


def check_allowed(target: str, allowed_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES) -> None:
    """Refuse (as `CallerError`) a Ref target whose module is outside the allowlist, without importing it."""
    module_name = target.partition(":")[0]
    if not any(module_name == p.rstrip(".") or module_name.startswith(p) for p in allowed_prefixes):
        raise CallerError(
            f"Ref {target!r} is outside the allowlist {list(allowed_prefixes)}; widen it explicitly "
            "(allowed_ref_prefixes) to run code from other packages"
        )


def load_target(target: str, allowed_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES) -> Any:
    check_allowed(target, allowed_prefixes)
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CallerError(f"Ref {target!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise CallerError(f"Ref {target!r}: module {module_name!r} has no attribute {attr!r}") from exc


def _resolve_value(value: Any, allowed_prefixes: tuple[str, ...]) -> Any:
    if isinstance(value, Ref):
        return resolve_ref(value, allowed_prefixes)
    if _is_ref_dict(value):
        return resolve_ref(Ref.model_validate(value), allowed_prefixes)
    if isinstance(value, list):
        return [_resolve_value(v, allowed_prefixes) for v in value]
    if isinstance(value, dict):
        return {k: _resolve_value(v, allowed_prefixes) for k, v in value.items()}
    return value


# ------------------------------------------------------------------------------------------- Config


class ClientConfig(BaseModel):
    """How a rollout reaches its inference server. One client per rollout, built from this, closed in
    `finally`. The defaults are the bounded request budget of DESIGN.md contract 6."""

    model_config = ConfigDict(frozen=True)

    base_url: str
    """OpenAI-compatible base URL, e.g. `http://127.0.0.1:8000/v1`."""
    model: str
    """Model (or LoRA adapter) name sent with every request."""
    api_key_var: str | None = None
    """Name of the environment variable holding the API key. The key itself never travels."""
    read_timeout: float = 600.0
    """Seconds to wait for a response, per attempt."""
    connect_timeout: float = 30.0
    write_timeout: float = 30.0
    pool_timeout: float = 30.0
    max_retries: int = Field(default=1, ge=0, le=3)
    """SDK retries per call; the bound keeps the worst case of one call at (1 + max_retries) x read."""
    max_connections: int = 2048
    keepalive_expiry: float = 4.0
    """Below uvicorn's 5 s keep-alive, so the server never resets an idle connection under us."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra headers; never put a secret here (use `api_key_var`)."""


class SamplingConfig(BaseModel):
    """Sampling settings sent to the server. Unknown keys are refused, so a typo is a `caller` result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=512, ge=1)
    """Per turn."""
    seed: int | None = None
    logprobs: bool = True
    """Return the sampled token's logprob for every completion token."""
    stop: list[str] | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Server-specific fields passed through verbatim (e.g. vLLM's `top_k`, `repetition_penalty`)."""


class RendererConfig(BaseModel):
    """Which renderer (tokenizer + chat template) a token-mode rollout uses."""

    model_config = ConfigDict(frozen=True)

    tokenizer: str | None = None
    """Tokenizer name or path; `None` means the model name from `ClientConfig`."""
    family: Literal["auto", "qwen3", "hf"] = "auto"
    """Template family: `qwen3` bridges natively; `hf` is any HF chat template (full render + prefix check)."""
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the chat template, e.g. `{"enable_thinking": false}`."""
    history: Literal["append", "fork_on_rewrite"] = "append"
    """When a full re-render would differ from the bridged history: keep appending, or fork a branch."""
    multiplex: int = Field(default=256, ge=1)
    """Concurrent rollouts per renderer actor before the pool grows. Not part of the pool key."""


# ------------------------------------------------------------------------------------------ Request

RolloutMode = Literal["token", "chat"]
Lane = str


class RolloutRequest(BaseModel):
    """One rollout: a task of an environment, run against a model endpoint with sampling settings."""

    request_id: str = Field(default_factory=lambda: new_id("req"))
    lease_id: str = Field(default_factory=lambda: new_id("lease"))
    """Stays the same across re-dispatches: at most one result per lease reaches the caller."""
    group_id: str | None = None
    env: Ref
    """The environment, e.g. `Ref("env_actors.examples.math_env:MathEnv", {})`."""
    task_index: int | None = None
    """Index into the environment's task list (or give `task` directly)."""
    task: dict[str, Any] | None = None
    client: ClientConfig
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    mode: RolloutMode = "token"
    renderer: RendererConfig = Field(default_factory=RendererConfig)
    max_turns: int = Field(default=8, ge=1)
    deadline_s: float = Field(default=3600.0, gt=0)
    """Wall-clock budget for the whole rollout."""
    lane: Lane = "train"
    policy_version: int | None = None


# ------------------------------------------------------------------------------------------- Result

ResultKind = Literal["ok", "model", "infrastructure", "caller", "cancelled"]


class Failure(BaseModel):
    """Why a request failed, classified on the side where it failed."""

    type: str
    """Exception type name, e.g. `APITimeoutError`, `ActorDiedError`, `CallerError`."""
    message: str
    status_code: int | None = None
    traceback: str | None = None
    """Traceback text from the failing side (Ray strips causes at actor boundaries)."""

    @classmethod
    def from_exception(cls, exc: BaseException, status_code: int | None = None) -> Failure:
        return cls(
            type=type(exc).__name__,
            message=str(exc) or type(exc).__name__,
            status_code=status_code,
            traceback="".join(traceback_module.format_exception(type(exc), exc, exc.__traceback__)),
        )


class ToolCall(BaseModel):
    name: str | None
    arguments: Any = None
    status: Literal["ok", "invalid_json", "unclosed", "missing_name", "unknown_tool"] = "ok"
    raw: str = ""


class Turn(BaseModel):
    """One model call: what was sent, what was sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    """Exactly the ids the server sampled."""
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    branch: int = 0
    """Trajectory branch; a fork (template rewrote history) starts a new one."""
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class Result(BaseModel):
    """Exactly one per request, whatever happened."""

    request_id: str
    lease_id: str
    group_id: str | None = None
    kind: ResultKind
    reward: float | None = None
    components: dict[str, float] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    turns: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    error: Failure | None = None
    forked: bool = False
    """True when the trajectory forked into more than one branch."""
    attempts: int = 1
    """Dispatches it took (re-dispatch after a lost worker counts)."""
    policy_version_start: int | None = None
    policy_version_end: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @classmethod
    def failed(cls, request: RolloutRequest, kind: ResultKind, failure: Failure, **extra: Any) -> Result:
        return cls(
            request_id=request.request_id,
            lease_id=request.lease_id,
            group_id=request.group_id,
            kind=kind,
            error=failure,
            **extra,
        )
