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

from pydantic import BaseModel, ConfigDict, Field, model_serializer

FaultKind = Literal[
    "500", "timeout", "drop", "malformed", "not_json", "oov", "drip", "retry_after", "echo_headers"
]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds for `seed`


class _Request(BaseModel):
    # Like vLLM's OpenAIBaseModel: a field we do not implement is ignored, not refused.
    model_config = ConfigDict(extra="allow")


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -------------------------------------------------------------------------------------- requests


class CompletionRequest(_Request):
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    """Token ids (the main path), a batch of them, or text."""
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    """Sampling bounds are checked as vLLM checks them (`answers.check_sampling`): a 400 naming the
    parameter, not a body-validation error."""
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Completions-style: the number of top logprobs per token (0 = only the sampled one)."""
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool = False
    cache_salt: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0, le=20)
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


class InitWeightTransferRequest(_Request):
    """`/init_weight_transfer_engine`: the backend's `init_info` (checked by `weights.init_info_problems`)."""

    init_info: dict[str, Any]


class FinishWeightsRequest(_Request):
    weight_version: str | None = None
