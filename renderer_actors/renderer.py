"""`Renderer`: one `renderers` library renderer with this project's contracts on top.

The library renders, parses and bridges (`bridge_to_next_turn`: previous prompt + sampled completion +
the new messages' tokens, never re-tokenising what was sampled, `None` when it cannot prove that). On top:

- **Token-exact extension, checked.** A library bridge is used only if its ids start with exactly the
  previous prompt and the completion (a bridge that trims sampled tokens is treated as no bridge).
- **Where the library cannot bridge** (`None`: a template that drops past reasoning at a new user turn,
  the `default` family's opaque template, a reasoning block left open), the conversation is rendered in
  full and the trajectory extends only if that render starts with the trajectory: by ids, or by the
  text the tokenizer sees (a sample split non-canonically, or in another Unicode normal form, is not a
  rewrite). Otherwise the trajectory forks to the full render, explicitly, and says where it departed.
- **`fork_on_rewrite`** checks every turn against a full render, so a template that would render the
  history differently forks even where the library could have extended it.
- **Sampled tokens are never swapped**: a fork is a new branch; the old one keeps what was sampled.
- **The model's template is the reference** (docs/renderers.md): the `default` family renders
  with the template itself, arguments as sampled, and learns the template's reasoning whitespace (parse
  is the inverse of render) and its turn close (a stop id); the bundled model has its own renderer
  (`bundled.py`); where the library deliberately departs from a template (Qwen3, thinking off), the
  template wins unless `template_faithful=False`.
- **A completion without a stop token** (cut by `length`) is closed as the library's family defines it
  (the library synthesises the close, e.g. `</think>` + `<|im_end|>`), marked `synthetic_close`.

Cost: the session sends only the tail of the previous prompt (after the last sampled completion), which
is all a library bridge reads of it, so a bridge costs the same at turn 100 as at turn 1. The full render
(fallback, `fork_on_rewrite`) is linear in the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from renderer_actors.bundled import BUNDLED_RENDERER
from renderer_actors.calls import (
    ROLES,
    BridgeReply,
    BridgeRequest,
    Rendered,
    StartReply,
    check_new_messages,
    check_roles,
)
from renderer_actors.config import DEFAULT_RENDERER_PREFIXES
from renderer_actors.key import RendererKey
from renderer_actors.library import build_library_renderer
from renderer_actors.parse import ParsedCompletion, from_library, named_tool_answers, template_messages
from renderer_actors.template_shape import BUNDLED_SHAPE, ThinkShape, probe_close, probe_shape, template_ids
from renderer_actors.tokenizer import FastTokenizer

SHOWN_TOKENS = 12  # tokens of each side a fork reason quotes


THINKING_OFF_HISTORY = frozenset({"qwen3", "qwen3.5", "qwen3.6"})
"""Families whose template renders past turns the same with thinking on and off, where the library
re-emits the empty think block on them with thinking off (its documented deviation): with
`template_faithful` their history renders as with thinking on. Not `qwen3.8`: its `enable_thinking`
also changes the system prompt, so it keeps the library's deviation (docs/renderers.md)."""


EMPTY_THINK_DROPPED = frozenset({"qwen3"})
"""Families whose template drops an empty think block from a turn once it is no longer the last (Qwen3's
`loop.last or reasoning_content`) where the library's bridge keeps it: with `template_faithful`, such a
turn is checked against the full render, which forks (docs/families.md)."""
EMPTY_CONTENT_AS_STRING = frozenset({"glm-4.5", "gpt-oss"})
"""Families whose template takes a turn without text only as `''`: GLM-4.5's writes `None` as the text
"None" (`visible_text`, and the library with it), gpt-oss's tests `in` on the content and fails on `None`.
A parsed turn without text carries `''`, so the template renders it, as what was sampled."""
STOP_CLOSES_BLOCK = frozenset({"gpt-oss"})
"""Families whose stop token closes the turn's last block, and the library's parse reads it: harmony's
`<|call|>` closes a call (without it the call reads as unclosed, and is dropped from the message)."""
TOOL_ANSWERS_BY_NAME = frozenset({"gpt-oss"})
"""Families whose renderer names a tool answer's author by the answer's `name` (harmony's
`functions.<name>`): an answer without one is named after the call it answers, as vLLM 0.33 and the
model's template name it (`parse.named_tool_answers`)."""


class Renderer:
    """Render / parse / bridge for one `RendererKey`. Synchronous and CPU-bound: the renderer actor runs
    each call inline (each is short)."""

    def __init__(self, key: RendererKey, library: Any, tokenizer: FastTokenizer, family: str) -> None:
        self.key = key
        self.family = family
        self.always_needs_history = key.history == "fork_on_rewrite"
        self.library = library
        self.tokenizer = tokenizer
        self.library_bridges = True
        """False where the library's bridge extends although the template rewrites (see below)."""
        self.template_kwargs: dict[str, Any] = {}
        self.shape: ThinkShape | None = None
        """The template's reasoning shape where the parse follows it (bundled, `default`)."""
        self._history_renderer: Any = None
        self._generation_prompt: list[int] = []
        close = None
        if family == "default":
            # The template is the renderer: it renders and closes turns its own way.
            self.template_kwargs = dict(getattr(library.config, "model_extra", None) or {})
            self.shape = probe_shape(tokenizer, self.template_kwargs)
            close = probe_close(tokenizer, tokenizer.backend, self.template_kwargs)
        elif family == BUNDLED_RENDERER:
            self.shape = BUNDLED_SHAPE
        elif family in THINKING_OFF_HISTORY and key.template_faithful and not library.config.enable_thinking:
            # The library re-emits the prefilled empty think block on past turns (its deliberate
            # deviation); these templates render history the same whatever `enable_thinking` is, so
            # history renders as with thinking on, and only the generation prompt differs. The
            # template drops that block from every past turn: the library's bridge would miss the
            # rewrite, so every turn is checked against the full render (and forks).
            self._history_renderer = type(library)(
                tokenizer, library.config.model_copy(update={"enable_thinking": True})
            )
            probe = [{"role": "user", "content": "u"}]
            self._generation_prompt = library.render_ids(probe, add_generation_prompt=True)[
                len(library.render_ids(probe)) :
            ]
            self.library_bridges = False
        self.stop_ids = frozenset(library.get_stop_token_ids()) | ({close} if close is not None else set())
        """The family's stop ids, and the template's own turn close where it is another token."""

    @classmethod
    def load(
        cls, key: RendererKey, allowed_prefixes: tuple[str, ...] = DEFAULT_RENDERER_PREFIXES
    ) -> Renderer:
        """Load the tokenizer and build the library renderer. Blocking (seconds): the renderer actor calls
        it off the event loop, under its build lock."""
        tokenizer = FastTokenizer.load(key.model)
        library, family = build_library_renderer(key, tokenizer, allowed_prefixes)
        return cls(key, library, tokenizer, family)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # --------------------------------------------------------------------------------- rendering

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        messages = self._as_templates_read(messages)
        if self.family == "default":
            return self._render_by_template(messages, tools, add_generation_prompt)
        library = self._history_renderer or self.library
        rendered = library.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt and library is self.library
        )
        ids, index, sampled = (
            list(rendered.token_ids),
            list(rendered.message_indices),
            list(rendered.sampled_mask),
        )
        if library is not self.library and add_generation_prompt:
            ids += self._generation_prompt
            index += [-1] * len(self._generation_prompt)
            sampled += [False] * len(self._generation_prompt)
        return Rendered(ids=ids, message_index=index, sampled=sampled)

    def render_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> list[int]:
        """The conversation's ids as the model's template renders them (the reference for every turn)."""
        messages = self._as_templates_read(messages)
        if self.family == "default":
            return template_ids(self.tokenizer, messages, tools, add_generation_prompt, self.template_kwargs)
        if self._history_renderer is not None:
            ids = list(self._history_renderer.render_ids(messages, tools=tools))
            return ids + self._generation_prompt if add_generation_prompt else ids
        return list(
            self.library.render_ids(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        )

    def _as_templates_read(
        self, messages: list[dict[str, Any]], earlier: Sequence[dict[str, Any]] = ()
    ) -> list[dict[str, Any]]:
        messages = template_messages(messages)
        return named_tool_answers(messages, earlier) if self.family in TOOL_ANSWERS_BY_NAME else messages

    def _render_by_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> Rendered:
        """The template's render with each token attributed to its message (one render per message)."""
        ids: list[int] = []
        index: list[int] = []
        sampled: list[bool] = []
        for i, message in enumerate(messages):
            upto = template_ids(self.tokenizer, messages[: i + 1], tools, False, self.template_kwargs)
            added = len(upto) - len(ids)
            index += [i] * added
            sampled += [message.get("role") == "assistant"] * added
            ids = upto
        if add_generation_prompt:
            ids = self.render_ids(messages, tools, True)
            index += [-1] * (len(ids) - len(index))
            sampled += [False] * (len(ids) - len(sampled))
        return Rendered(ids=ids, message_index=index[: len(ids)], sampled=sampled[: len(ids)])

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> StartReply:
        check_roles(messages, ROLES, "messages")
        return StartReply(prompt_ids=self.render_ids(messages, tools, True))

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: list[dict[str, Any]] | None = None,
        prompt_tail: Sequence[int] | None = None,
    ) -> ParsedCompletion:
        """`prompt_tail`: the end of the prompt the completion was sampled after (its generation prompt
        tells the library whether reasoning was prefilled open)."""
        ids = list(completion_ids)
        stop = next((i for i, token in enumerate(ids) if token in self.stop_ids), len(ids))
        body = ids[:stop]
        tail = list(prompt_tail or []) or None
        read = ids[: stop + 1] if self.family in STOP_CLOSES_BLOCK else body
        parsed = self.library.parse_response(read, tools=tools, prompt_ids=tail)
        reasoning, content = parsed.reasoning_content, parsed.content
        text = self.decode(body)
        if self.shape is not None:
            calls = [call.token_span[0] for call in parsed.tool_calls if call.token_span]
            before_calls = self.decode(body[: min(calls, default=len(body))])
            prefill = self.shape.prefill(self.decode(tail)) if tail else None
            reasoning, content, _ = self.shape.split(before_calls, prefill, bool(parsed.tool_calls))
        else:
            reasoning, content = _library_reasoning(
                reasoning, content, parsed, text, tail and self.decode(tail)
            )
        empty = "" if self.family in EMPTY_CONTENT_AS_STRING else None
        return from_library(
            parsed, ids, self.stop_ids, reasoning=reasoning, content=content, text=text, empty_content=empty
        )

    # ------------------------------------------------------------------------------- trajectories

    def bridge(self, request: BridgeRequest) -> BridgeReply:
        """The ids that extend previous prompt + completion to the next prompt, or a fork (see module)."""
        check_new_messages(request.new_messages)
        completion = request.completion_ids
        message = request.assistant_message
        if message is None:
            message = self.parse(completion, request.tools, request.prompt_tail).message
        synthetic = not (completion and completion[-1] in self.stop_ids)
        reply = {"synthetic_close": synthetic, "assistant_message": message}
        extension = self._library_extension(request, message) if self.library_bridges else None
        checked = self.always_needs_history or (
            self.key.template_faithful
            and self.family in EMPTY_THINK_DROPPED
            and message.get("reasoning", message.get("reasoning_content")) == ""
        )
        if extension is not None and not checked:
            return BridgeReply(
                appended_ids=extension, synthetic_ids=self._close_length(extension, synthetic), **reply
            )
        if request.history is None:
            return BridgeReply(needs_history=True)

        prefix = [*request.history.prompt_ids, *completion]
        messages = [*request.history.messages, message, *request.new_messages]
        full = self.render_ids(messages, request.tools, True)
        appended, why = self._extension_of(prefix, full)
        if appended is not None:
            return BridgeReply(
                appended_ids=appended, synthetic_ids=self._close_length(appended, synthetic), **reply
            )
        lead = (
            "fork_on_rewrite"
            if extension is not None
            else "the library could not bridge this turn"
            if self.library_bridges
            else "the template rewrites past turns"
        )
        return BridgeReply(prompt_ids=full, forked=True, fork_reason=f"{lead}; {why}", **reply)

    def _close_length(self, appended: list[int], synthetic: bool) -> int:
        """How many of `appended` are the synthetic close: through the first stop token (e.g. `</think>`,
        `\\n\\n`, `<|im_end|>` after a cut inside reasoning); 0 when nothing was synthesised."""
        if not synthetic:
            return 0
        return next((i + 1 for i, token in enumerate(appended) if token in self.stop_ids), 0)

    def _library_extension(
        self, request: BridgeRequest, message: dict[str, Any] | None = None
    ) -> list[int] | None:
        """The library's bridge from the prompt tail, if it keeps the tail and the completion exactly.
        `message`: the sampled turn as parsed (the calls the new tool answers answer)."""
        tail, completion = request.prompt_tail, request.completion_ids
        if not tail:
            return None
        new_messages = self._as_templates_read(request.new_messages, [message] if message else [])
        bridged = self.library.bridge_to_next_turn(
            list(tail), list(completion), new_messages, tools=request.tools
        )
        if bridged is None:
            return None
        ids = bridged.token_ids
        kept = len(tail) + len(completion)
        if len(ids) < kept or ids[: len(tail)] != tail or ids[len(tail) : kept] != completion:
            return None  # it trimmed or rewrote sampled tokens: not an extension
        return list(ids[kept:])

    def _extension_of(self, prefix: list[int], full: list[int]) -> tuple[list[int] | None, str]:
        """What a full render adds after `prefix` if it starts with it: by ids, or by the text the
        tokenizer sees (normalised, so NFD input or a non-canonical split of the same text is not a
        rewrite); else None and where the two depart."""
        if full[: len(prefix)] == prefix:
            return full[len(prefix) :], ""
        normalize = self.tokenizer.normalize
        full_text = normalize(self.decode(full))
        prefix_text = normalize(self.decode(prefix))
        if full_text.startswith(prefix_text):
            suffix = self.encode(full_text[len(prefix_text) :])
            if normalize(self.decode(prefix + suffix)) == full_text:
                return suffix, ""
        at = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), len(full))
        ours = self.decode(prefix[at : at + SHOWN_TOKENS])
        theirs = self.decode(full[at : at + SHOWN_TOKENS])
        return None, (
            f"the template renders the conversation differently from token {at} of {len(prefix)}: "
            f"trajectory {ours!r}, template {theirs!r}"
        )


def _library_reasoning(
    reasoning: str | None, content: str | None, parsed: Any, text: str, prompt_text: str | None
) -> tuple[str | None, str | None]:
    """The library families' parse, made the inverse of their render where it is not: a think block cut
    by a length stop loses the newline its opening marker carries (as a closed one does); an empty
    think block that was sampled is an empty reasoning, not none; and a think block the generation
    prompt opened where the library does not look for it (DeepSeek-R1's `<think>\n` after tool
    outputs) is reasoning, not content that starts with `</think>`."""
    if reasoning is not None and parsed.reasoning_complete is False:
        return reasoning.lstrip("\n"), content
    if reasoning is None and "</think>" in text:
        prefilled = bool(prompt_text and prompt_text.endswith(("<think>", "<think>\n")))
        opened = text.lstrip().startswith("<think>") or prefilled
        before = text.split("</think>", 1)[0]
        if prefilled and content is not None and "</think>" in content and "<think>" not in before:
            return before.strip("\n"), content.split("</think>", 1)[1].lstrip("\n") or None
        if opened and not before.replace("<think>", "").strip():
            return "", content
    return reasoning, content
