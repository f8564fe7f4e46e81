"""The wire types of a rollout: request, client and sampling settings, turns and the result.

Everything here is a pydantic model that serialises to JSON: work is data, code is named by `Ref`, never
pickled. `Ref`, `Failure`, `CallerError` and `new_id` live in the kernel (`rollout_actors.kernel`) and are
re-exported here, so an orchestrator imports its request types from one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from renderer_actors.config import RendererConfig
from renderer_actors.parse import ToolCall
from rollout_actors.kernel import (
    DEFAULT_ALLOWED_PREFIXES,
    JSON,
    CallerError,
    Failure,
    Ref,
    new_id,
)

__all__ = [
    "DEFAULT_ALLOWED_PREFIXES",
    "JSON",
    "CallerError",
    "ClientConfig",
    "Failure",
    "Ref",
    "RendererConfig",
    "Result",
    "RolloutRequest",
    "SamplingConfig",
    "ToolCall",
    "Turn",
    "VersionChange",
    "new_id",
]

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
    policy_version: int | None = Field(default=None, ge=0)
    """The policy to sample from: None takes the active one when the rollout starts; N pins published
    version N (0: the base model). A version no server holds any more is a `caller` result."""


# ------------------------------------------------------------------------------------------- Result

ResultKind = Literal["ok", "model", "infrastructure", "caller", "cancelled"]


class VersionChange(BaseModel):
    """Where, inside one turn's completion, the policy changed (a full-weight update landed mid-turn)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at: int = Field(ge=0)
    """Index into the turn's `completion_ids`: tokens from here on were sampled under `version`."""
    version: int = Field(ge=0)


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
    policy_version: int = 0
    """The policy version this turn's sampling started under (0: the base model)."""
    version_changes: list[VersionChange] = Field(default_factory=list)
    """Empty unless the policy changed while this turn was being sampled (a full-weight update in keep
    mode): then each entry says from which completion token on a newer version sampled. The version of
    `completion_ids[i]` is that of the last change with `at <= i`, else `policy_version`."""

    def token_versions(self) -> list[int]:
        """The policy version of every completion token, aligned to `completion_ids`."""
        versions = [self.policy_version] * len(self.completion_ids)
        for change in sorted(self.version_changes, key=lambda c: c.at):
            versions[change.at :] = [change.version] * (len(versions) - change.at)
        return versions


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
