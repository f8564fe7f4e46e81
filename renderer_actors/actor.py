"""`RendererActor`: one renderer (tokenizer + a `renderers` library renderer for one `RendererKey`) as an
async Ray actor.

Created by `RendererPool`, never by hand. Construction is instant; the tokenizer loads on the first
`ready` (or first render call), in a thread so health calls keep answering, under a process-wide lock
because concurrent `from_pretrained` calls have corrupted tokenizers elsewhere. Ready means loaded and
answering (contract 8): `ready` returns only after the renderer is built, and a load failure is raised
to every caller of `ready`, with this side's traceback.

Render calls run inline on the event loop: each is short (linear in the turn) and CPU-bound, so a thread
hop would cost more than it saves. Calls carry no rollout state, so any renderer of the key can serve any
call, and a dead one loses nothing. Sessions send their calls batched (`call_many`, one Ray call for every
call a worker process asks of this renderer in one event-loop tick; see `batching.py`); each call in a
batch answers or fails on its own.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import ray

from renderer_actors.calls import BridgeReply, BridgeRequest, CallOutcome, Rendered, RendererInfo, StartReply
from renderer_actors.config import DEFAULT_RENDERER_PREFIXES
from renderer_actors.key import RendererKey
from renderer_actors.parse import ParsedCompletion
from renderer_actors.renderer import Renderer
from rollout_actors.kernel import Failure
from rollout_actors.kernel.collector import settle_actor
from rollout_actors.kernel.supervision import Health


class RendererHealth(Health):
    """A renderer's answer to `health()`."""

    renderer_id: str
    loaded: bool
    calls: int
    """Render calls answered so far."""


BATCHABLE = frozenset({"start", "bridge", "parse", "render"})
"""The methods `call_many` runs: the stateless render calls."""

_BUILD_LOCK = threading.Lock()
"""Serialises tokenizer builds in this process (one renderer per actor today; cheap insurance if not)."""


def _build_serialised(key: RendererKey, allowed_prefixes: tuple[str, ...]) -> Renderer:
    with _BUILD_LOCK:
        return Renderer.load(key, allowed_prefixes)


class RendererActor:
    """Serves render / bridge / parse for one key. Methods are coroutines: this is an async actor."""

    def __init__(
        self,
        key_json: str,
        renderer_id: str = "",
        allowed_ref_prefixes: tuple[str, ...] = DEFAULT_RENDERER_PREFIXES,
    ) -> None:
        self._key = RendererKey.from_json(key_json)
        self._allowed_ref_prefixes = tuple(allowed_ref_prefixes)
        self._key_json = key_json
        self._renderer_id = renderer_id
        self._renderer: Renderer | None = None
        self._info: RendererInfo | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._calls = 0

    async def ready(self) -> RendererInfo:
        """Load (once; concurrent callers share the load) and describe the renderer."""
        await self._loaded()
        assert self._info is not None
        return self._info

    async def health(self) -> RendererHealth:
        """Answers even while loading: liveness, not readiness."""
        return RendererHealth(
            renderer_id=self._renderer_id,
            loaded=self._renderer is not None,
            calls=self._calls,
            pid=os.getpid(),
        )

    async def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> StartReply:
        renderer = await self._loaded()
        self._calls += 1
        return renderer.start(messages, tools)

    async def bridge(self, request: BridgeRequest) -> BridgeReply:
        renderer = await self._loaded()
        self._calls += 1
        return renderer.bridge(request)

    async def parse(
        self,
        completion_ids: list[int],
        tools: list[dict[str, Any]] | None,
        prompt_tail: list[int] | None = None,
    ) -> ParsedCompletion:
        renderer = await self._loaded()
        self._calls += 1
        return renderer.parse(completion_ids, tools, prompt_tail)

    @ray.method(enable_task_events=False)  # per tick of every worker: see `RolloutWorker.run`
    async def call_many(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[CallOutcome]:
        """Run several render calls in order; each answers its value or its own failure. A `ValueError` is
        the request's fault (`rejected`); anything else is this renderer's, with its traceback."""
        renderer = await self._loaded()
        outcomes = []
        for method, args in calls:
            self._calls += 1
            try:
                if method not in BATCHABLE:
                    raise ValueError(f"{method!r} is not a render call")
                outcomes.append(CallOutcome(value=getattr(renderer, method)(*args)))
            except Exception as exc:
                rejected = isinstance(exc, ValueError)
                outcomes.append(CallOutcome(failure=Failure.from_exception(exc), rejected=rejected))
        return outcomes

    async def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> Rendered:
        renderer = await self._loaded()
        self._calls += 1
        return renderer.render(messages, tools, add_generation_prompt)

    async def _loaded(self) -> Renderer:
        if self._renderer is not None:
            return self._renderer
        if self._load_task is None:
            self._load_task = asyncio.get_running_loop().create_task(self._load())
        # Shielded: one caller's timeout must not cancel the load every other caller is waiting on.
        await asyncio.shield(self._load_task)
        assert self._renderer is not None
        return self._renderer

    async def _load(self) -> None:
        started = time.monotonic()
        renderer = await asyncio.to_thread(_build_serialised, self._key, self._allowed_ref_prefixes)
        self._info = RendererInfo(
            key=self._key_json,
            family=renderer.family,
            always_needs_history=renderer.always_needs_history,
            load_s=time.monotonic() - started,
            pid=os.getpid(),
            vocab_size=renderer.tokenizer.backend.get_vocab_size(with_added_tokens=True),
            stop_token_ids=sorted(renderer.stop_ids),
        )
        self._renderer = renderer
        settle_actor()  # the tokenizer is loaded: it lives as long as this process
