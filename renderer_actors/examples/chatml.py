"""A custom renderer: plain ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`), no reasoning, no tools.

The shape the `renderers` library expects of a custom renderer (`config_class` + `(tokenizer, config)`,
`render` / `render_ids` / `parse_response` / `get_stop_token_ids` / `bridge_to_next_turn`), marked
`@ref_target("renderer")` so a rollout can name it::

    RendererConfig(family="custom", custom=Ref("renderer_actors.examples.chatml:ChatMLRenderer",
                                               {"system_prompt": "Be terse."}))
"""

from __future__ import annotations

from typing import Any, Literal

from renderers.base import ParsedResponse, RenderedTokens, trim_to_turn_close
from renderers.configs import BaseRendererConfig

from rollout_actors.kernel import ref_target


class ChatMLRendererConfig(BaseRendererConfig):
    name: Literal["chatml"] = "chatml"
    system_prompt: str | None = None
    """A system message put first when the conversation has none."""

    _internal_fields = frozenset({"system_prompt"})


@ref_target("renderer")
class ChatMLRenderer:
    config_class = ChatMLRendererConfig
    is_prefix_stable = True

    def __init__(self, tokenizer: Any, config: ChatMLRendererConfig | None = None) -> None:
        self._tokenizer = tokenizer
        self.config = config or ChatMLRendererConfig()
        self._im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self._im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(self._im_start, int) or not isinstance(self._im_end, int):
            raise ValueError("ChatMLRenderer needs <|im_start|> and <|im_end|> tokens")

    def _message_ids(self, message: dict[str, Any]) -> list[int]:
        text = f"{message['role']}\n{message.get('content') or ''}"
        return [self._im_start, *self._tokenizer.encode(text, add_special_tokens=False), self._im_end]

    def _newline(self) -> list[int]:
        return self._tokenizer.encode("\n", add_special_tokens=False)

    def _generation_prompt(self) -> list[int]:
        return [self._im_start, *self._tokenizer.encode("assistant\n", add_special_tokens=False)]

    def render(self, messages, *, tools=None, add_generation_prompt=False) -> RenderedTokens:
        if self.config.system_prompt and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.config.system_prompt}, *messages]
        ids: list[int] = []
        owner: list[int] = []
        for i, message in enumerate(messages):
            piece = self._message_ids(message) + self._newline()
            ids += piece
            owner += [i] * len(piece)
        if add_generation_prompt:
            prompt = self._generation_prompt()
            ids += prompt
            owner += [-1] * len(prompt)
        return RenderedTokens(
            token_ids=ids, message_indices=owner, message_roles=[m["role"] for m in messages]
        )

    def render_ids(self, messages, *, tools=None, add_generation_prompt=False) -> list[int]:
        return self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt).token_ids

    def parse_response(self, token_ids, *, tools=None, prompt_ids=None) -> ParsedResponse:
        end = next((i for i, t in enumerate(token_ids) if t == self._im_end), len(token_ids))
        return ParsedResponse(content=self._tokenizer.decode(token_ids[:end], skip_special_tokens=False))

    def get_stop_token_ids(self) -> list[int]:
        return [self._im_end]

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None):
        if not previous_prompt_ids or any(m.get("role") == "assistant" for m in new_messages):
            return None
        previous = trim_to_turn_close(
            previous_prompt_ids, previous_completion_ids, {self._im_end}, synthesize_close=self._im_end
        )
        if previous is None:
            return None
        added = self._newline()
        for message in new_messages:
            added += self._message_ids(message) + self._newline()
        added += self._generation_prompt()
        return RenderedTokens(token_ids=previous + added, message_indices=[-1] * (len(previous) + len(added)))
