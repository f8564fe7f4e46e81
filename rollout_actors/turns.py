"""How a rollout samples its turns: two small strategies, token mode and chat mode.

The rollout loop (`rollout.py`) is the same for both: open, then per turn `sample` and, unless the episode
ended, `advance` with the environment's answer, then `close` in `finally`. A strategy records each turn as
what it added to its branch (`Turn.new_prompt_ids`), never the whole prompt (contract 11).

- `TokenTurns`: the renderer renders the first prompt and bridges each turn (previous prompt + sampled
  completion + rendered delta, contract 7); the server samples from token ids. The bridge says what it
  appended, so recording a turn costs what the turn adds.
- `ChatTurns`: the server renders (`/v1/chat/completions`) and reports the prompt ids it used. A prompt
  that extends the previous prompt + completion records only the extension; one that does not (the
  server's template rewrote history) starts a new branch, explicitly, with its whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import openai

from renderer_actors.session import RendererSession
from rollout_actors.model_call import Sampled, complete_chat, complete_tokens, tool_call_views
from rollout_actors.wire import RolloutRequest, ToolCall, Turn

Budget = Callable[[], float]
"""Seconds the next remote call may take (its ceiling, capped by the rollout's remaining deadline)."""


class TurnStrategy(Protocol):
    forked: bool
    """The trajectory has more than one branch."""

    async def open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None: ...

    async def sample(self, messages: list[dict[str, Any]]) -> tuple[Turn, dict[str, Any]]:
        """One model call: the recorded turn and the assistant message for the environment."""
        ...

    async def advance(self, new_messages: list[dict[str, Any]]) -> None:
        """The environment answered `new_messages`: get ready for the next turn."""
        ...

    async def close(self) -> None:
        """Release what the strategy holds. Never raises."""
        ...


def strategy_for(
    request: RolloutRequest, client: openai.AsyncOpenAI, pools: Any, budget: Budget
) -> TurnStrategy:
    if request.mode == "token":
        return TokenTurns(request, client, pools, budget)
    return ChatTurns(request, client)


class TokenTurns:
    def __init__(self, request: RolloutRequest, client: openai.AsyncOpenAI, pools: Any, budget: Budget):
        self._request = request
        self._client = client
        self._pools = pools
        self._budget = budget
        self._renderer: RendererSession | None = None
        self._tools: list[dict[str, Any]] | None = None
        self._prompt: list[int] = []
        """The whole current prompt: the server needs it, the result does not."""
        self._added: list[int] = []
        """What the next turn adds to its branch (`Turn.new_prompt_ids`)."""
        self._synthetic = 0
        self._branch = 0
        self._last: Sampled | None = None
        self.forked = False

    async def open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        request = self._request
        self._tools = tools
        self._renderer = await RendererSession.open(
            self._pools.renderer_pool(), request.client.model, request.renderer, timeout=self._budget()
        )
        self._prompt = await self._renderer.start(messages, tools, timeout=self._budget())
        self._added = self._prompt

    async def sample(self, messages: list[dict[str, Any]]) -> tuple[Turn, dict[str, Any]]:
        assert self._renderer is not None
        request = self._request
        sampled = await complete_tokens(
            self._client,
            request.client.model,
            self._prompt,
            request.sampling,
            deadline_s=request.client.call_deadline,
            vocab_size=self._renderer.vocab_size,
        )
        parsed = await self._renderer.parse(sampled.completion_ids, self._tools, timeout=self._budget())
        self._last = sampled
        turn = Turn(
            new_prompt_ids=self._added,
            completion_ids=sampled.completion_ids,
            logprobs=sampled.logprobs,
            finish_reason=sampled.finish_reason,
            branch=self._branch,
            synthetic_ids=self._synthetic,
            content=parsed.content,
            reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls,
            policy_version=request.policy_version or 0,
        )
        return turn, parsed.message

    async def advance(self, new_messages: list[dict[str, Any]]) -> None:
        assert self._renderer is not None and self._last is not None
        completion = self._last.completion_ids
        step = await self._renderer.bridge(
            completion, self._last.finish_reason, new_messages, self._tools, timeout=self._budget()
        )
        if step.forked:  # a new branch starts from a full re-render: nothing synthetic in it
            self._added, self._synthetic = step.prompt_ids, 0
            self.forked = True
        else:  # the next prompt is this prompt + completion + what the bridge appended
            self._added = step.prompt_ids[len(self._prompt) + len(completion) :]
            self._synthetic = step.synthetic_ids
        self._prompt, self._branch = step.prompt_ids, step.branch

    async def close(self) -> None:
        if self._renderer is not None:
            await self._renderer.close()


class ChatTurns:
    def __init__(self, request: RolloutRequest, client: openai.AsyncOpenAI):
        self._request = request
        self._client = client
        self._tools: list[dict[str, Any]] | None = None
        self._seen: list[int] | None = None
        """The previous turn's prompt + completion: what the next prompt should extend."""
        self._branch = 0
        self.forked = False

    async def open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        self._tools = tools

    async def sample(self, messages: list[dict[str, Any]]) -> tuple[Turn, dict[str, Any]]:
        request = self._request
        sampled = await complete_chat(
            self._client,
            request.client.model,
            messages,
            self._tools,
            request.sampling,
            deadline_s=request.client.call_deadline,
        )
        prompt = sampled.prompt_ids or []
        seen = self._seen
        if seen is None:
            added = prompt
        elif len(prompt) >= len(seen) and prompt[: len(seen)] == seen:
            added = prompt[len(seen) :]
        else:  # the server's template re-rendered history differently from what was sampled
            self._branch += 1
            self.forked = True
            added = prompt
        self._seen = prompt + sampled.completion_ids
        message = sampled.message
        turn = Turn(
            new_prompt_ids=added,
            completion_ids=sampled.completion_ids,
            logprobs=sampled.logprobs,
            finish_reason=sampled.finish_reason,
            branch=self._branch,
            content=message.get("content"),
            reasoning=message.get("reasoning_content"),
            tool_calls=[ToolCall(**view) for view in tool_call_views(message)],
            policy_version=request.policy_version or 0,
        )
        return turn, message

    async def advance(self, new_messages: list[dict[str, Any]]) -> None:
        pass  # the loop keeps the messages; the server renders them

    async def close(self) -> None:
        pass
