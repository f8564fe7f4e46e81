"""A whole episode run on an `EnvServer` and streamed back frame by frame (`EnvServer.serve_run`).

    stream = server.serve_run.remote(session_id, payload, timeout_s)   # a Ray streaming generator
    async for ref in stream:          # each awaited under a deadline by the caller (`serve_env/runs.py`)
        kind, frame = await ref       # ("delta", bytes)* then one ("reply", bytes)

For environments that run a whole episode themselves and say what it produced as it goes
(`adapters.verifiers_serve`: verifiers' own delta frames). The episode runs on the server's env loop like
every env call (`env_loop.py`), under the server's `_guard` (its deadline, its busy count, its failure
classification), registered as the session's call, so the pool's `end_session` stops it as it stops a
step. Frames cross from the env loop to Ray's loop through a queue; Ray ships each as it is yielded.

The generator ends with exactly one `reply` frame, or with a `failed` frame carrying the `Failure` (as a
dict) when the episode never produced a reply: the environment raised past its own handling, missed its
deadline, or the server is not serving this kind of environment. It never raises; if the caller stops
reading (cancel), Ray cancels it and the episode is cancelled with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from env_actors.env_calls import CALL
from env_actors.failures import EnvSessionClosed, UnexplainedEnvFailure
from env_actors.interface import Environment, EnvResponse, Message, Reset, ScoreOut, StepOut
from rollout_actors.kernel import CallerError

Frame = tuple[str, Any]
"""`("delta", bytes)`, `("reply", bytes)` or `("failed", Failure dict)`."""


async def stream_episode(
    run: Callable[[Callable[[bytes], None]], Awaitable[EnvResponse]], session_id: str
) -> AsyncIterator[Frame]:
    """The frames of one episode: `run(send)` runs it (the server's guarded call) and hands each delta to
    `send` as verifiers produces it, from the environment's own loop."""
    loop = asyncio.get_running_loop()
    frames: asyncio.Queue[bytes] = asyncio.Queue()

    def send(frame: bytes) -> None:  # called on the environment's own loop (another thread)
        loop.call_soon_threadsafe(frames.put_nowait, frame)

    work = asyncio.ensure_future(run(send))
    try:
        while True:
            getting = asyncio.ensure_future(frames.get())
            await asyncio.wait({getting, work}, return_when=asyncio.FIRST_COMPLETED)
            if getting.done():
                yield ("delta", getting.result())
                continue
            getting.cancel()
            while not frames.empty():  # sent before the episode returned: they come first
                yield ("delta", frames.get_nowait())
            if work.cancelled():  # the pool ended the session (a cancel, a lost caller): nobody reads on
                yield (
                    "failed",
                    EnvSessionClosed(f"{session_id} was ended").failure.model_dump(),
                )
                return
            response = work.result()
            if response.success:
                yield ("reply", response.value)
            else:
                yield (
                    "failed",
                    (response.error or UnexplainedEnvFailure("no reply").failure).model_dump(),
                )
            return
    finally:
        if not work.done():
            work.cancel()


def serving_env(env: Any) -> Callable[[bytes, Callable[[bytes], None]], Awaitable[bytes]]:
    """The loaded environment's `serve_run`, its call tagged as a whole episode (`env_calls`: blocking its
    framework loop counts from the first second, not past the episode's deadline); or a `CallerError`: this
    pool serves step-wise environments."""
    serve = getattr(env, "serve_run", None)
    if not callable(serve):
        raise CallerError(f"{type(env).__name__} does not run whole episodes (it has no serve_run)")

    async def episode(payload: bytes, send: Callable[[bytes], None]) -> bytes:
        tag = CALL.get()  # set by the server's `_guard` for this call, in this task's context
        token = CALL.set(replace(tag, whole_episode=True)) if tag is not None else None
        try:
            return await serve(payload, send)
        finally:
            if token is not None:
                CALL.reset(token)

    return episode


class EpisodeOnlyEnvironment(Environment):
    """An environment that runs whole episodes only (`serve_run`): the client ships each run's task, and
    the plane's step-wise calls are refused as the caller's error."""

    def num_tasks(self) -> int:
        return 0  # the client owns the tasks and ships each with its run

    def task(self, index: int) -> dict[str, Any]:
        raise CallerError(self._episodes_only())

    async def reset(self, task: dict[str, Any]) -> Reset:
        raise CallerError(self._episodes_only())

    async def step(self, state: Any, assistant_message: Message) -> StepOut:
        raise CallerError(self._episodes_only())

    async def score(self, state: Any) -> ScoreOut:
        raise CallerError(self._episodes_only())

    def _episodes_only(self) -> str:
        return f"{type(self).__name__} runs whole episodes only (serve_run, for `rollouts serve-env`)"
