"""The generic family: any Hugging Face chat template, treated as a black box.

Nothing is known about the template, so the bridge learns its shape from renders of a fixed synthetic
conversation (`[user, assistant]` with placeholder texts):

- the turn close: what the template writes after an assistant message's content (e.g. `<|im_end|>\\n`
  or `<|eot_id|>`); its first token is the close token, the rest is the boundary text;
- the delta of new messages: render(synthetic + new, generation prompt) minus render(synthetic); valid
  only when the second is a prefix of the first (templates that raise or restructure get no delta).

Under `append` the bridge is previous + completion + [close] + boundary + delta, no history needed.
Under `fork_on_rewrite` (or when there is no delta) it also renders the full history and checks that it
extends previous + completion exactly (by ids, then by text, so a non-canonical sampled split is not a
rewrite); when it does not, the trajectory forks to the full re-render, marked. That full render makes
this family's bridge linear in the history, not in the turn: it is the fallback, `qwen3` is the fast path.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from typing import Any

from renderer_actors.key import RendererKey
from renderer_actors.parse import Markers, ParsedCompletion, parse_completion
from renderer_actors.renderer import (
    SCAFFOLD,
    BridgeReply,
    BridgeRequest,
    Rendered,
    StartReply,
    check_new_messages,
    completion_message,
)

DELTA_BASES_KEPT = 64  # synthetic renders cached per tool set; rollouts with ever-new tool sets reset it
PLACEHOLDER_USER = "RAYROLLOUTS-PLACEHOLDER-USER"
PLACEHOLDER_ASSISTANT = "RAYROLLOUTS-PLACEHOLDER-ASSISTANT"
SYNTHETIC = [
    {"role": "user", "content": PLACEHOLDER_USER},
    {"role": "assistant", "content": PLACEHOLDER_ASSISTANT},
]


class HfRenderer:
    """Renderer for any tokenizer with a chat template (`family="hf"`)."""

    family = "hf"

    def __init__(self, key: RendererKey, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {key.model!r} has no chat template")
        self.key = key
        self._tok = tokenizer
        self._kwargs = dict(key.template_kwargs)
        self.always_needs_history = key.history == "fork_on_rewrite"
        self._delta_base: dict[str, str | None] = {}

        base = self.render_text(SYNTHETIC, None, add_generation_prompt=False)
        suffix = base[base.rindex(PLACEHOLDER_ASSISTANT) + len(PLACEHOLDER_ASSISTANT) :]
        encoding = tokenizer.backend_tokenizer.encode(suffix, add_special_tokens=False)
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        if encoding.ids and encoding.ids[0] in special:
            self.close_id: int = encoding.ids[0]
            self.boundary = suffix[encoding.offsets[0][1] :]
        elif tokenizer.eos_token_id is not None:
            # The template closes turns with plain text: fall back to the tokenizer's eos.
            self.close_id, self.boundary = tokenizer.eos_token_id, suffix
        else:
            raise ValueError(f"tokenizer {key.model!r}: cannot tell how its template closes a turn")

        prompted = self.render_text(SYNTHETIC, None, add_generation_prompt=True)
        generation_prompt = prompted[len(base) :] if prompted.startswith(base) else ""

        def spell(marker: str) -> tuple[int, ...]:
            return tuple(self.encode(marker))

        self.markers = Markers(
            think_open=spell("<think>"),
            think_close=spell("</think>"),
            tool_open=spell("<tool_call>"),
            tool_close=spell("</tool_call>"),
            turn_end=frozenset(i for i in (self.close_id, tokenizer.eos_token_id) if i is not None),
        )
        # A generation prompt that already closes a think block (thinking switched off) means "".
        self._empty_reasoning = "</think>" in generation_prompt

    @classmethod
    def load(cls, key: RendererKey) -> HfRenderer:
        from renderer_actors.tokenizer import load_tokenizer

        return cls(key, load_tokenizer(key.model))

    # ---------------------------------------------------------------------------------- tokens

    def encode(self, text: str) -> list[int]:
        return self._tok.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.backend_tokenizer.decode(list(ids), skip_special_tokens=False)

    def render_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        return self._tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs
        )

    # --------------------------------------------------------------------------------- rendering

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        """Full render with per-token attribution. Attribution renders every prefix of `messages`
        (quadratic in the number of messages): for inspection and tests, not for the per-turn path."""
        text = self.render_text(messages, tools, add_generation_prompt)
        encoding = self._tok.backend_tokenizer.encode(text, add_special_tokens=False)
        spans = self._message_spans(messages, tools, text)
        starts = [lo for lo, _, _, _ in spans]
        owner = [SCAFFOLD] * len(encoding.ids)
        sampled = [False] * len(encoding.ids)
        last_close: dict[int, int] = {}
        for n, (start, _) in enumerate(encoding.offsets):
            at = bisect.bisect_right(starts, start) - 1
            if at < 0 or start >= spans[at][1]:
                continue
            _, _, index, body = spans[at]
            owner[n] = index
            sampled[n] = body is not None and body <= start
            if sampled[n] and encoding.ids[n] == self.close_id:
                last_close[index] = n
        # A body ends at its close token: the boundary text after it is template, not sample.
        for n, index in enumerate(owner):
            if sampled[n] and index in last_close and n > last_close[index]:
                sampled[n] = False
        return Rendered(ids=list(encoding.ids), message_index=owner, sampled=sampled)

    def _message_spans(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, text: str
    ) -> list[tuple[int, int, int, int | None]]:
        """(start char, end char, message index, body start char for assistant turns), in order."""
        spans: list[tuple[int, int, int, int | None]] = []
        previous_end = 0
        for i, message in enumerate(messages):
            try:
                end = _common_prefix(text, self.render_text(messages[: i + 1], tools, False))
                body = None
                if message.get("role") == "assistant":
                    body = _common_prefix(text, self.render_text(messages[:i], tools, True))
            except Exception:  # templates may refuse partial conversations: leave them unattributed
                continue
            if end > previous_end:
                spans.append((previous_end, end, i, body))
                previous_end = end
        return spans

    # ------------------------------------------------------------------------------- trajectories

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> StartReply:
        return StartReply(prompt_ids=self.encode(self.render_text(messages, tools, True)))

    def bridge(self, request: BridgeRequest) -> BridgeReply:
        check_new_messages(request.new_messages)
        completion = request.completion_ids
        message = completion_message(self, request)
        closed = bool(completion) and completion[-1] == self.close_id
        close = [] if closed else [self.close_id]
        delta = self._delta_text(request.new_messages, request.tools)
        reply = {"synthetic_close": not closed, "assistant_message": message}
        if delta is not None and self.key.history == "append":
            return BridgeReply(appended_ids=close + self.encode(self.boundary + delta), **reply)
        if request.history is None:
            return BridgeReply(needs_history=True)

        expected = [*request.history.prompt_ids, *completion, *close]
        messages = [*request.history.messages, message, *request.new_messages]
        full_text = self.render_text(messages, request.tools, True)
        full_ids = self.encode(full_text)
        if full_ids[: len(expected)] == expected:
            return BridgeReply(appended_ids=close + full_ids[len(expected) :], **reply)
        prefix_text = self.decode(expected)
        if full_text.startswith(prefix_text):
            # Same text, different split (a non-canonical sample): the history is not rewritten.
            return BridgeReply(appended_ids=close + self.encode(full_text[len(prefix_text) :]), **reply)
        # The template rewrote the history (or cannot extend it): fork, explicitly.
        return BridgeReply(prompt_ids=full_ids, forked=True, **reply)

    def _delta_text(
        self, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> str | None:
        """Text the template writes for `new_messages` (plus the generation prompt) after a closed
        assistant turn, or None when the template does not render it as an extension."""
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        if tools_key not in self._delta_base:
            if len(self._delta_base) >= DELTA_BASES_KEPT:
                self._delta_base.clear()
            try:
                self._delta_base[tools_key] = self.render_text(SYNTHETIC, tools, False)
            except Exception:
                self._delta_base[tools_key] = None
        base = self._delta_base[tools_key]
        if base is None:
            return None
        try:
            full = self.render_text([*SYNTHETIC, *new_messages], tools, True)
        except Exception:
            return None
        if not full.startswith(base):
            return None
        return full[len(base) :]

    def parse(
        self, completion_ids: Sequence[int], tools: list[dict[str, Any]] | None = None
    ) -> ParsedCompletion:
        return parse_completion(
            completion_ids, self.markers, self.decode, tools, empty_reasoning=self._empty_reasoning
        )


def _common_prefix(a: str, b: str) -> int:
    if a.startswith(b):  # the usual case: a prefix render is a prefix of the full render
        return len(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # longest k with a[:k] == b[:k], by bisection on C-speed slice compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
