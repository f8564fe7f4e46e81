"""The wire types of a rollout: request, client and sampling settings, turns and the result.

Everything here is a pydantic model that serialises to JSON: work is data, code is named by `Ref`, never
pickled. `Ref`, `Failure`, `CallerError` and `new_id` live in the kernel (`rollout_actors.kernel`) and are
re-exported here, so an orchestrator imports its request types from one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, computed_field

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
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """The caller's own data (JSON), copied onto the result untouched."""
    return_messages: bool = False
    """Also return the conversation as chat messages (`Result.messages`). Off by default: they repeat
    the token ids as text and would double a long trajectory's result."""


# ------------------------------------------------------------------------------------------- Result

ResultKind = Literal["ok", "model", "infrastructure", "caller", "cancelled"]


class VersionChange(BaseModel):
    """Where, inside one turn's completion, the policy changed (a full-weight update landed mid-turn)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at: int = Field(ge=0)
    """Index into the turn's `completion_ids`: tokens from here on were sampled under `version`."""
    version: int = Field(ge=0)


class Turn(BaseModel):
    """One model call. A turn stores what it added to its branch, never its whole prompt: the prompt it
    was sampled from is its branch's earlier turns (`new_prompt_ids` + `completion_ids` each) followed by
    its own `new_prompt_ids`. So a result grows with its tokens, not with turns x context (contract 11);
    `rollout_actors.samples` derives full prompts and trainer samples."""

    new_prompt_ids: list[int]
    """The prompt ids this turn added after its branch's previous turn (the rendered environment
    messages and generation prompt); on a branch's first turn, its whole prompt."""
    completion_ids: list[int]
    """Exactly the ids the server sampled."""
    logprobs: list[float] = Field(default_factory=list)
    """The sampled tokens' logprobs, aligned to `completion_ids` (empty when not requested)."""
    finish_reason: str | None = None
    branch: int = 0
    """Trajectory branch; a fork (the template rewrote history) starts a new one."""
    synthetic_ids: int = Field(default=0, ge=0)
    """How many leading ids of `new_prompt_ids` were synthesised rather than rendered: the close token
    the renderer appends after a completion cut by `length`. Never sampled, so never trained on."""
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
    """Exactly one per request, whatever happened. `rollout_actors.samples.trainer_samples(result)` gives
    a trainer's view of it: per branch, the token ids, loss mask, logprobs and policy versions."""

    request_id: str
    lease_id: str
    group_id: str | None = None
    lane: Lane = "train"
    task_index: int | None = None
    seed: int | None = None
    """The sampling seed the rollout ran with (a group's members get consecutive seeds)."""
    model: str | None = None
    """The model name the rollout's calls sent: the published adapter's name (e.g. `policy-v3`) when the
    plane switched it to one, else the base model."""
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """The request's `metadata`, passed through untouched."""
    kind: ResultKind
    reward: float | None = None
    components: dict[str, float] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    turns: list[Turn] = Field(default_factory=list)
    """Every turn sampled, also for a failed or cancelled rollout (what it had when it stopped)."""
    messages: list[dict[str, Any]] = Field(default_factory=list)
    """The conversation as chat messages, only when the request asked for it (`return_messages`)."""
    error: Failure | None = None
    forked: bool = False
    """True when the trajectory forked into more than one branch."""
    attempts: int = 1
    """Dispatches it took (re-dispatch after a lost worker counts)."""
    policy_version_start: int | None = None
    """The policy version the rollout started under (0: the base model); None if it never reached one
    (refused before dispatch)."""
    policy_version_end: int | None = None
    """The version new rollouts were getting when the plane delivered this result."""
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def versions_behind(self) -> int | None:
        """How many versions the newest policy was ahead of this rollout's start version when it was
        delivered (its off-policy lag): `policy_version_end - policy_version_start`."""
        if self.policy_version_start is None or self.policy_version_end is None:
            return None
        return self.policy_version_end - self.policy_version_start

    @classmethod
    def of(cls, request: RolloutRequest, kind: ResultKind, **fields: Any) -> Result:
        """A result for `request`, carrying what the request says about itself (ids, lane, task, seed,
        model, metadata, start version)."""
        base: dict[str, Any] = dict(
            request_id=request.request_id,
            lease_id=request.lease_id,
            group_id=request.group_id,
            lane=request.lane,
            task_index=request.task_index,
            seed=request.sampling.seed,
            model=request.client.model,
            metadata=request.metadata,
            policy_version_start=request.policy_version,
        )
        base.update(fields)
        return cls(kind=kind, **base)

    @classmethod
    def failed(cls, request: RolloutRequest, kind: ResultKind, failure: Failure, **extra: Any) -> Result:
        return cls.of(request, kind, error=failure, **extra)
