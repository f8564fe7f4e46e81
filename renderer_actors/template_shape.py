"""What a renderer learns from the model's own chat template, so that its parse is the inverse of the
template's render and its stop ids include the template's turn close.

- `ThinkShape`: the text a template puts around an assistant turn's reasoning (`<think>` + lead +
  reasoning + trail + `</think>` + gap + content, and the separator before a tool call). A parse that
  strips exactly these (not "all whitespace", not nothing) gives back the message the template renders
  to the same text, so re-rendering a sampled turn reproduces it and a bridge does not fork where the
  template extends.
- `probe_shape` / `probe_close`: learnt from a render of a probe conversation, for the `default` family
  (any template; `None` where the template does not render reasoning the `<think>` way).
- `template_ids`: the `default` family's render, `apply_chat_template` on the messages as given (tool-call
  arguments as the sampled JSON text, so compact, spaced or `\\u`-escaped arguments render as sampled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

OPEN, CLOSE = "<think>", "</think>"
_R, _C = "RRRRR", "CCCCC"  # probe texts, found verbatim in the render


@dataclass(frozen=True)
class ThinkShape:
    """`<think>` + lead + reasoning + trail + `</think>` + gap + content [+ call_sep + tool call]."""

    lead: str = "\n"
    trail: str = "\n"
    gap: str = "\n\n"
    call_sep: str | None = None
    """What the template puts between non-empty content and the first tool call (None: unknown)."""

    def prefill(self, prompt_text: str) -> Literal["open", "open+lead", "closed"] | None:
        """What the generation prompt already opened: an empty think block (thinking off: the turn's
        reasoning is empty), an open one (with or without its lead), or nothing."""
        if prompt_text.endswith(OPEN + self.lead + self.trail + CLOSE + self.gap):
            return "closed"
        if self.lead and prompt_text.endswith(OPEN + self.lead):
            return "open+lead"
        if prompt_text.endswith(OPEN):
            return "open"
        return None

    def split(self, text: str, prefill: str | None, has_calls: bool) -> tuple[str | None, str, bool]:
        """(reasoning, content, reasoning closed) of the completion text before its first tool call,
        stop token removed. Reasoning is None when the turn has no think block, "" for an empty one."""
        if prefill == "closed":
            return "", self._content(text, has_calls), True
        if prefill in ("open", "open+lead"):
            start, lead = 0, prefill == "open"
        else:
            at = text.find(OPEN)
            if at < 0 or text[:at].strip():
                return None, self._content(text, has_calls), True
            start, lead = at + len(OPEN), True
        region = text[start:]
        end = region.find(CLOSE)
        if end < 0:  # cut inside the reasoning (length), or closed by a tool call
            reasoning = region.removeprefix(self.lead) if lead else region
            return reasoning, "", False
        reasoning = region[:end]
        if lead:
            reasoning = reasoning.removeprefix(self.lead)
        reasoning = reasoning.removesuffix(self.trail)
        content = region[end + len(CLOSE) :].removeprefix(self.gap)
        return reasoning, self._content(content, has_calls), True

    def _content(self, content: str, has_calls: bool) -> str:
        if has_calls and self.call_sep and content.endswith(self.call_sep):
            return content[: -len(self.call_sep)]
        return content


BUNDLED_SHAPE = ThinkShape(call_sep="\n")
"""The bundled template's (`templates/qwen3.jinja`)."""


def template_text(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def probe_shape(tokenizer: Any, template_kwargs: dict[str, Any]) -> ThinkShape | None:
    """The template's think shape, or None if it does not render `reasoning_content` as `<think>`."""
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _C, "reasoning_content": _R},
    ]
    try:
        text = template_text(tokenizer, messages, **template_kwargs)
    except Exception:
        return None
    r, c = text.find(_R), text.find(_C)
    if r < 0 or c < r:
        return None
    before, between = text[:r], text[r + len(_R) : c]
    opened, closed = before.rfind(OPEN), between.find(CLOSE)
    if opened < 0 or closed < 0:
        return None
    lead, trail, gap = before[opened + len(OPEN) :], between[:closed], between[closed + len(CLOSE) :]
    if any(part.strip() for part in (lead, trail, gap)):
        return None
    return ThinkShape(lead=lead, trail=trail, gap=gap, call_sep=_probe_call_sep(tokenizer, template_kwargs))


def _probe_call_sep(tokenizer: Any, template_kwargs: dict[str, Any]) -> str | None:
    """The whitespace the template puts between content and a tool call (None: none, or no calls)."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _C, "tool_calls": [call]},
    ]
    try:
        text = template_text(tokenizer, messages, **template_kwargs)
    except Exception:
        return None
    at = text.rfind(_C)
    after = text[at + len(_C) :] if at >= 0 else ""
    sep = after[: len(after) - len(after.lstrip())]
    return sep or None


def probe_close(tokenizer: Any, backend: Any, template_kwargs: dict[str, Any]) -> int | None:
    """The token the template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`, ...): the
    first token after the turn's content, if it is a special (added) token."""
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _C}]
    try:
        text = template_text(tokenizer, messages, **template_kwargs)
    except Exception:
        return None
    at = text.rfind(_C)
    if at < 0:
        return None
    after = backend.encode(text[at + len(_C) :], add_special_tokens=False).ids
    added = backend.get_added_tokens_decoder()
    return after[0] if after and after[0] in added else None


def template_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> list[int]:
    """`apply_chat_template` on the messages as given, tokenised as it tokenises them. A template that
    refuses them gets them in the shape it takes: tool-call arguments decoded (it iterates them as a
    mapping, as the library does; only then do arguments render as the template re-serialises them),
    an assistant turn's `None` content as `''`, or both."""
    kwargs = {**template_kwargs, "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        kwargs["tools"] = tools
    try:
        text = template_text(tokenizer, messages, **kwargs)
    except Exception:
        # The shapes templates take where they refuse the OpenAI one: arguments as a mapping (GLM),
        # an assistant turn's content as a string (Qwen3's April-2025 template, gpt-oss), or both.
        decoded = decode_arguments(messages)
        stringed = string_content(messages)
        both = string_content(decoded) if decoded is not None else None
        shapes = [shape for shape in (decoded, stringed, both) if shape is not None]
        if not shapes:
            raise
        text = _first_rendering(tokenizer, shapes, kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _first_rendering(tokenizer: Any, shapes: list[list[dict[str, Any]]], kwargs: dict[str, Any]) -> str:
    for shape in shapes[:-1]:
        try:
            return template_text(tokenizer, shape, **kwargs)
        except Exception:
            continue
    return template_text(tokenizer, shapes[-1], **kwargs)


def string_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with an assistant turn's `None` content as `''` (Qwen3's April-2025 template and
    gpt-oss's test `in` on it and fail on None); None if no turn had None content."""

    def silent(m: Any) -> bool:
        return isinstance(m, dict) and m.get("role") == "assistant" and m.get("content") is None

    if not any(silent(m) for m in messages):
        return None
    return [{**m, "content": ""} if silent(m) else m for m in messages]


def decode_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with JSON-string tool-call arguments decoded; None if there were none to decode."""
    changed = False
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        new_calls = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                    changed = True
                except ValueError:
                    pass
            new_calls.append({**call, "function": function})
        out.append({**message, "tool_calls": new_calls})
    return out if changed else None
