"""The single-process baselines of `bench_plane.py`: the same rollout, in one asyncio loop, no Ray.

Same renderer code (`renderer_actors` `Renderer`, built once and called inline, as the renderer actor
does), same environment class (instantiated here, called directly), same model call
(`rollout_actors.rollout.model_call.complete_tokens`: `/v1/completions` with token ids and `return_token_ids`),
same token-mode logic as `rollout_actors.rollout.loop`: render the first prompt, then per turn sample, parse,
step the env, and bridge the env's answer onto prompt + completion. Nothing is slowed down: no remote hop,
no validation the loop does not need.

- `per_rollout_client=True`  is way (b): one `build_client` per rollout, closed when it ends.
- `per_rollout_client=False` is way (c): one client shared by every rollout (what most peers do), with a
  connection limit of at least the concurrency.

Timing per model call: from the rollout asking for a turn (before its render or bridge) to having the
completion, i.e. renders included; recorded with the rollout's start order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from renderer_actors.calls import BridgeRequest, History
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.kernel import RefResolver
from rollout_actors.rollout.client import build_client
from rollout_actors.rollout.model_call import PromptJson, complete_tokens
from rollout_actors.wire import ClientConfig, RendererConfig, SamplingConfig


@dataclass
class RolloutTiming:
    order: int
    """Start order (0 = first rollout started)."""
    started: float
    finished: float
    calls: list[float] = field(default_factory=list)
    """Seconds per model call, renders included."""
    ok: bool = True
    error: str = ""


@dataclass
class SingleProcessWorkload:
    """What every rollout of a wave runs. Built once per process (renderer and env loaded up front)."""

    client: ClientConfig
    sampling: SamplingConfig
    env_target: str
    env_config: dict[str, Any]
    max_turns: int
    renderer: Renderer | None = None
    env: Any = None

    async def load(self) -> None:
        key = RendererKey.from_config(self.client.model, RendererConfig())
        self.renderer = await asyncio.to_thread(Renderer.load, key)
        self.env = RefResolver(("env_actors.",)).load(self.env_target)(**self.env_config)
        await self.env.load()


SANDBOX_ENV = "env_actors.examples.sandbox_env:SandboxEnv"
"""The bundled env whose steps wait `step_wait_s`: the long-wait workload's environment."""


@contextlib.asynccontextmanager
async def long_wait_workload(
    latency_s: float, turns: int, step_wait_s: float, max_tokens: int, ready_timeout_s: float = 600.0
) -> AsyncIterator[tuple[StandinServer, SingleProcessWorkload]]:
    """A fresh stand-in answering every call after `latency_s`, and the loaded workload of `turns`-turn
    sandbox rollouts against it whose env steps wait `step_wait_s`; the stand-in stops on exit."""
    server = StandinServer(
        standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL), latency_s=latency_s),
        ready_timeout_s=ready_timeout_s,
    ).start()
    try:
        workload = SingleProcessWorkload(
            client=ClientConfig(base_url=server.base_url, model=BUNDLED_MODEL),
            sampling=SamplingConfig(max_tokens=max_tokens),
            env_target=SANDBOX_ENV,
            env_config={"num_tasks": 64, "turns": turns, "step_wait_s": step_wait_s},
            max_turns=turns + 1,
        )
        await workload.load()
        yield server, workload
    finally:
        server.close()


async def run_wave(
    workload: SingleProcessWorkload, concurrency: int, per_rollout_client: bool
) -> tuple[float, list[RolloutTiming]]:
    """`concurrency` rollouts started at once; returns (wall seconds, one timing per rollout)."""
    shared = None
    if not per_rollout_client:
        limit = max(workload.client.max_connections, concurrency)
        shared = build_client(workload.client.model_copy(update={"max_connections": limit}))
    started = time.monotonic()
    try:
        timings = await asyncio.gather(
            *(_rollout(workload, i, shared) for i in range(concurrency)), return_exceptions=False
        )
    finally:
        if shared is not None:
            await shared.close()
    return time.monotonic() - started, list(timings)


async def _rollout(workload: SingleProcessWorkload, order: int, shared: Any) -> RolloutTiming:
    timing = RolloutTiming(order=order, started=time.monotonic(), finished=0.0)
    client = shared or build_client(workload.client, session_id=f"bench-{order}")
    env, renderer = workload.env, workload.renderer
    assert renderer is not None
    state = None
    try:
        reset = await env.reset(env.task(order % env.num_tasks()))
        state = reset.state
        tools = reset.tools or None
        messages = list(reset.messages)
        asked = time.monotonic()
        start = renderer.start(messages, tools)
        prompt = list(start.prompt_ids)
        tail = list(prompt)
        history_roles: set[str | None] = set()
        prompt_json = PromptJson()  # as the rollout worker's `TokenTurns`: a turn encodes what it added
        for _ in range(workload.max_turns):
            sampled = await complete_tokens(
                client,
                workload.client.model,
                prompt,
                workload.sampling,
                timeout_s=workload.client.total_call_timeout_s,
                prompt_json=prompt_json,
            )
            timing.calls.append(time.monotonic() - asked)
            parsed = renderer.parse(sampled.completion_ids, tools, tail)
            step = await env.step(state, parsed.message)
            if step.done:
                break
            asked = time.monotonic()
            request = BridgeRequest(
                completion_ids=sampled.completion_ids,
                finish_reason=sampled.finish_reason,
                new_messages=step.messages,
                tools=tools,
                prompt_tail=tail,
                assistant_message=parsed.message,
            )
            roles = {m.get("role") for m in step.messages}
            if history_roles & roles:  # as the plane's session: sent up front where a bridge needed it
                request.history = History(messages=messages, prompt_ids=prompt)
            reply = renderer.bridge(request)
            if reply.needs_history:
                history_roles.update(roles)
                request.history = History(messages=messages, prompt_ids=prompt)
                reply = renderer.bridge(request)
            if reply.forked:
                prompt = list(reply.prompt_ids or [])
                tail = list(prompt)
            else:  # extended in place, as the rollout worker's session does: a turn costs what it adds
                prompt.extend(sampled.completion_ids)
                prompt.extend(reply.appended_ids)
                tail = list(reply.appended_ids)
            messages.append(reply.assistant_message)
            messages.extend(step.messages)
        await env.score(state)
    except Exception as exc:  # a failed rollout is counted, not fatal: the table says how many
        timing.ok, timing.error = False, f"{type(exc).__name__}: {exc}"
    finally:
        if state is not None:
            await env.close(state)
        if shared is None:
            await client.close()
        timing.finished = time.monotonic()
    return timing
