"""`AgentCalls`: one rollout's side of its agent's calls. Each call is one turn, as in token mode.

A call's conversation is matched against what the rollout has seen (`history.py`): it extends the
trajectory through the renderer's token-exact bridge, or forks it explicitly. The turn is sampled from
token ids with the rollout's own client (`TokenTurns`), parsed into content, reasoning and tool calls by
the renderer, recorded exactly as a token-mode turn, and answered in OpenAI's chat-completion shape.

What an agent gets back, and what it means for the rollout:

- 200: the turn (its `usage` counts the branch's prompt and the completion); with `stream`, the same
  turn as server-sent events (the endpoint streams it once sampled).
- 400: the call asked for what token sampling cannot honour (`n` > 1, a `tool_choice` other than
  `auto`), or its messages cannot be rendered; or the turn budget (`max_turns`) is spent, which
  ends the episode (it is scored as it stands, like a token-mode rollout that ran out of turns).
- 502 / 503: the model or one of our parts failed. The rollout ends with that failure (`model` or
  `infrastructure`), as a token-mode turn's failure would; the agent is stopped.
- 409: the rollout is ending; 410 (from the endpoint): it has ended.

The rollout's sampling settings govern every turn: an agent's `temperature`, `max_tokens` and the like
are not the trainer's to override and are ignored. Calls of one rollout are served one at a time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from renderer_actors.session import RendererCallerError
from rollout_actors.rollout.agent.endpoint import error_body
from rollout_actors.rollout.agent.history import Continuation, Seen, continuation, tools_key
from rollout_actors.rollout.failures import classify
from rollout_actors.rollout.turns import TokenTurns
from rollout_actors.wire import RolloutRequest, Turn

STATUS_OF_KIND = {"model": 502, "infrastructure": 503, "caller": 400}
"""What an agent is answered when a turn fails: the SDK raises its usual error class for each."""


class AgentCalls:
    """Serves one rollout's agent (registered on the endpoint by `episode.py`)."""

    def __init__(
        self,
        request: RolloutRequest,
        turns: TokenTurns,
        recorded: list[Turn],
        messages: list[dict[str, Any]],
    ) -> None:
        self._request = request
        self._turns = turns
        self._recorded = recorded
        """The rollout's `Result.turns`, appended to as turns are sampled."""
        self._messages = messages
        """The rollout's conversation (`Result.messages`): the last call's messages and its answer."""
        self._lock = asyncio.Lock()
        self._opened = False
        self._seen: Seen | None = None
        """What the trajectory holds after the last answered call; None before the first and after a call
        that failed part-way (the next one then forks: nothing half-bridged is ever extended)."""
        self._context = 0
        """Prompt + completion tokens on the current branch (`usage`)."""
        self.failure: BaseException | None = None
        """A turn's failure that ends the rollout (model, renderer, our parts)."""
        self.turns_spent = False
        self.stopped = asyncio.Event()
        """Set when the episode must end before the agent does: a failure, or the turn budget spent."""

    def model_list(self) -> dict[str, Any]:
        model = self._request.client.model
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "ray-rollouts"}]}

    async def chat_completion(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        problem = _refusal(body)
        if problem is not None:
            return 400, error_body(400, *problem)
        messages, tools = body["messages"], body.get("tools") or None
        async with self._lock:
            if self.stopped.is_set():
                return 409, error_body(409, "rollout_ending", "this rollout is ending: no more turns")
            if len(self._recorded) >= self._request.max_turns:
                self.turns_spent = True
                self.stopped.set()
                message = f"this rollout's turn budget is spent (max_turns={self._request.max_turns})"
                return 400, error_body(400, "max_turns_reached", message)
            try:
                turn, assistant = await self._turn(messages, tools)
            except RendererCallerError as exc:  # the agent's messages cannot be rendered: its call, its error
                return 400, error_body(400, "invalid_messages", str(exc))
            except Exception as exc:
                self.failure = exc
                self.stopped.set()
                kind, failure = classify(exc)
                status = STATUS_OF_KIND.get(kind, 500)
                return status, error_body(status, failure.type, f"the turn failed: {failure.message}")
        return 200, self._answer(turn, assistant)

    async def _turn(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[Turn, dict]:
        seen, self._seen = self._seen, None
        if not self._opened:
            self._opened = True
            await self._turns.open(messages, tools)
            self._context = 0
        else:
            step = (
                continuation(seen, messages, tools)
                if seen
                else Continuation(None, "the previous call failed")
            )
            if step.new_messages is not None:
                await self._turns.advance(step.new_messages)
            else:  # `step.fork_reason` says why; the result marks the fork (`forked`, the turn's branch)
                await self._turns.restart(messages, tools)
                self._context = 0
        turn, assistant = await self._turns.sample(messages)
        self._recorded.append(turn)
        self._context += len(turn.new_prompt_ids)
        self._messages[:] = [*messages, assistant]
        self._seen = Seen(self._messages.copy(), tools_key(tools))
        return turn, assistant

    def _answer(self, turn: Turn, assistant: dict[str, Any]) -> dict[str, Any]:
        prompt_tokens = self._context
        self._context += len(turn.completion_ids)
        message = {"role": "assistant", "content": assistant.get("content")}
        if assistant.get("reasoning") is not None:
            message["reasoning"] = assistant["reasoning"]  # vLLM 0.33's field
        if assistant.get("tool_calls"):
            message["tool_calls"] = assistant["tool_calls"]
            finish = "tool_calls"
        else:
            finish = "length" if turn.finish_reason == "length" else "stop"
        return {
            "id": f"chatcmpl-{self._request.request_id}-{len(self._recorded) - 1}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self._request.client.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(turn.completion_ids),
                "total_tokens": prompt_tokens + len(turn.completion_ids),
            },
        }


def _refusal(body: dict[str, Any]) -> tuple[str, str] | None:
    """(code, message) when a call asks for what this endpoint does not serve; None when it is servable."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "invalid_messages", "messages must be a non-empty list of chat messages"
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "invalid_tools", "tools must be a list of function tools"
    if body.get("n") not in (None, 1):
        return "unsupported_n", "one choice per call (n=1): each call is one turn"
    if body.get("tool_choice") not in (None, "auto"):
        return (
            "unsupported_tool_choice",
            "only tool_choice 'auto': token sampling cannot force or forbid a call",
        )
    return None
