"""One model call, in token mode (`/v1/completions` with a token-id prompt) or chat mode (relayed
`/v1/chat/completions`), validated into a `Sampled` or rejected as `MalformedResponse`.

Field names follow vLLM's OpenAI protocol: `return_token_ids` asks for `choices[i].token_ids` (and
`prompt_token_ids`); completions logprobs come as `{tokens, token_logprobs, ...}`, chat logprobs as
`{content: [{token, logprob, ...}]}`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
import orjson

from rollout_actors.rollout.client import CALL_DEADLINE, httpx
from rollout_actors.rollout.failures import CallDeadlineExceeded, MalformedResponse, TurnAborted
from rollout_actors.rollout.metrics import MODEL_CALL_LATENCY
from rollout_actors.wire import SamplingConfig


@dataclass
class Sampled:
    """What the server sampled for one turn."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_ids: list[int] | None = None
    message: dict[str, Any] = field(default_factory=dict)
    """Chat mode only: the assistant message as the server parsed it."""
    weight_versions: list[tuple[str, int]] = field(default_factory=list)
    """vLLM's `weight_versions` (0.33+): (weights label, first completion index) per run of tokens; empty
    when the server does not report them."""
    queue_s: float = 0.0
    """The server's own queue time (vLLM's `metrics.queue_time_ms`, `--enable-per-request-metrics`); 0 when
    it does not report it."""


@dataclass(frozen=True)
class CallTags:
    """What a model call carries besides the prompt: an `X-Request-Id` that names the rollout and turn in
    the server's logs, and the `cache_salt` of the policy version (no prefix-cache entry computed by an
    older policy serves a newer one)."""

    request_id: str
    cache_salt: str | None = None


FINISHED_NORMALLY = ("stop", "length", "tool_calls", "repetition", None)
"""vLLM 0.33 `FINISH_REASON_STRINGS`: stop, length, abort, error, repetition (+ chat's tool_calls).
`abort` (an engine abort, `/pause?mode=abort`) and `error` never end a turn as if it were complete."""


def _sampling_kwargs(sampling: SamplingConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed
    if sampling.stop:
        kwargs["stop"] = sampling.stop
    return kwargs


MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; an id past it cannot be a token of any model


def _ids(value: Any, what: str, vocab_size: int | None = None) -> list[int]:
    """Token ids exactly as the server sent them, or `MalformedResponse`: a list of ints, each inside the
    vocabulary (`vocab_size` when known, else the int32 range). An id outside it is the server's fault and
    is never recorded as sampled."""
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise MalformedResponse(f"response has no valid {what} (got {type(value).__name__})")
    limit = vocab_size or MAX_TOKEN_ID + 1
    if value and (min(value) < 0 or max(value) >= limit):
        bad = next(i for i in value if not 0 <= i < limit)
        raise MalformedResponse(f"{what} holds token id {bad}, outside the vocabulary [0, {limit})")
    return value


async def _bounded(call: Awaitable[Any], timeout_s: float) -> Any:
    """Await one model call under its total timeout (`ClientConfig.total_call_timeout_s`). The SDK's own
    timeouts are per attempt and per read: a server that drips one byte at a time, or asks for a long
    `Retry-After`, would stretch them; this one it cannot (and a `Retry-After` past it is not waited for:
    the client answers the server's refusal at once, `client.CALL_DEADLINE`). A body that claims JSON and is not is
    the server's fault too: `MalformedResponse`."""
    scope = asyncio.timeout(timeout_s)
    started, outcome = time.monotonic(), "error"
    token = CALL_DEADLINE.set(asyncio.get_running_loop().time() + timeout_s)  # no retry waits past it
    try:
        async with scope:
            answer = await call
        outcome = "ok"
        return answer
    except TimeoutError as exc:
        if scope.expired():
            raise CallDeadlineExceeded(f"model call exceeded its total timeout of {timeout_s:g} s") from exc
        raise
    except json.JSONDecodeError as exc:
        raise MalformedResponse(f"response body is not JSON: {exc}") from exc
    finally:
        CALL_DEADLINE.reset(token)
        MODEL_CALL_LATENCY.record(time.monotonic() - started, {"outcome": outcome})


def _extra(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


class PromptJson:
    """A growing prompt's JSON array, encoded once: each call encodes only the ids appended since the last
    one. A long agentic trajectory's prompt runs to 100k+ ids; encoding it whole every turn cost ~1.3 ms
    of the rollout worker's CPU per call at 100k, more than the rest of the turn's own work.

    Its owner (one rollout's `TokenTurns`) only ever appends to the prompt list it passes, or passes
    another list (a fork, a resumed turn's prompt + partial completion): anything but the same list
    grown is encoded afresh."""

    __slots__ = ("_source", "_count", "_last", "_inner")

    def __init__(self) -> None:
        self._source: list[int] | None = None
        self._count = 0
        self._last = -1
        self._inner = b""

    def encode(self, ids: list[int]) -> bytes:
        count = self._count
        if ids is not self._source or len(ids) < count or (count and ids[count - 1] != self._last):
            self._source, count, self._inner = ids, 0, b""
        if len(ids) > count:
            added = orjson.dumps(ids[count:])[1:-1]
            self._inner = self._inner + b"," + added if count else added
            self._count, self._last = len(ids), ids[-1]
        return b"[" + self._inner + b"]"


def _completion_body(prompt_ids: list[int], fields: dict[str, Any], prompt_json: PromptJson | None) -> bytes:
    """`{"prompt": [...], **fields}` as JSON; the prompt from `prompt_json` when there is one."""
    if prompt_json is None:
        return orjson.dumps({"prompt": prompt_ids, **fields})
    return b'{"prompt":' + prompt_json.encode(prompt_ids) + b"," + orjson.dumps(fields)[1:]


async def complete_tokens(
    client: openai.AsyncOpenAI,
    model: str,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    *,
    timeout_s: float,
    vocab_size: int | None = None,
    stop_token_ids: Sequence[int] = (),
    tags: CallTags | None = None,
    prompt_json: PromptJson | None = None,
) -> Sampled:
    # Through `client.post`, so the client's retries, timeouts, headers and status errors all hold, but
    # with the body encoded once by orjson and the response read as raw JSON: `completions.create` walks
    # every prompt id through the SDK's TypedDict transform and json module, and parsing the answer into
    # SDK models (`cast_to=Completion`) cost more than the rest of a turn; only a few fields are read.
    #
    # The sampled ids come back as the logprobs' tokens (`return_tokens_as_token_ids`: "token_id:<id>"),
    # not through `return_token_ids`, which also echoes the whole prompt (`prompt_token_ids`): on a long
    # trajectory that is the context again in every answer, for the server to encode and us to parse.
    #
    # The prompt is encoded incrementally when the caller keeps a `PromptJson` for it.
    fields: dict[str, Any] = {"model": model, **_sampling_kwargs(sampling)}
    fields["logprobs"] = 1 if sampling.logprobs else 0  # 0: the sampled tokens alone, for their ids
    fields.update({**sampling.extra_body, **_protocol_fields(tags, token_mode=True)})
    if stop_token_ids:  # the renderer's (the template's turn close among them), with any the caller set
        fields["stop_token_ids"] = sorted({*stop_token_ids, *sampling.extra_body.get("stop_token_ids", ())})
    call = client.post(
        "/completions",
        cast_to=httpx.Response,
        content=_completion_body(prompt_ids, fields, prompt_json),
        options={"headers": _headers(tags)},
    )
    response = await _bounded(call, timeout_s)
    data = _json_object(response)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponse("completion response has no choices")
    choice = choices[0]
    token_logprobs = choice.get("logprobs")
    if not isinstance(token_logprobs, dict):
        raise MalformedResponse("completion response has no logprobs (asked for the sampled token ids)")
    completion_ids = _ids(_token_ids(token_logprobs.get("tokens")), "choices[0].logprobs.tokens", vocab_size)
    logprobs: list[float] = []
    if sampling.logprobs:
        values = token_logprobs.get("token_logprobs")
        if not isinstance(values, list) or len(values) != len(completion_ids):
            raise MalformedResponse("completion logprobs missing or not aligned with the sampled tokens")
        try:
            logprobs = [float(x) for x in values]
        except (TypeError, ValueError) as exc:
            raise MalformedResponse(f"completion logprobs are not numbers: {exc}") from exc
    finish_reason = choice.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise MalformedResponse(f"finish_reason is not a string: {finish_reason!r}")
    sampled = Sampled(completion_ids, logprobs, finish_reason, prompt_ids, weight_versions=_spans(choice))
    sampled.queue_s = _queue_s(data.get("metrics"))
    return _finished(sampled)


TOKEN_ID_PREFIX = "token_id:"  # vLLM's `return_tokens_as_token_ids` spelling of a sampled token


def _token_ids(tokens: Any) -> Any:
    """The ids of `["token_id:<id>", ...]`, or what was there when it is not that shape (`_ids` rejects it)."""
    if not isinstance(tokens, list):
        return tokens
    prefix, skip = TOKEN_ID_PREFIX, len(TOKEN_ID_PREFIX)
    try:
        return [int(token[skip:]) if token.startswith(prefix) else token for token in tokens]
    except (AttributeError, ValueError):
        return tokens


def _json_object(response: Any) -> dict[str, Any]:
    """The body of a 2xx response as a JSON object, parsed once; anything else is `MalformedResponse`."""
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise MalformedResponse(f"response body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise MalformedResponse(f"response body is not a JSON object (got {type(data).__name__})")
    return data


async def complete_chat(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    sampling: SamplingConfig,
    *,
    timeout_s: float,
    vocab_size: int | None = None,
    tags: CallTags | None = None,
) -> Sampled:
    kwargs = _sampling_kwargs(sampling)
    if tools:
        kwargs["tools"] = tools
    call = client.chat.completions.create(
        model=model,
        messages=messages,
        logprobs=sampling.logprobs,
        extra_body={**sampling.extra_body, **_protocol_fields(tags)},
        extra_headers=_headers(tags),
        **kwargs,
    )
    response = await _bounded(call, timeout_s)
    choices = getattr(response, "choices", None)
    if not choices or getattr(choices[0], "message", None) is None:
        raise MalformedResponse("chat response has no choices[0].message")
    choice = choices[0]
    completion_ids = _ids(_extra(choice, "token_ids"), "choices[0].token_ids", vocab_size)
    prompt_ids = _ids(_extra(response, "prompt_token_ids"), "prompt_token_ids", vocab_size)
    logprobs: list[float] = []
    if sampling.logprobs:
        content = getattr(getattr(choice, "logprobs", None), "content", None)
        if not isinstance(content, list) or len(content) != len(completion_ids):
            raise MalformedResponse("chat logprobs missing or not aligned with token_ids")
        logprobs = [float(item.logprob) for item in content]
    return _finished(
        Sampled(
            completion_ids,
            logprobs,
            choice.finish_reason,
            prompt_ids,
            _assistant_message(choice.message),
            _spans(choice),
            _queue_s(_extra(response, "metrics")),
        )
    )


def _protocol_fields(tags: CallTags | None, token_mode: bool = False) -> dict[str, Any]:
    ids = {"return_tokens_as_token_ids": True} if token_mode else {"return_token_ids": True}
    fields: dict[str, Any] = {**ids, "return_weight_versions": True}
    if tags is not None and tags.cache_salt is not None:
        fields["cache_salt"] = tags.cache_salt
    return fields


def _headers(tags: CallTags | None) -> dict[str, str]:
    return {"X-Request-Id": tags.request_id} if tags is not None else {}


def _spans(choice: Any) -> list[tuple[str, int]]:
    """(label, start) of each `weight_versions` span, validated; [] when the server sent none."""
    raw = _extra(choice, "weight_versions")
    if raw is None:
        return []
    try:
        return [(str(span["version"]), int(span["start"])) for span in raw]
    except (TypeError, KeyError, ValueError) as exc:
        raise MalformedResponse(f"weight_versions is malformed: {exc}") from exc


def _queue_s(metrics: Any) -> float:
    """Seconds of `metrics.queue_time_ms` when the server sent a number there; else 0 (timing is
    observability: a missing or odd value never fails the call)."""
    value = _extra(metrics, "queue_time_ms") if metrics is not None else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"):
        return value / 1e3
    return 0.0


def _finished(sampled: Sampled) -> Sampled:
    if sampled.finish_reason not in FINISHED_NORMALLY:
        raise TurnAborted(sampled.finish_reason, sampled.completion_ids, sampled)
    return sampled


def _assistant_message(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    reasoning = _extra(message, "reasoning") or _extra(message, "reasoning_content")
    if reasoning is not None:
        # Sent back as `reasoning`, the field vLLM 0.33 reads (it renames an incoming `reasoning_content`
        # and hands the template both names); releases before 0.12 knew only `reasoning_content`.
        out["reasoning"] = reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    return out


def tool_call_views(message: dict[str, Any]) -> list[dict[str, Any]]:
    """Tool calls of an assistant message as `wire.ToolCall` fields (chat mode: the server parsed them)."""
    views = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        raw = fn.get("arguments")
        try:
            args, status = (json.loads(raw) if isinstance(raw, str) else raw), "ok"
        except (TypeError, ValueError):
            args, status = raw, "invalid_json"
        views.append({"name": fn.get("name"), "arguments": args, "status": status, "raw": raw or ""})
    return views
