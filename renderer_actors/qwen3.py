"""The native Qwen3-style family: the bundled template (`templates/qwen3.jinja`) rendered by pieces.

Rendering message by message in Python (instead of the Jinja template over the whole list) is what makes
the bridge linear: a turn renders only its new messages, and tokenizes only them. Pieces tokenize
independently because every piece starts at `<|im_start|>`, a special token the pre-tokenizer never
merges across. The Jinja template stays the specification; tests check both agree on random messages.

Boundary rules of this family: a sampled turn ends with `<|im_end|>` (appended, not sampled, when the
completion was cut), and the template puts `\\n` after every `<|im_end|>`; the bridge appends that newline
before the new messages, exactly as a full render would.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from renderer_actors.key import QWEN3_TEMPLATE_DEFAULTS, RendererKey
from renderer_actors.parse import Markers, ParsedCompletion, parse_completion
from renderer_actors.renderer import (
    SCAFFOLD,
    BridgeReply,
    BridgeRequest,
    Rendered,
    StartReply,
    TrajectoryState,
    check_new_messages,
    completion_message,
    message_text,
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
EMPTY_THINK = "<think>\n\n</think>\n\n"


@dataclass
class _Piece:
    text: str
    message: int
    sampled: bool = False


def _tojson(value: Any) -> str:
    # Hugging Face's `tojson` filter: plain json.dumps, non-ASCII kept, default separators, no sorting.
    return json.dumps(value, ensure_ascii=False)


class Qwen3Renderer:
    """Renderer for the bundled Qwen3-style template (any tokenizer with Qwen3's special tokens)."""

    family = "qwen3"
    always_needs_history = False

    def __init__(self, key: RendererKey, tokenizer: Any) -> None:
        self.key = key
        self._tok = tokenizer  # a `tokenizers.Tokenizer` (the fast backend: no Python wrapper per call)
        kwargs = {**QWEN3_TEMPLATE_DEFAULTS, **key.template_kwargs}
        self.enable_thinking = bool(kwargs["enable_thinking"])
        self.drop_past_reasoning = bool(kwargs["drop_past_reasoning"])
        ids = {name: tokenizer.token_to_id(name) for name in (IM_START, IM_END, "<|endoftext|>")}
        ids.update({name: tokenizer.token_to_id(name) for name in ("<think>", "</think>")})
        ids.update({name: tokenizer.token_to_id(name) for name in ("<tool_call>", "</tool_call>")})
        missing = [name for name in (IM_START, IM_END) if ids[name] is None]
        if missing:
            raise ValueError(f"tokenizer {key.model!r} has no {missing} token: not a Qwen3-style tokenizer")
        self.im_end = ids[IM_END]

        def spell(name: str) -> tuple[int, ...]:
            return (ids[name],) if ids[name] is not None else tuple(self.encode(name))

        self.markers = Markers(
            think_open=spell("<think>"),
            think_close=spell("</think>"),
            tool_open=spell("<tool_call>"),
            tool_close=spell("</tool_call>"),
            turn_end=frozenset(i for i in (ids[IM_END], ids["<|endoftext|>"]) if i is not None),
        )
        self.generation_prompt = f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK)

    @classmethod
    def load(cls, key: RendererKey) -> Qwen3Renderer:
        from tokenizers import Tokenizer

        from renderer_actors.tokenizer import BUNDLED_MODEL, bundled_tokenizer_dir, load_tokenizer

        if key.model == BUNDLED_MODEL:
            tokenizer = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
        else:
            tokenizer = load_tokenizer(key.model).backend_tokenizer
        return cls(key, tokenizer)

    # ---------------------------------------------------------------------------------- tokens

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    # --------------------------------------------------------------------------------- rendering

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        pieces = self._pieces(messages, tools, add_generation_prompt)
        text = "".join(p.text for p in pieces)
        starts = []
        at = 0
        for piece in pieces:
            starts.append(at)
            at += len(piece.text)
        encoding = self._tok.encode(text, add_special_tokens=False)
        owner = [bisect.bisect_right(starts, start) - 1 for start, _ in encoding.offsets]
        return Rendered(
            ids=list(encoding.ids),
            message_index=[pieces[i].message for i in owner],
            sampled=[pieces[i].sampled for i in owner],
        )

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return "".join(p.text for p in self._pieces(messages, tools, add_generation_prompt))

    def _pieces(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> list[_Piece]:
        pieces: list[_Piece] = []
        has_system = bool(messages) and messages[0].get("role") == "system"
        if tools:
            text = f"{IM_START}system\n"
            if has_system:
                text += message_text(messages[0].get("content")) + "\n\n"
            text += TOOLS_HEADER + "".join("\n" + _tojson(tool) for tool in tools) + TOOLS_FOOTER
            pieces.append(_Piece(text, 0 if has_system else SCAFFOLD))
        elif has_system:
            pieces.append(
                _Piece(f"{IM_START}system\n{message_text(messages[0].get('content'))}{IM_END}\n", 0)
            )
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        first = 1 if has_system else 0
        pieces += self._message_pieces(messages, first, prev_role=None, last_user=last_user)
        if add_generation_prompt:
            pieces.append(_Piece(self.generation_prompt, SCAFFOLD))
        return pieces

    def _message_pieces(
        self, messages: list[dict[str, Any]], first: int, prev_role: str | None, last_user: int
    ) -> list[_Piece]:
        """Pieces of `messages[first:]`; `prev_role` is the role before `messages[first]` (for grouping
        consecutive tool results into one user turn, as the template does)."""
        pieces: list[_Piece] = []
        for i in range(first, len(messages)):
            message = messages[i]
            role = message.get("role")
            before = messages[i - 1].get("role") if i > 0 else prev_role
            after = messages[i + 1].get("role") if i + 1 < len(messages) else None
            if role in ("user", "system"):
                text = f"{IM_START}{role}\n{message_text(message.get('content'))}{IM_END}\n"
                pieces.append(_Piece(text, i))
            elif role == "assistant":
                pieces.append(_Piece(f"{IM_START}assistant\n", i))
                pieces.append(_Piece(self._assistant_body(message, keep_reasoning=i > last_user), i, True))
                pieces.append(_Piece("\n", i))
            elif role == "tool":
                text = f"{IM_START}user" if before != "tool" else ""
                text += f"\n<tool_response>\n{message_text(message.get('content'))}\n</tool_response>"
                if after != "tool":
                    text += f"{IM_END}\n"
                pieces.append(_Piece(text, i))
            else:
                raise ValueError(f"messages[{i}] has role {role!r}; expected system, user, assistant or tool")
        return pieces

    def _assistant_body(self, message: dict[str, Any], keep_reasoning: bool) -> str:
        """What the model generates for this message, through its `<|im_end|>`."""
        text = ""
        reasoning = message.get("reasoning_content")
        if reasoning is not None and (keep_reasoning or not self.drop_past_reasoning):
            text += f"<think>\n{reasoning}\n</think>\n\n"
        content = message_text(message.get("content"))
        text += content
        for n, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function", call)
            if n or content:
                text += "\n"
            arguments = fn.get("arguments")
            arguments = arguments if isinstance(arguments, str) else _tojson(arguments)
            text += f'<tool_call>\n{{"name": "{fn.get("name")}", "arguments": {arguments}}}\n</tool_call>'
        return text + IM_END

    # ------------------------------------------------------------------------------- trajectories

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> StartReply:
        ids = self.encode(self.render_text(messages, tools, add_generation_prompt=True))
        return StartReply(
            prompt_ids=ids, state=TrajectoryState(reasoning_pending=_reasoning_after_user(messages))
        )

    def bridge(self, request: BridgeRequest) -> BridgeReply:
        """Previous prompt + completion + [synthetic `<|im_end|>`] + `\\n` + new messages + generation
        prompt. Only the new messages are rendered and tokenized: linear in what the turn adds."""
        check_new_messages(request.new_messages)
        message = completion_message(self, request)
        closed = bool(request.completion_ids) and request.completion_ids[-1] == self.im_end
        has_user = any(m.get("role") == "user" for m in request.new_messages)
        pending = request.state.reasoning_pending or message.get("reasoning_content") is not None
        state = TrajectoryState(reasoning_pending=pending and not has_user)
        rewrite = self.drop_past_reasoning and has_user and pending
        if rewrite and self.key.history == "fork_on_rewrite":
            # The template now drops reasoning the bridged prompt holds: fork to the full re-render.
            if request.history is None:
                return BridgeReply(needs_history=True)
            messages = [*request.history.messages, message, *request.new_messages]
            ids = self.encode(self.render_text(messages, request.tools, add_generation_prompt=True))
            return BridgeReply(
                prompt_ids=ids,
                forked=True,
                synthetic_close=not closed,
                assistant_message=message,
                state=TrajectoryState(),
            )
        delta = self._message_pieces(request.new_messages, 0, prev_role="assistant", last_user=-1)
        text = "\n" + "".join(p.text for p in delta) + self.generation_prompt
        appended = ([] if closed else [self.im_end]) + self.encode(text)
        return BridgeReply(
            appended_ids=appended, synthetic_close=not closed, assistant_message=message, state=state
        )

    def parse(
        self, completion_ids: Sequence[int], tools: list[dict[str, Any]] | None = None
    ) -> ParsedCompletion:
        return parse_completion(
            completion_ids, self.markers, self.decode, tools, empty_reasoning=not self.enable_thinking
        )


def _reasoning_after_user(messages: list[dict[str, Any]]) -> bool:
    """An assistant message after the last user message carries reasoning (rendered, not yet dropped)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return False
        if message.get("role") == "assistant" and message.get("reasoning_content") is not None:
            return True
    return False
