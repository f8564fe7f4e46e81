"""Parse a completion into reasoning, content and tool calls, by token ids.

Markers are found by id, never by searching decoded text: a model that writes the *text* "<tool_call>"
inside its content (which tokenizes to ordinary ids) is not calling a tool, and a text search would say
it is. Only the spans between markers are decoded. Layout expected (the Qwen3 / Hermes style):

    [<think> reasoning </think>] content [<tool_call> {"name": .., "arguments": {..}} </tool_call>]* [end]

A completion cut by `length` parses too: an open `<think>` gives reasoning and no content, an open
`<tool_call>` gives a call with status `unclosed`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from renderer_actors.matching import find_first

Ids = tuple[int, ...]


class ToolCall(BaseModel):
    """One tool call parsed from a completion (or, in chat mode, as the server parsed it)."""

    name: str | None
    arguments: Any = None
    status: Literal["ok", "invalid_json", "unclosed", "missing_name", "unknown_tool"] = "ok"
    raw: str = ""


@dataclass(frozen=True)
class Markers:
    """Token-id spellings of the layout markers; an empty tuple switches that feature off."""

    think_open: Ids = ()
    think_close: Ids = ()
    tool_open: Ids = ()
    tool_close: Ids = ()
    turn_end: frozenset[int] = frozenset()
    """Ids that end the turn (the template's close token, the tokenizer's eos)."""


class ParsedCompletion(BaseModel):
    """What a completion says, and the OpenAI-style assistant message to hand to the environment."""

    content: str | None = None
    """Text outside the think block and tool calls; None when there is none."""
    reasoning: str | None = None
    """Inside the think block (also an unclosed one); None when the turn had no think block."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Every `<tool_call>` block, whatever its status."""
    message: dict[str, Any] = Field(default_factory=dict)
    """`{"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}`; tool calls in OpenAI
    format with `arguments` as a JSON string (the sampled text, so a re-render reproduces it). Calls whose
    status is `invalid_json`, `missing_name` or `unclosed` are reported in `tool_calls` but left out of
    the message: there is nothing an environment could run."""
    closed: bool = False
    """The completion ended with a turn-end id."""


def parse_completion(
    ids: Sequence[int],
    markers: Markers,
    decode: Callable[[Sequence[int]], str],
    tools: list[dict[str, Any]] | None = None,
    empty_reasoning: bool = False,
) -> ParsedCompletion:
    """Split `ids` at markers and decode the spans. `empty_reasoning`: the prompt already held an empty
    think block (thinking switched off), so the turn's reasoning is "" rather than absent."""
    end = len(ids)
    for i, token in enumerate(ids):
        if token in markers.turn_end:
            end = i
            break
    closed = end < len(ids)
    body = list(ids[:end])

    reasoning: str | None = "" if empty_reasoning else None
    rest = body
    open_at = find_first(body, markers.think_open) if markers.think_open else -1
    close_at = find_first(body, markers.think_close) if markers.think_close else -1
    if open_at >= 0 and (close_at < 0 or close_at < open_at):
        close_at = find_first(body, markers.think_close, open_at) if markers.think_close else -1
    if open_at >= 0 and close_at < 0:
        reasoning, rest = _strip_one(decode(body[open_at + len(markers.think_open) :]), lead="\n"), []
    elif open_at >= 0:
        inner = decode(body[open_at + len(markers.think_open) : close_at])
        reasoning = _strip_one(inner, lead="\n", trail="\n")
        rest = body[:open_at] + body[close_at + len(markers.think_close) :]
    elif close_at >= 0:
        # The prompt opened the think block (some templates do): everything before the close is reasoning.
        reasoning = _strip_one(decode(body[:close_at]), lead="\n", trail="\n")
        rest = body[close_at + len(markers.think_close) :]

    content_ids, spans = _split_tool_calls(rest, markers)
    content = decode(content_ids)
    if open_at >= 0 or close_at >= 0:
        content = _strip_one(content, lead="\n\n")
    if spans:
        content = _strip_one(content, trail="\n")
    calls = [_tool_call(decode(span), is_closed, tools) for span, is_closed in spans]
    return ParsedCompletion(
        content=content or None,
        reasoning=reasoning,
        tool_calls=calls,
        message=_message(content or None, reasoning, calls, ids),
        closed=closed,
    )


def _split_tool_calls(ids: list[int], markers: Markers) -> tuple[list[int], list[tuple[list[int], bool]]]:
    """Content ids (everything before the first call) and the (body ids, closed) of each call. Text
    between or after calls stays in the ids but not in the content: the layout has no place for it."""
    if not markers.tool_open:
        return ids, []
    first = find_first(ids, markers.tool_open)
    if first < 0:
        return ids, []
    content = ids[:first]
    spans: list[tuple[list[int], bool]] = []
    pos = first
    while pos >= 0:
        start = pos + len(markers.tool_open)
        stop = find_first(ids, markers.tool_close, start) if markers.tool_close else -1
        if stop < 0:
            spans.append((ids[start:], False))
            break
        spans.append((ids[start:stop], True))
        pos = find_first(ids, markers.tool_open, stop + len(markers.tool_close))
    return content, spans


def _tool_call(text: str, closed: bool, tools: list[dict[str, Any]] | None) -> ToolCall:
    if not closed:
        return ToolCall(name=None, status="unclosed", raw=text)
    body = text.strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return ToolCall(name=None, status="invalid_json", raw=text)
    if not isinstance(obj, dict):
        return ToolCall(name=None, status="invalid_json", raw=text)
    name = obj.get("name")
    arguments = obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(name=None, arguments=arguments, status="missing_name", raw=text)
    if tools is not None and name not in _tool_names(tools):
        return ToolCall(name=name, arguments=arguments, status="unknown_tool", raw=text)
    return ToolCall(name=name, arguments=arguments, status="ok", raw=text)


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    names = set()
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def raw_arguments(raw: str, arguments: Any) -> str:
    """The arguments exactly as sampled (the JSON text after `"arguments":`), so re-rendering the message
    reproduces the sampled text; falls back to compact-spaced JSON when they cannot be located."""
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
    return json.dumps(arguments, ensure_ascii=False)


def _message(
    content: str | None, reasoning: str | None, calls: list[ToolCall], ids: Sequence[int]
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    runnable = [call for call in calls if call.status in ("ok", "unknown_tool")]
    if runnable:
        # Deterministic ids: the same completion parses to the same message (tests, replays, caches).
        stem = hashlib.blake2b(repr(list(ids)).encode(), digest_size=6).hexdigest()
        message["tool_calls"] = [
            {
                "id": f"call_{stem}_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": raw_arguments(call.raw, call.arguments)},
            }
            for i, call in enumerate(runnable)
        ]
    return message


def _strip_one(text: str, lead: str = "", trail: str = "") -> str:
    """Remove exactly one template separator at each end, if present (never general whitespace: what
    the model wrote inside stays as written)."""
    if lead and text.startswith(lead):
        text = text[len(lead) :]
    if trail and text.endswith(trail):
        text = text[: -len(trail)]
    return text
