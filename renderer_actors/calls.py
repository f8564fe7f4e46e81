"""What a `RendererSession` and a `RendererActor` exchange: requests, replies, and a batch's outcomes.

Renderers are stateless with respect to rollouts: everything a bridge needs travels in the request (the
turn's completion, its new messages, the tail of the previous prompt), so any renderer of the same
`RendererKey` can serve any call and a dead one is replaced without losing a trajectory. The full
history travels only when a renderer asks for it (`needs_history`): where the library cannot bridge,
or under `fork_on_rewrite`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from rollout_actors.kernel import Failure
from rollout_actors.kernel.renamed import warn_renamed

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""Roles a conversation may hold; a renderer that silently skipped another would drop it from the prompt."""
NEW_MESSAGE_ROLES = frozenset({"user", "tool", "system"})
"""Roles a bridge accepts: sampled assistant turns are the completion ids themselves, never re-rendered."""


def check_new_messages(messages: list[dict[str, Any]]) -> None:
    """Refuse what a bridge must not render: assistant turns (they are sampled ids, and re-rendering them
    is exactly the drift contract 7 forbids) and unknown roles. ValueError: the caller's mistake."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            raise ValueError(
                f"new_messages[{i}] is an assistant message: sampled turns are bridged from their "
                "completion ids, never rendered from text"
            )
    check_roles(messages, NEW_MESSAGE_ROLES, "new_messages")


def check_roles(messages: list[dict[str, Any]], allowed: frozenset[str], where: str) -> None:
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in allowed:
            raise ValueError(f"{where}[{i}] has role {role!r}; expected one of {sorted(allowed)}")


@dataclass(frozen=True, slots=True)
class RendererSlot:
    """A slot on one renderer, handed out by the `RendererPool` and given back with `release(slot_id)`.
    (docs/design.md, "Words": what a rollout holds of a renderer is a slot; a lease is a request's.)"""

    slot_id: str
    renderer: Any
    """The renderer's actor handle: calls go to it directly. None where the asker said it holds it already
    (`RendererPool.acquire_many`'s `known`)."""
    renderer_id: str
    ready: bool
    """It had answered its readiness call when the slot was placed (callers still await `ready`)."""

    @property
    def lease_id(self) -> str:
        """The old name of `slot_id`."""
        warn_renamed("RendererSlot.lease_id", "slot_id")
        return self.slot_id


RendererLease = RendererSlot
"""The old name of `RendererSlot`."""


SCAFFOLD = -1
"""`Rendered.message_index` of a token no message owns: the tools preamble, the generation prompt."""


@dataclass
class Rendered:
    """Token ids with, per token, the message that produced it and whether a model would generate it."""

    ids: list[int]
    message_index: list[int]
    """Index into the rendered messages, or `SCAFFOLD`."""
    sampled: list[bool]
    """True where the model would generate the token (an assistant turn's body and close); empty when
    the family cannot tell (the `default` family's template is opaque)."""


class StartReply(BaseModel):
    prompt_ids: list[int]


class History(BaseModel):
    """The whole trajectory so far; sent only when a renderer asks for it."""

    messages: list[dict[str, Any]]
    """Every message the previous prompt was rendered from (parsed assistant turns included)."""
    prompt_ids: list[int]
    """The previous prompt."""


class BridgeRequest(BaseModel):
    """One turn's additions: what was sampled and what the environment answered."""

    completion_ids: list[int]
    finish_reason: str | None = None
    new_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    prompt_tail: list[int] = Field(default_factory=list)
    """The previous prompt after the last sampled completion (the whole prompt on the first turn or
    after a fork): the part holding the generation prompt, which is all a library bridge reads of it."""
    history: History | None = None
    assistant_message: dict[str, Any] | None = None
    """The completion already parsed (the session keeps its `parse` answer): not parsed a second time."""


class BridgeReply(BaseModel):
    appended_ids: list[int] = Field(default_factory=list)
    """Not forked: the next prompt is previous prompt + completion + these ids."""
    prompt_ids: list[int] | None = None
    """Forked: the whole next prompt (a full re-render), starting a new branch."""
    forked: bool = False
    fork_reason: str | None = None
    """Why the trajectory forked: where the template's full render departs from the trajectory."""
    synthetic_close: bool = False
    """The completion did not end with one of the family's stop tokens (cut by `length`, or a stop
    string): `appended_ids` begin with the close the library defines for the family. It is prompt, not
    completion, so it is never trained on as sampled."""
    synthetic_ids: int = 0
    """How many ids that close took (through the family's stop token): the first ids of `appended_ids`."""
    needs_history: bool = False
    """Nothing else is set: call again with `history`."""
    assistant_message: dict[str, Any] = Field(default_factory=dict)
    """The completion parsed into a message, for the session's history."""


class RendererInfo(BaseModel):
    """What a loaded renderer tells its callers (the answer to `ready`)."""

    key: str
    family: str
    """The library renderer in use (`auto` never appears here)."""
    always_needs_history: bool = False
    """Send `history` with every bridge (`fork_on_rewrite` checks each turn against a full render)."""
    load_s: float = 0.0
    pid: int = 0
    vocab_size: int = 0
    """Token ids the tokenizer knows (added tokens included): a sampled id at or past it is the
    server's fault, never a token to record."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """The family's stop ids and the template's own turn close, sent as `stop_token_ids` with every
    token-mode call: vLLM stops by itself only on the tokenizer's eos and `generation_config.json`'s
    `eos_token_id`, and a template may close turns with another token (as the library's own client does,
    they are always sent; one vLLM stops on anyway changes nothing but `stop_reason`)."""


@dataclass(frozen=True)
class CallOutcome:
    """One call's answer inside a `call_many` reply: its value, or how it failed on the renderer."""

    value: Any = None
    failure: Failure | None = None
    rejected: bool = False
    """The renderer refused the request itself (a `ValueError`: a bad message shape): the caller's fault."""
