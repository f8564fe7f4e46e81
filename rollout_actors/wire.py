"""The wire types of a rollout: request, client and sampling settings, turns and the result.

Everything here is a pydantic model that serialises to JSON: work is data, code is named by `Ref`, never
pickled. `Ref`, `Failure`, `CallerError` and `new_id` live in the kernel (`rollout_actors.kernel`) and are
re-exported here, so an orchestrator imports its request types from one place.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    computed_field,
    field_validator,
    model_validator,
)

from renderer_actors.config import RendererConfig
from renderer_actors.parse import ToolCall
from rollout_actors.kernel import (
    DEFAULT_ALLOWED_PREFIXES,
    EXACT_JSON,
    JSON,
    CallerError,
    Failure,
    Ref,
    check_json,
    new_id,
)
from rollout_actors.kernel.renamed import renamed_fields, warn_renamed
from rollout_actors.timings import RolloutTimings, TurnTimings

__all__ = [
    "DEFAULT_ALLOWED_PREFIXES",
    "JSON",
    "CallerError",
    "ClientConfig",
    "Dispatch",
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


MAX_TOKENS_LIMIT = 2**24  # 16M tokens per turn: past any model's context; larger is a typo or an attack
SEED_RANGE = (-(2**63), 2**63 - 1)  # vLLM's bound for `seed` (int64)
MAX_TIMEOUT_S = 86_400.0  # a day: any finite budget a rollout could mean; inf/NaN are refused
MAX_CONNECTIONS = 65_536  # one process cannot hold more sockets to one server than its port range
PROTOCOL_FIELDS = frozenset(
    {
        "model", "prompt", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "seed", "logprobs", "top_logprobs", "stop", "n", "stream",
        "stream_options", "echo", "return_token_ids", "return_tokens_as_token_ids",
        "return_weight_versions", "cache_salt", "add_generation_prompt", "continue_final_message",
        "truncate_prompt_tokens", "prompt_embeds",
    }
)  # fmt: skip
"""Request fields the plane sets itself, or that change the prompt the server samples from
(`truncate_prompt_tokens`, `prompt_embeds`): `extra_body` may not set them, or the recorded prompt and
settings would not be what was sampled from."""
PROTOCOL_HEADERS = frozenset(
    {"authorization", "x-request-id", "x-session-id", "content-type", "content-length", "host"}
)
"""Headers the plane (or HTTP itself) sets: `ClientConfig.headers` may not override them."""
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 token
_ENV_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]


class ClientConfig(BaseModel):
    """How a rollout reaches its inference server. One client per rollout, built from this, closed in
    `finally`. The defaults are the bounded request budget of docs/design.md contract 6. Unknown keys and
    absurd values are refused (a `caller` result naming the field)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str | None = None
    """OpenAI-compatible base URL, e.g. `http://127.0.0.1:8000/v1`. May be left out when the plane routes
    to its own endpoints (`PlaneConfig.endpoints` or an `InferenceServerSet`)."""
    model: str = Field(min_length=1, max_length=512)
    """Model (or LoRA adapter) name sent with every request."""
    api_key_var: str | None = Field(default=None, pattern=_ENV_VAR.pattern, max_length=256)
    """Name of the environment variable holding the API key. The key itself never travels."""
    read_timeout_s: Timeout = 600.0
    """Seconds to wait for the next bytes of a response, per attempt."""
    connect_timeout_s: Timeout = 30.0
    write_timeout_s: Timeout = 30.0
    pool_timeout_s: Timeout = 30.0
    call_timeout_s: Timeout | None = None
    """Total seconds one model call may take, retries and `Retry-After` waits included; no server
    behaviour (a slow drip that keeps resetting the read timeout, a long `Retry-After`) stretches it.
    None: `(1 + max_retries) x (connect_timeout_s + read_timeout_s)`."""
    max_retries: int = Field(default=1, ge=0, le=3)
    """SDK retries per call, inside `call_timeout_s`."""
    max_connections: int = Field(default=2048, ge=1, le=MAX_CONNECTIONS)
    keepalive_expiry_s: float = Field(default=4.0, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    """Below uvicorn's 5 s keep-alive, so the server never resets an idle connection under us."""
    headers: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Extra headers; never put a secret here (use `api_key_var`). Protocol headers cannot be overridden."""

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parsed = urlsplit(value) if len(value) <= 2048 and value.isprintable() else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"base_url must be an http(s) URL with a host, got {value[:100]!r}")
        return value

    @field_validator("headers")
    @classmethod
    def _plain_headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not _HEADER_NAME.match(name) or len(name) > 256:
                raise ValueError(f"header name {name[:100]!r} is not an HTTP token")
            if name.lower() in PROTOCOL_HEADERS:
                raise ValueError(f"header {name!r} is set by the plane and cannot be overridden")
            if any(ch in text for ch in "\r\n\0") or len(text) > 8192:
                raise ValueError(f"header {name!r}: CR, LF or NUL in its value (or longer than 8 KiB)")
        return value

    @property
    def total_call_timeout_s(self) -> float:
        """`call_timeout_s`, or the default derived from the per-attempt timeouts."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return (1 + self.max_retries) * (self.connect_timeout_s + self.read_timeout_s)

    @property
    def call_deadline(self) -> float:
        """The old name of `total_call_timeout_s` (a duration, not a deadline)."""
        warn_renamed("ClientConfig.call_deadline", "total_call_timeout_s")
        return self.total_call_timeout_s


class SamplingConfig(BaseModel):
    """Sampling settings sent to the server. Unknown keys and absurd values are refused, so a typo is a
    `caller` result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    """vLLM 0.33 answers 400 outside [0, 2]."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int = Field(default=512, ge=1, le=MAX_TOKENS_LIMIT)
    """Per turn."""
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    logprobs: bool = True
    """Return the sampled token's logprob for every completion token."""
    stop: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        default=None, max_length=64
    )
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Server-specific fields passed through verbatim (e.g. vLLM's `top_k`, `repetition_penalty`). JSON
    only; a field the plane sets itself (`PROTOCOL_FIELDS`: prompt, temperature, ...) is refused."""

    @field_validator("extra_body")
    @classmethod
    def _no_protocol_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(set(value) & PROTOCOL_FIELDS)
        if clash:
            raise ValueError(f"extra_body may not set {clash}: the plane sets them (use the typed fields)")
        check_json(value, "extra_body")
        return value


# ------------------------------------------------------------------------------------------ Request

RolloutMode = Literal["token", "chat", "agent"]
"""`token`: the plane renders and samples from token ids; `chat`: the server renders; `agent`: the
environment's agent program drives the turns through an endpoint the rollout serves
(`rollout_actors.rollout.agent`), each call rendered and sampled as in token mode."""
Lane = str

MAX_ID_CHARS = 256  # ids travel as an HTTP header and into every log line: ample for any naming scheme
MAX_REQUEST_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a unit mistake (ms for s), not a rollout


def check_id(value: str) -> str:
    # A request id is sent as a header (`X-Session-ID`): CR/LF would split it, non-ASCII cannot be encoded.
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise ValueError(f"must be 1 to {MAX_ID_CHARS} characters, got {len(value)}")
    if not (value.isascii() and value.isprintable()):
        raise ValueError(f"must be printable ASCII (no CR, LF or control characters), got {value[:40]!r}")
    return value


RequestId = Annotated[str, AfterValidator(check_id)]
"""An id of a request, lease or group: 1 to 256 printable ASCII characters."""


class RolloutRequest(BaseModel):
    """One rollout: a task of an environment, run against a model endpoint with sampling settings.

    Unknown fields are refused, ids are bounded printable ASCII, and every free-form field (`task`,
    `sampling.extra_body`, `renderer.template_kwargs`) holds JSON only: a request is data (contract 1),
    so anything else is the caller's mistake, refused before it reaches Ray's serialiser."""

    model_config = ConfigDict(extra="forbid")

    request_id: RequestId = Field(default_factory=lambda: new_id("req"))
    lease_id: RequestId = Field(default_factory=lambda: new_id("lease"))
    """Stays the same across re-dispatches: at most one result per lease reaches the caller."""
    group_id: RequestId | None = None
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
    timeout_s: float = Field(default=3600.0, gt=0, le=MAX_REQUEST_TIMEOUT_S, allow_inf_nan=False)
    """Seconds the whole request may take, re-dispatches and its env pool's start included: the plane
    turns it into a deadline on its loop's clock when it starts the request (was `deadline_s`)."""
    lane: Lane = "train"
    policy_version: int | None = Field(default=None, ge=0)
    """The policy to sample from: None takes the active one when the rollout starts; N pins published
    adapter version N, or the full weights the servers hold now (0: the weights they started with). A
    version no server holds any more is a `caller` result."""
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """The caller's own data (JSON), copied onto the result untouched."""
    return_messages: bool = False
    """Also return the conversation as chat messages (`Result.messages`). Off by default: they repeat
    the token ids as text and would double a long trajectory's result."""

    _renamed = model_validator(mode="before")(renamed_fields({"deadline_s": "timeout_s"}))

    @field_validator("task", mode="before")
    @classmethod
    def _task_is_json(cls, value: Any) -> Any:
        if value is not None:
            check_json(value, "task")
        return value

    @model_validator(mode="after")
    def _free_form_is_json(self) -> RolloutRequest:
        check_json(self.sampling.extra_body, "sampling.extra_body")
        check_json(self.renderer.template_kwargs, "renderer.template_kwargs")
        check_json(self.metadata, "metadata")  # finite numbers, bounded depth: it is copied onto the result
        return self


class Dispatch(BaseModel):
    """One dispatch of a request to a rollout worker: the caller's request as it was submitted, and what
    the plane decided for this dispatch beside it (it never rewrites the request). The worker runs
    `rollout_request()`."""

    model_config = ConfigDict(extra="forbid")

    request: RolloutRequest
    """The caller's request, as the plane validated it."""
    attempt: int = Field(default=1, ge=1)
    """Which dispatch of the request this is (re-dispatches keep the lease id)."""
    endpoint: str | None = None
    """The inference base URL the plane routed it to, for all its turns; None: `request.client.base_url`."""
    model: str | None = None
    """The served model name of the policy it samples from (a published adapter); None: the request's."""
    policy_version: int = 0
    """The policy version the rollout starts under."""
    remaining_timeout_s: float = Field(gt=0)
    """What was left of the request's `timeout_s` when the plane dispatched it: this dispatch's own
    timeout (a duration, not the plane's deadline: loop clocks differ between processes)."""
    env_pool: str
    """The actor name of the serving env pool incarnation (`pool_lookup.PoolRoute`)."""
    renderer_pool: str | None = None
    """The actor name of the serving renderer pool incarnation; None for a chat-mode rollout."""
    quarantine: bool = False
    """Its env session runs alone on an env server of its own, where a loss names it: its earlier
    dispatches lost env servers at one point, each among other sessions (`plane.redispatch`)."""

    def rollout_request(self) -> RolloutRequest:
        """The request as this dispatch runs it: the plane's endpoint, model, policy and time left."""
        request = self.request
        client = request.client
        if self.endpoint is not None or self.model is not None:
            client = client.model_copy(
                update={"base_url": self.endpoint or client.base_url, "model": self.model or client.model}
            )
        renderer = request.renderer
        if self.model is not None and renderer.tokenizer is None:
            # An adapter does not change the vocabulary: the renderer keeps the base model's tokenizer.
            renderer = renderer.model_copy(update={"tokenizer": request.client.model})
        return request.model_copy(
            update={
                "client": client,
                "renderer": renderer,
                "policy_version": self.policy_version,
                "timeout_s": self.remaining_timeout_s,
            }
        )


# ------------------------------------------------------------------------------------------- Result

ResultKind = Literal["ok", "model", "env", "infrastructure", "caller", "cancelled"]


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

    model_config = EXACT_JSON  # crosses Ray as its JSON

    new_prompt_ids: list[int]
    """The prompt ids this turn added after its branch's previous turn (the rendered environment
    messages and generation prompt); on a branch's first turn, its whole prompt."""
    completion_ids: list[int]
    """Exactly the ids the server sampled."""
    logprobs: list[float] = Field(default_factory=list)
    """The sampled tokens' logprobs, aligned to `completion_ids` (empty when not requested): under the
    distribution sampled from, after temperature, top-k and top-p (servers `ServerSpec` launches run
    `--logprobs-mode processed_logprobs`; vLLM's default would return the raw model's)."""
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
    reward: float | None = None
    """The environment's per-step reward for this turn (`StepOut.reward`), None when it gave none."""
    timings: TurnTimings = Field(default_factory=TurnTimings)
    """Seconds this turn spent rendering, in its model call, parsing and in the env's step."""

    def token_versions(self) -> list[int]:
        """The policy version of every completion token, aligned to `completion_ids`."""
        versions = [self.policy_version] * len(self.completion_ids)
        for change in sorted(self.version_changes, key=lambda c: c.at):
            versions[change.at :] = [change.version] * (len(versions) - change.at)
        return versions


class Result(BaseModel):
    """Exactly one per request, whatever happened. `rollout_actors.samples.trainer_samples(result)` gives
    a trainer's view of it: per branch, the token ids, loss mask, logprobs and policy versions."""

    model_config = EXACT_JSON  # crosses Ray as its JSON

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
    timings: RolloutTimings = Field(default_factory=RolloutTimings)
    """Seconds it waited before its first turn (lane, env pool, worker, env reset, renderer slot) and
    spent in teardown; its turns' phases are on each `Turn.timings`."""

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

    @classmethod
    def refused(cls, raw: Any, request_id: str | None, exc: Exception, group_id: str | None = None) -> Result:
        """The `caller` result of a request that did not validate (`raw`: whatever was given). Its ids and
        lane are the payload's own where they are valid (so the caller can match it), fresh otherwise;
        the message names each field at fault and echoes no value (one may be huge or hostile)."""
        fields = raw if isinstance(raw, dict) else raw.__dict__ if isinstance(raw, BaseModel) else {}
        now = time.time()
        result = cls(
            request_id=valid_id(request_id) or new_id("req"),
            lease_id=valid_id(fields.get("lease_id")) or new_id("lease"),
            group_id=group_id or valid_id(fields.get("group_id")),
            lane=valid_id(fields.get("lane")) or "train",
            kind="caller",
            error=CallerError(
                f"invalid request: {describe_invalid(exc)}", type_name=type(exc).__name__
            ).failure,
            started_at=now,
            finished_at=now,
        )
        try:  # the caller's own tag is worth keeping when it is valid JSON
            metadata = _METADATA.validate_python(fields.get("metadata") or {})
            check_json(metadata, "metadata")
            result.metadata = metadata
        except Exception:  # not JSON, or nested deeper than a request may be: dropped
            pass
        return result


MAX_REPORTED_ERRORS = 5  # validation errors named in one caller result; the rest are counted


def valid_id(value: Any) -> str | None:
    """`value` if it is a usable id (see `check_id`), else None."""
    try:
        return check_id(value) if isinstance(value, str) else None
    except ValueError:
        return None


def describe_invalid(exc: Exception) -> str:
    """What was wrong with a request, field by field (its path first), without echoing values."""
    if isinstance(exc, ValidationError):
        parts = []
        for error in exc.errors(include_url=False, include_input=False)[:MAX_REPORTED_ERRORS]:
            where = ".".join(str(part) for part in error["loc"]) or "request"
            parts.append(f"{where}: {error['msg']}")
        more = exc.error_count() - len(parts)
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    if isinstance(exc, KeyError):  # an unknown lane
        return _clip(f"lane: {exc.args[0] if exc.args else exc}")
    if isinstance(exc, RecursionError):
        return "request: nested too deeply to validate"
    return _clip(str(exc) or type(exc).__name__)


def _clip(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 4 :]}"


_METADATA: TypeAdapter[dict[str, JsonValue]] = TypeAdapter(dict[str, JsonValue])
