"""The `Renderer` protocol (tokenizer + chat template), the messages it exchanges, and the factory.

A renderer is stateless with respect to rollouts: everything a bridge needs travels in the request (the
turn's completion, its new messages, a few bits of `TrajectoryState`), so any renderer of the same
`RendererKey` can serve any call and a dead one is replaced without losing a trajectory. The full history
travels only when a renderer asks for it (`needs_history`): on a fork, or for a generic template whose
turns cannot be rendered as a delta.

Two families: `qwen3` (native: renders by pieces, bridges in time linear in the new messages) and `hf`
(any Hugging Face chat template: delta against a synthetic prefix, full render plus an exact prefix check,
explicit fork when the template rewrites history).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, Field

from renderer_actors.key import RendererKey
from renderer_actors.parse import ParsedCompletion

SCAFFOLD = -1
"""`Rendered.message_index` of a token no message owns: the tools preamble, the generation prompt."""

NEW_MESSAGE_ROLES = frozenset({"user", "tool", "system"})
"""Roles a bridge accepts: sampled assistant turns are the completion ids themselves, never re-rendered."""


@dataclass
class Rendered:
    """Token ids with, per token, the message that produced it and whether a model would generate it."""

    ids: list[int]
    message_index: list[int]
    """Index into the rendered messages, or `SCAFFOLD`."""
    sampled: list[bool]
    """True for the body of an assistant turn (what follows its role header, through its close token):
    the loss mask of a rendered conversation."""


class TrajectoryState(BaseModel):
    """The little a renderer needs to remember about a trajectory, carried by the session between calls."""

    reasoning_pending: bool = False
    """An assistant turn since the last user message kept its think block: a template that drops past
    reasoning will rewrite it when the next user message arrives."""


class History(BaseModel):
    """The whole trajectory so far; sent only when a renderer asks for it."""

    messages: list[dict[str, Any]]
    """Every message the previous prompt was rendered from (parsed assistant turns included)."""
    prompt_ids: list[int]
    """The previous prompt."""


class StartReply(BaseModel):
    prompt_ids: list[int]
    state: TrajectoryState = Field(default_factory=TrajectoryState)


class BridgeRequest(BaseModel):
    """One turn's additions: what was sampled and what the environment answered."""

    completion_ids: list[int]
    finish_reason: str | None = None
    new_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    state: TrajectoryState = Field(default_factory=TrajectoryState)
    history: History | None = None
    assistant_message: dict[str, Any] | None = None
    """The completion already parsed (the session keeps its `parse` answer): not parsed a second time."""


class BridgeReply(BaseModel):
    appended_ids: list[int] = Field(default_factory=list)
    """Not forked: the next prompt is previous prompt + completion + these ids."""
    prompt_ids: list[int] | None = None
    """Forked: the whole next prompt (a full re-render), starting a new branch."""
    forked: bool = False
    synthetic_close: bool = False
    """The completion did not end with the close token (cut by `length` or a stop string): one was
    appended. It is prompt, not completion, so it is never trained on as sampled."""
    needs_history: bool = False
    """Nothing else is set: call again with `history`."""
    assistant_message: dict[str, Any] = Field(default_factory=dict)
    """The completion parsed into a message, for the session's history."""
    state: TrajectoryState = Field(default_factory=TrajectoryState)


class RendererInfo(BaseModel):
    """What a loaded renderer tells its callers (the answer to `ready`)."""

    key: str
    family: str
    """Resolved family (`auto` never appears here)."""
    always_needs_history: bool = False
    """Send `history` with every bridge (the generic family under `fork_on_rewrite`)."""
    load_s: float = 0.0
    pid: int = 0


class Renderer(Protocol):
    """Tokenizer + chat template for one `RendererKey`. Synchronous and CPU-bound: callers run it where
    blocking is acceptable (the renderer actor runs each call inline; each is short)."""

    key: RendererKey
    family: str
    always_needs_history: bool

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> Rendered: ...

    def render_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str: ...

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> StartReply: ...

    def bridge(self, request: BridgeRequest) -> BridgeReply: ...

    def parse(
        self, completion_ids: Sequence[int], tools: list[dict[str, Any]] | None
    ) -> ParsedCompletion: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def check_new_messages(messages: list[dict[str, Any]]) -> None:
    """Refuse what a bridge must not render: assistant turns (they are sampled ids, and re-rendering them
    is exactly the drift contract 7 forbids) and unknown roles. ValueError: the caller's mistake."""
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant":
            raise ValueError(
                f"new_messages[{i}] is an assistant message: sampled turns are bridged from their "
                "completion ids, never rendered from text"
            )
        if role not in NEW_MESSAGE_ROLES:
            raise ValueError(
                f"new_messages[{i}] has role {role!r}; expected one of {sorted(NEW_MESSAGE_ROLES)}"
            )


def message_text(content: Any) -> str:
    """Message content as text: None is empty, a list of OpenAI content parts is its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def build_renderer(key: RendererKey) -> Renderer:
    """Load the tokenizer for `key` and build its renderer. Blocking (seconds): call it off the event loop,
    under the process's build lock (the renderer actor does both)."""
    from renderer_actors.tokenizer import BUNDLED_MODEL

    if key.family == "qwen3":
        from renderer_actors.qwen3 import Qwen3Renderer

        return Qwen3Renderer.load(key)
    if key.family == "auto" and key.model == BUNDLED_MODEL:
        from renderer_actors.qwen3 import Qwen3Renderer

        return Qwen3Renderer.load(key.model_copy(update={"family": "qwen3"}))
    from renderer_actors.hf_generic import HfRenderer

    return HfRenderer.load(key)


def completion_message(renderer: Renderer, request: BridgeRequest) -> dict[str, Any]:
    """The bridged completion as an assistant message: the caller's parse when it sent one, else parsed here."""
    if request.assistant_message is not None:
        return request.assistant_message
    return renderer.parse(request.completion_ids, request.tools).message
