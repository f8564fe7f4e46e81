"""The bundled model's renderer: the library's Qwen3 renderer, rendering assistant turns as the bundled
template (`templates/qwen3.jinja`) does.

The bundled template is Qwen3-shaped (same markers, system/tools block, tool responses, generation
prompt) but differs from Qwen3's own template on assistant turns, and the template is the reference:

- every turn keeps its `reasoning_content` (`drop_past_reasoning=false`, its default), so history never
  changes and every turn bridges; with `drop_past_reasoning=true` reasoning before the last user message
  is dropped (a rewrite: the bridge forks there);
- reasoning and content are emitted as written (`<think>\\n` + reasoning + `\\n</think>\\n\\n` + content,
  no stripping), and a turn without `reasoning_content` has no think block, last turn included.

Everything else (system, tools, users, tool responses, generation prompt, the bridge) is the library's
Qwen3 code, which matches the template there. `tests/test_template_fidelity.py` holds both to the
template's own render.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from renderers.configs import BaseRendererConfig
from renderers.qwen3 import Qwen3Renderer

BUNDLED_RENDERER = "bundled"
"""The family name `auto` resolves the bundled tokenizer to."""


class BundledRendererConfig(BaseRendererConfig):
    """The bundled template's kwargs, as renderer config fields."""

    name: Literal["bundled"] = "bundled"
    _template_fields = frozenset({"enable_thinking", "drop_past_reasoning"})

    enable_thinking: bool = True
    """False: the generation prompt prefills an empty think block (the template's kwarg)."""
    drop_past_reasoning: bool = False
    """True: reasoning of assistant turns before the last user message is not rendered (the kwarg)."""


class BundledRenderer(Qwen3Renderer):
    """`Qwen3Renderer` with the bundled template's assistant turns and history policy."""

    config_class = BundledRendererConfig

    def __init__(self, tokenizer: Any, config: BundledRendererConfig | None = None) -> None:
        config = config or BundledRendererConfig()
        if config.thinking_retention is None:
            # The template's own policy: it rewrites history only when it drops past reasoning.
            config = config.model_copy(
                update={"thinking_retention": "tool_cycle" if config.drop_past_reasoning else "all"}
            )
        super().__init__(tokenizer, config)  # type: ignore[arg-type]

    @staticmethod
    def _is_user_query_message(msg: Any) -> bool:
        return msg.get("role") == "user"  # the template's `ns.last_user`: any user message

    @staticmethod
    def _last_query_index(messages: list[Any]) -> int:
        return max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)

    def _render_assistant(
        self,
        msg,
        msg_idx,
        content,
        last_query_index,
        is_last,
        *,
        emit_special,
        emit_text,
        emit_text_segments,
    ):
        reasoning = msg.get("reasoning_content")
        keep = reasoning is not None and not (self.config.drop_past_reasoning and msg_idx < last_query_index)
        body = f"<think>\n{reasoning}\n</think>\n\n" if keep else ""
        body += content or ""
        emit_special(self._im_start, msg_idx, is_sampled=False, is_content=False)
        segments: list[tuple[str, bool]] = []
        if body[:1].isspace():
            # The template's text is tokenised in one pass: a body that starts with whitespace merges
            # with the role tag's newline, so the two are encoded together.
            segments.append(("assistant\n", False))
        else:
            emit_text("assistant\n", msg_idx, is_sampled=False, is_content=False)
        for i, call in enumerate(msg.get("tool_calls") or []):
            function = call.get("function") or call
            arguments = function.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)  # the template's `tojson`
            if i or content:
                body += "\n"
            if body:
                segments.append((body, True))
            if segments:
                emit_text_segments(segments, msg_idx, is_sampled=True)
            segments, body = [], ""
            emit_special(self._tool_call, msg_idx, is_sampled=True, is_content=True)
            segments.append((f'\n{{"name": "{function.get("name", "")}", "arguments": {arguments}}}\n', True))
            emit_text_segments(segments, msg_idx, is_sampled=True)
            segments = []
            emit_special(self._tool_call_end, msg_idx, is_sampled=True, is_content=True)
        if body:
            segments.append((body, True))
        if segments:
            emit_text_segments(segments, msg_idx, is_sampled=True)
        emit_special(self._im_end, msg_idx, is_sampled=True, is_content=True)
        emit_text("\n", msg_idx, is_sampled=False, is_content=False)
