"""A parsed completion as this project hands it on: the library's `ParsedResponse`, in wire types.

The `renderers` library parses by token ids (markers are special tokens, so a model that writes the *text*
"<tool_call>" is not calling a tool) and reports every tool-call attempt with a status. This module only
maps its answer onto `ParsedCompletion` / `ToolCall` and builds the OpenAI-style assistant message the
environment receives and the history is re-rendered from: tool-call arguments are kept as the JSON text
the model sampled wherever it can be located, so a re-render reproduces the sampled tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from rollout_actors.kernel import EXACT_JSON

ToolCallStatus = Literal[
    "ok", "invalid_json", "unclosed", "missing_name", "malformed_structure", "unknown_tool"
]
RUNNABLE = frozenset({"ok", "unknown_tool"})
"""Statuses whose calls go into the message: the environment decides what an unknown tool means."""


class ToolCall(BaseModel):
    """One tool call parsed from a completion (or, in chat mode, as the server parsed it)."""

    model_config = EXACT_JSON  # part of a result, which crosses Ray as its JSON

    name: str | None
    arguments: Any = None
    status: ToolCallStatus = "ok"
    raw: str = ""
    id: str | None = None
    """The call id the format itself carries (Kimi K2), kept so a re-render reproduces it."""


class ParsedCompletion(BaseModel):
    """What a completion says, and the OpenAI-style assistant message to hand to the environment."""

    content: str | None = None
    """Text outside the reasoning and tool calls; None when there is none."""
    reasoning: str | None = None
    """The reasoning (also an unclosed one); None when the turn had no think block, "" for an empty one."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Every tool-call attempt, whatever its status."""
    message: dict[str, Any] = Field(default_factory=dict)
    """`{"role": "assistant", "content", "reasoning"?, "tool_calls"?}` (`reasoning`: the name vLLM 0.33
    answers with and chat mode hands on, so an environment reads one field in every mode); tool calls in OpenAI
    format with `arguments` as a JSON string (the sampled text where it can be located). Calls whose
    status is not runnable (`invalid_json`, `missing_name`, `unclosed`, `malformed_structure`) are
    reported in `tool_calls` but left out of the message: there is nothing an environment could run."""
    closed: bool = False
    """The completion ended with one of the family's stop tokens."""
    text: str = ""
    """The completion as the model wrote it (its ids decoded, the closing stop token left out): for
    environments that parse reasoning and tool-call markup from text themselves."""


_LIBRARY = object()
FENCE = "```json\n"
"""DeepSeek's calls carry their arguments in a fenced JSON block after the function name."""


def from_library(
    parsed: Any,
    ids: Sequence[int],
    stop_ids: frozenset[int],
    reasoning: Any = _LIBRARY,
    content: Any = _LIBRARY,
    text: str = "",
    empty_content: str | None = None,
) -> ParsedCompletion:
    """Map a library `ParsedResponse` for completion `ids` onto a `ParsedCompletion`; `reasoning` and
    `content` replace the library's where the renderer reads them the template's way; `text` is the
    completion as decoded (`ParsedCompletion.text`); `empty_content`: the message's content for a turn
    without text, as the family's template takes it (None, or `''` where None renders as "None")."""
    calls = [
        ToolCall(
            name=call.name,
            arguments=call.arguments,
            status=_status(str(call.status)),
            raw=call.raw or "",
            id=call.id,
        )
        for call in parsed.tool_calls
    ]
    content = (parsed.content if content is _LIBRARY else content) or None
    reasoning = parsed.reasoning_content if reasoning is _LIBRARY else reasoning
    return ParsedCompletion(
        content=content,
        reasoning=reasoning,
        tool_calls=calls,
        message=_message(content if content is not None else empty_content, reasoning, calls, ids),
        closed=bool(ids) and ids[-1] in stop_ids,
        text=text,
    )


def _status(library_status: str) -> ToolCallStatus:
    return "unclosed" if library_status == "unclosed_block" else library_status  # type: ignore[return-value]


def raw_arguments(raw: str, arguments: Any) -> str:
    """The arguments exactly as sampled, so re-rendering the message reproduces the sampled text: the
    JSON after `"arguments":` (Hermes-style calls), the whole block when it is the arguments object
    itself (Kimi style), or the fenced JSON of a DeepSeek call (`name` + ```` ```json ```` block, which its
    template renders as given); compact JSON when none can be located (XML-style arguments)."""
    if isinstance(arguments, str):
        return arguments
    decoder = json.JSONDecoder()
    at = raw.find('"arguments"')
    while at >= 0:
        colon = raw.find(":", at + len('"arguments"'))
        if colon >= 0 and not raw[at + len('"arguments"') : colon].strip():
            start = colon + 1
            while start < len(raw) and raw[start] in " \t\r\n":
                start += 1
            try:
                value, stop = decoder.raw_decode(raw, start)
            except ValueError:
                value, stop = None, -1
            if stop >= 0 and value == arguments:
                return raw[start:stop]
        at = raw.find('"arguments"', at + 1)
    body = raw.strip()
    fenced = body.split(FENCE, 1)[1].rsplit("```", 1)[0].strip("\n") if FENCE in body else None
    for candidate in (body, fenced):
        try:
            if candidate and json.loads(candidate) == arguments:
                return candidate
        except ValueError:
            pass
    return json.dumps(arguments, ensure_ascii=False)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates (and the library) read it: an assistant's reasoning under both
    names, as vLLM 0.33 hands it over. The plane names it `reasoning`; templates read `reasoning_content`;
    an agent program may echo either. The list itself when no message needs it (the common turn)."""
    out = messages
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        named = message.get("reasoning")
        reasoning = named if named is not None else message.get("reasoning_content")
        if reasoning is None or named == message.get("reasoning_content"):
            continue  # none, or under both names already
        if out is messages:
            out = list(messages)
        out[i] = {**message, "reasoning": reasoning, "reasoning_content": reasoning}
    return out


def named_tool_answers(
    messages: list[dict[str, Any]], earlier: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """The messages with each tool answer that has no `name` named after the call it answers (found by
    `tool_call_id` among the calls of `earlier` and `messages`), as vLLM 0.33 names a harmony tool message
    (`parse_chat_inputs_to_harmony_messages`): gpt-oss's renderer reads the name, and without it writes
    `functions.unknown` where the model's template writes the function. The list itself when none needs it."""
    names = {
        call.get("id"): (call.get("function") or {}).get("name")
        for message in (*earlier, *messages)
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict)
    }
    out = messages
    for i, message in enumerate(messages):
        name = names.get(message.get("tool_call_id"))
        if message.get("role") != "tool" or message.get("name") or not name:
            continue
        if out is messages:
            out = list(messages)
        out[i] = {**message, "name": name}
    return out


def _message(
    content: str | None, reasoning: str | None, calls: list[ToolCall], ids: Sequence[int]
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    runnable = [call for call in calls if call.status in RUNNABLE]
    if runnable:
        # Deterministic ids where the format has none: the same completion parses to the same message.
        stem = hashlib.blake2b(repr(list(ids)).encode(), digest_size=6).hexdigest()
        message["tool_calls"] = [
            {
                "id": call.id or f"call_{stem}_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": raw_arguments(call.raw, call.arguments)},
            }
            for i, call in enumerate(runnable)
        ]
    return message
