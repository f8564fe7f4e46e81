"""The subset of vLLM's OpenAI-compatible protocol the stand-in server speaks, as pydantic models.

Field names and shapes follow vLLM 0.33.0 (`vllm/entrypoints/openai/{completion,chat_completion}/protocol.py`,
`vllm/entrypoints/serve/engine/protocol.py`, `vllm/entrypoints/rl/online/api_router.py`): unknown request fields are accepted and ignored as vLLM does; responses carry
vLLM's extras (`token_ids`, `prompt_token_ids`, `stop_reason`, reasoning). Errors use vLLM's
`{"error": {"message", "type", "param", "code"}}` body with `code` = the HTTP status.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

FaultKind = Literal[
    "500", "timeout", "drop", "malformed", "not_json", "oov", "drip", "retry_after", "echo_headers"
]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds for `seed`


class RequestError(ValueError):
    """The request is invalid: a 400 `BadRequestError` with vLLM's body. Spelled as vLLM 0.33's
    `VLLMValidationError` is: the message, then `(parameter=..., value=...)` for what is set."""

    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.param = param
        self.value = value

    def __str__(self) -> str:
        extras = [f"{k}={v}" for k, v in (("parameter", self.param), ("value", self.value)) if v is not None]
        base = super().__str__()
        return f"{base} ({', '.join(extras)})" if extras else base


MAX_LOGPROBS = 20  # vLLM's default `--max-logprobs`


def _count(data: dict[str, Any], name: str) -> Any:
    """vLLM's `check_logprobs` (a before-validator): a logprob count is a number, positive or -1."""
    value = data.get(name)
    if value is not None and not isinstance(value, (int, float)):
        raise RequestError(f"`{name}` must be an integer.", name, value)
    if value is not None and value < 0 and value != -1:
        raise RequestError(f"`{name}` must be a positive value or -1.", name, value)
    return value


class _Request(BaseModel):
    # Like vLLM's OpenAIBaseModel: a field we do not implement is ignored, not refused.
    model_config = ConfigDict(extra="allow")


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -------------------------------------------------------------------------------------- requests


class CompletionRequest(_Request):
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    """Token ids (the main path), a batch of them, or text; required (vLLM's message when it is not)."""
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    """Sampling bounds are checked as vLLM checks them (`answers.check_sampling`): a 400 naming the
    parameter, not a body-validation error."""
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: int | None = None
    """Completions-style: the number of top logprobs per token (0 = only the sampled one; -1 = all, which
    is past `MAX_LOGPROBS`)."""
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool = False
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _as_vllm_checks(cls, data: Any) -> Any:
        """vLLM 0.33 `CompletionRequest.check_logprobs` and `validate_prompt_and_prompt_embeds`."""
        if isinstance(data, dict):
            _count(data, "logprobs")
            if data.get("prompt") in (None, "") and not data.get("prompt_embeds"):
                raise RequestError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return data


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    n: int | None = 1
    stream: bool | None = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool = False
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _as_vllm_checks(cls, data: Any) -> Any:
        """vLLM 0.33 `ChatCompletionRequest.check_logprobs`: `top_logprobs` asks for `logprobs: true`."""
        if isinstance(data, dict):
            top = _count(data, "top_logprobs")
            if top is not None and (top == -1 or top > 0) and not data.get("logprobs"):
                raise RequestError(
                    "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
                )
        return data


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None


class FaultSettings(BaseModel):
    """Server-wide fault injection, set by CLI flags and live by `POST /admin/faults`."""

    model_config = ConfigDict(extra="forbid")

    fault_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability that a model call (completions, chat) gets `fault` instead of an answer."""
    fault: FaultKind = "500"


# ------------------------------------------------------------------------------------- responses


class WeightVersionSpan(BaseModel):
    """Output tokens [start, end) were sampled by weights labelled `version` (vLLM 0.33 `outputs.py`)."""

    version: str
    start: int
    end: int


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class PerRequestMetrics(BaseModel):
    """vLLM's per-response timing (`--enable-per-request-metrics`); the stand-in knows its queue time."""

    queue_time_ms: float | None = None
    """From the request's arrival at the scheduler to its first scheduling."""


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    metrics: PerRequestMetrics | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """A JSON string, as OpenAI sends it."""


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    """The think block, with a reasoning parser. vLLM sends `reasoning` from 0.12 (0.33: only it); up to
    0.11 it was `reasoning_content`."""
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):  # vLLM omits the key when nothing was called
            data.pop("tool_calls", None)
        return data


class ChatLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadWeightsRequest(_Request):
    """`/update_weights`: backend-specific `update_info`, passed through to the weight transfer engine."""

    update_info: dict[str, Any] | list[dict[str, Any]]


class PauseQuery(BaseModel):
    """`/pause`'s query (vLLM 0.33 `rl/online/api_router.py`): an unknown parameter is ignored, a bad
    `mode` is FastAPI's validation error under `query.mode`."""

    mode: Literal["abort", "wait", "keep"] = "abort"
    clear_cache: bool = True


class InitWeightTransferRequest(_Request):
    """`/init_weight_transfer_engine`: the backend's `init_info` (checked by `weights.init_info_problems`)."""

    init_info: dict[str, Any]


class FinishWeightsRequest(_Request):
    weight_version: str | None = None
