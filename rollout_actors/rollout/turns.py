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

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import openai

from env_actors.interface import RAW_TEXT_KEY
from renderer_actors.session import RendererSession
from renderer_actors.tokenizer import known_vocab_size, load_vocab_size
from rollout_actors.rollout.failures import TurnAborted
from rollout_actors.rollout.model_call import (
    CallTags,
    PromptJson,
    Sampled,
    complete_chat,
    complete_tokens,
    tool_call_views,
)
from rollout_actors.timings import TurnTimings, clock, since
from rollout_actors.wire import RolloutRequest, ToolCall, Turn, VersionChange

MAX_RESUMES = 3  # a turn the plane aborts more often than this within one turn is reported, not chased
Budget = Callable[[], float]
"""Seconds the next remote call may take (its ceiling, capped by the rollout's remaining deadline)."""


class TurnStrategy(Protocol):
    forked: bool
    """The trajectory has more than one branch."""
    slot_s: float
    """Seconds `open` waited for a renderer slot (0 in chat mode)."""

    async def open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None: ...

    async def sample(self, messages: list[dict[str, Any]]) -> tuple[Turn, dict[str, Any]]:
        """One model call: the recorded turn and the assistant message for the environment, with the
        completion's raw text under `RAW_TEXT_KEY` (the loop keeps it out of the conversation)."""
        ...

    async def advance(self, new_messages: list[dict[str, Any]]) -> None:
        """The environment answered `new_messages`: get ready for the next turn."""
        ...

    async def close(self) -> None:
        """Release what the strategy holds. Never raises."""
        ...


def strategy_for(
    request: RolloutRequest, client: openai.AsyncOpenAI, pools: Any, policy: Any, budget: Budget
) -> TurnStrategy:
    """`pools`: a `rollout.PoolDirectory`; `policy`: a `rollout.PolicyState`."""
    if request.mode in ("token", "agent"):  # agent mode renders and samples each call as token mode does
        return TokenTurns(request, client, pools, policy, budget)
    return ChatTurns(request, client, policy)


class _Calls:
    """Numbers a rollout's model calls and says which policy each is sent under (contract 10)."""

    def __init__(self, request: RolloutRequest, policy: Any) -> None:
        self._request = request
        self._policy = policy
        self._count = 0

    async def unpaused(self, timeout: float) -> None:
        """Wait out a pause the plane is holding in abort mode (the servers refuse new requests then)."""
        await self._policy.unpaused(timeout)

    def next(self, resume: int = 0) -> tuple[CallTags, int]:
        """Tags for the next call (`X-Request-Id` = request id + turn, + part when a turn resumes after a
        pause; the version's `cache_salt`) and the policy version it is sent under: the rollout's, or
        newer full weights its worker was told of."""
        weights = self._policy.policy_version()
        version = max(self._request.policy_version or 0, weights or 0)
        if resume:
            call_id = f"{self._request.request_id}-turn{self._count - 1}-part{resume}"
        else:
            call_id = f"{self._request.request_id}-turn{self._count}"
            self._count += 1
        return CallTags(call_id, cache_salt=f"policy-v{version}"), version


def turn_versions(sampled: Sampled, sent_under: int) -> tuple[int, list[VersionChange]]:
    """The turn's version and where it changed, from the server's `weight_versions` when it reports them
    (labels are the versions `RolloutPlane.update_weights` set; others, such as vLLM's "default", say
    nothing and leave the version the call was sent under)."""
    labelled = [(int(label), start) for label, start in sampled.weight_versions if label.isdigit()]
    if not labelled:
        return sent_under, []
    version, changes = labelled[0][0] if labelled[0][1] == 0 else sent_under, []
    current = version
    for label, start in labelled:
        if label != current and start > 0:
            changes.append(VersionChange(at=start, version=label))
            current = label
    return version, changes


class TokenTurns:
    def __init__(
        self, request: RolloutRequest, client: openai.AsyncOpenAI, pools: Any, policy: Any, budget: Budget
    ):
        self._request = request
        self._client = client
        self._pools = pools
        self._policy = policy
        self._budget = budget
        self._renderer: RendererSession | None = None
        self._tools: list[dict[str, Any]] | None = None
        self._prompt: list[int] = []
        """The whole current prompt: the server needs it, the result does not."""
        self._prompt_json = PromptJson()
        """`_prompt` as JSON, encoded as it grows: a turn encodes what it added."""
        self._added: list[int] = []
        """What the next turn adds to its branch (`Turn.new_prompt_ids`)."""
        self._synthetic = 0
        self._branch = 0
        self._last: Sampled | None = None
        self._calls = _Calls(request, policy)
        self._render_s = 0.0
        """Seconds the render or bridge of the next turn's prompt took."""
        self.forked = False
        self.slot_s = 0.0

    async def open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        request = self._request
        self._tools = tools
        started = clock()
        self._renderer = await RendererSession.open(
            self._pools.renderer_pool(), request.client.model, request.renderer, timeout=self._budget()
        )
        self.slot_s, started = since(started), clock()
        self._prompt = await self._renderer.start(messages, tools, timeout=self._budget())
        self._render_s = since(started)
        self._added = list(self._prompt)  # `_prompt` grows in place from here on

    async def sample(self, messages: list[dict[str, Any]]) -> tuple[Turn, dict[str, Any]]:
        assert self._renderer is not None
        started = clock()
        sampled, version, changes = await self._sample_resuming()
        model_s, started = since(started), clock()
        parsed = await self._renderer.parse(sampled.completion_ids, self._tools, timeout=self._budget())
        timings = TurnTimings(
            render_s=self._render_s,
            model_s=model_s,
            queue_s=round(sampled.queue_s, 4),
            parse_s=since(started),
        )
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
            policy_version=version,
            version_changes=changes,
            timings=timings,
        )
        return turn, {**parsed.message, RAW_TEXT_KEY: parsed.text}

    async def _sample_resuming(self) -> tuple[Sampled, int, list[VersionChange]]:
        """One turn. If the plane itself paused the servers in abort mode mid-turn, the turn resumes from
        the tokens already sampled (prompt + those tokens, the rest of `max_tokens`) once they resumed,
        and records where the version changed; an abort nobody here asked for raises `TurnAborted`."""
        assert self._renderer is not None
        request, head = self._request, None
        version, changes = 0, []
        for resume in range(MAX_RESUMES + 1):
            epoch = self._policy.pause_epoch()
            done = head.completion_ids if head is not None else []
            sampling = request.sampling
            if done:  # a resumed turn samples the rest of its `max_tokens` after what it has
                sampling = sampling.model_copy(update={"max_tokens": sampling.max_tokens - len(done)})
            await self._calls.unpaused(self._budget())
            tags, sent_under = self._calls.next(resume)
            try:
                part = await complete_tokens(
                    self._client,
                    request.client.model,
                    self._prompt + done if done else self._prompt,
                    sampling,
                    timeout_s=request.client.total_call_timeout_s,
                    vocab_size=self._renderer.vocab_size,
                    stop_token_ids=self._renderer.stop_token_ids,
                    tags=tags,
                    prompt_json=self._prompt_json,
                )
                aborted = False
            except TurnAborted as exc:
                if exc.sampled is None or not await self._policy.planned_resume(epoch, self._budget()):
                    raise
                part, aborted = exc.sampled, True
            part_version, part_changes = turn_versions(part, sent_under)
            if head is None:
                head, version, changes = part, part_version, part_changes
            else:
                offset = len(head.completion_ids)
                if part_version != (changes[-1].version if changes else version):
                    changes.append(VersionChange(at=offset, version=part_version))
                changes += [VersionChange(at=c.at + offset, version=c.version) for c in part_changes]
                head = Sampled(
                    head.completion_ids + part.completion_ids,
                    head.logprobs + part.logprobs,
                    part.finish_reason,
                    head.prompt_ids,
                    queue_s=head.queue_s + part.queue_s,
                )
            if not aborted:
                return head, version, changes
            if len(head.completion_ids) >= request.sampling.max_tokens:
                head.finish_reason = "length"
                return head, version, changes
        raise TurnAborted("abort", head.completion_ids if head else [], head)

    async def advance(self, new_messages: list[dict[str, Any]]) -> None:
        assert self._renderer is not None and self._last is not None
        completion = self._last.completion_ids
        started = clock()
        step = await self._renderer.bridge(
            completion, self._last.finish_reason, new_messages, self._tools, timeout=self._budget()
        )
        self._render_s = since(started)
        # What the turn added, never the whole prompt: a long trajectory costs the same per turn at turn
        # 64 as at turn 1, apart from the prompt the server is sent.
        self._added = step.added_ids
        if step.forked:  # a new branch starts from a full re-render: nothing synthetic in it
            self._prompt, self._synthetic = list(step.added_ids), 0
            self.forked = True
        else:  # the next prompt is this prompt + completion + what the bridge appended
            self._prompt.extend(completion)
            self._prompt.extend(step.added_ids)
            self._synthetic = step.synthetic_ids
        self._branch = step.branch

    async def restart(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Start a new branch from a full render of `messages` (agent mode: the agent rewrote history or
        changed its tools). Explicit and marked (`forked`); the old branch keeps what was sampled."""
        assert self._renderer is not None
        self._tools = tools
        self._prompt = await self._renderer.start(messages, tools, timeout=self._budget())
        self._added, self._synthetic, self._last = list(self._prompt), 0, None
        self._branch += 1
        self.forked = True

    async def close(self) -> None:
        if self._renderer is not None:
            await self._renderer.close()


class ChatTurns:
    def __init__(self, request: RolloutRequest, client: openai.AsyncOpenAI, policy: Any):
        self._request = request
        self._client = client
        self._calls = _Calls(request, policy)
        self._tools: list[dict[str, Any]] | None = None
        self._seen: list[int] | None = None
        """The previous turn's prompt + completion: what the next prompt should extend."""
        self._branch = 0
        self._vocab_size: int | None = None
        self.forked = False
        self.slot_s = 0.0

    async def open(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        self._tools = tools
        # The ids the server samples are checked against the model's vocabulary exactly as in token mode
        # (an id outside it is `MalformedResponse`, never recorded as sampled): its size from local files,
        # once per process (never from the hub: unknown, the bound is the int32 range).
        name = self._request.renderer.tokenizer or self._request.client.model
        known, self._vocab_size = known_vocab_size(name)
        if not known:
            self._vocab_size = await asyncio.to_thread(load_vocab_size, name)

    async def sample(self, messages: list[dict[str, Any]]) -> tuple[Turn, dict[str, Any]]:
        request = self._request
        started = clock()
        await self._calls.unpaused(request.client.total_call_timeout_s)
        tags, sent_under = self._calls.next()
        sampled = await complete_chat(
            self._client,
            request.client.model,
            messages,
            self._tools,
            request.sampling,
            timeout_s=request.client.total_call_timeout_s,
            vocab_size=self._vocab_size,
            tags=tags,
        )
        model_s = since(started)  # the server renders and parses: the whole turn is its call
        version, changes = turn_versions(sampled, sent_under)
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
            reasoning=message.get("reasoning"),
            tool_calls=[ToolCall(**view) for view in tool_call_views(message)],
            policy_version=version,
            version_changes=changes,
            timings=TurnTimings(model_s=model_s, queue_s=round(sampled.queue_s, 4)),
        )
        return turn, {**message, RAW_TEXT_KEY: message.get("content") or ""}

    async def advance(self, new_messages: list[dict[str, Any]]) -> None:
        pass  # the loop keeps the messages; the server renders them

    async def close(self) -> None:
        pass
