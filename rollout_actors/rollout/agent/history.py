"""How an intercepted call's conversation continues a rollout's trajectory, or why it cannot.

An agent sends the whole conversation with every call. The rollout keeps what it has seen (`Seen`: the
previous call's messages and tools plus the assistant message it answered) and compares:

- **extends**: the call starts with exactly what was seen, the echoed assistant message matching what was
  answered, and adds only user, tool or system messages. Those are bridged onto the previous prompt and
  completion (token-exact, contract 7): the sampled turn is never re-rendered.
- **forks** otherwise: the agent rewrote or dropped a past message (compaction, a summarised history), sent
  an assistant message the model did not sample, changed its tools, or re-sent an earlier conversation (a
  retried call). The trajectory starts a new branch from a full render of the call, explicitly.

An echoed assistant message matches on content and tool calls (name and arguments, as JSON values); its
tool-call ids and a missing `reasoning` are not compared, since SDKs drop or rename both (the
sampled reasoning stays in the prompt: the trajectory bridges the sampled ids, not the echo).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from renderer_actors.calls import NEW_MESSAGE_ROLES

Message = dict[str, Any]


@dataclass(frozen=True)
class Seen:
    """What a rollout's trajectory holds after its last answered call."""

    messages: list[Message]
    """The call's messages followed by the assistant message answered to it."""
    tools: bytes
    """The call's tools, canonical JSON (`tools_key`)."""


@dataclass(frozen=True)
class Continuation:
    new_messages: list[Message] | None
    """What the call adds after what was seen (bridge these); None when it forks."""
    fork_reason: str | None = None


def tools_key(tools: list[dict[str, Any]] | None) -> bytes:
    return orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS)


def continuation(seen: Seen, messages: list[Message], tools: list[dict[str, Any]] | None) -> Continuation:
    """Whether `messages` (with `tools`) extends what was seen, and by what; else why it forks."""
    if tools_key(tools) != seen.tools:
        return Continuation(None, "the agent changed its tools")
    if len(messages) <= len(seen.messages):
        return Continuation(
            None, f"the call sends {len(messages)} messages, no more than the {len(seen.messages)} seen"
        )
    for index, (known, sent) in enumerate(zip(seen.messages, messages, strict=False)):
        if not _same(known, sent):
            return Continuation(None, f"the call rewrites message {index} ({known.get('role')})")
    added = messages[len(seen.messages) :]
    for offset, message in enumerate(added):
        if message.get("role") not in NEW_MESSAGE_ROLES:
            where = len(seen.messages) + offset
            return Continuation(
                None, f"message {where} is a {message.get('role')!r} turn the model did not sample"
            )
    return Continuation(added)


def _same(known: Message, sent: Message) -> bool:
    if known.get("role") != sent.get("role"):
        return False
    if known.get("role") == "assistant":
        if _text(known.get("content")) != _text(sent.get("content")):
            return False
        if _calls(known) != _calls(sent):
            return False
        reasoning = sent.get("reasoning", sent.get("reasoning_content"))  # the name vLLM 0.33 renames
        return reasoning is None or reasoning == known.get("reasoning")
    return _text(known.get("content")) == _text(sent.get("content")) and all(
        known.get(key) == sent.get(key) for key in ("name", "tool_call_id")
    )


def _text(content: Any) -> Any:
    """Content as the renderer reads it: None and "" alike, text parts joined."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _calls(message: Message) -> list[tuple[Any, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {} if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # compared as the text it is
        calls.append((function.get("name"), arguments))
    return calls
