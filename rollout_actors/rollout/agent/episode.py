"""The agent-mode episode: what the rollout loop (`rollout.py`) runs instead of its own turns.

    register the rollout's route  ->  the env server runs the agent against it  ->  (rollout.py scores)
                                      each call the agent makes is a turn (`calls.py`)

It returns when the agent finished, or when the turn budget was spent (the agent is then stopped when the
rollout closes its env session, after scoring, whatever it made of its refused call). It raises when a turn failed (that failure is the
rollout's), when the agent failed (`EnvCallFailed`: the environment's fault, with the agent's output tail),
or when the agent finished without calling the model at all (misconfigured, nothing to train on). The
route is revoked on every exit path before the rollout's client and renderer session close, so a late call
is refused and no call in flight outlives the rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from env_actors.direct import EnvCallFailed
from env_actors.session import EnvSession
from rollout_actors.kernel.faults import EnvError
from rollout_actors.rollout.agent.calls import AgentCalls
from rollout_actors.rollout.agent.endpoint import endpoint_for_loop
from rollout_actors.rollout.turns import TokenTurns
from rollout_actors.wire import RolloutRequest, Turn

AGENT_MARGIN_S = 3.0
"""The agent call's deadline ends this long before the rollout's (at most half of what is left), so a
hung agent comes back as the environment's failure with its output tail, not as the rollout's bare
deadline (the agent itself stops 1 s before its call's deadline: `env_actors.agent.AGENT_GUARD_SLACK_S`)."""


class AgentMadeNoCalls(EnvError):
    """The agent program finished without calling the model once: the environment's fault (`env`)."""


async def run_agent_episode(
    request: RolloutRequest,
    env: EnvSession,
    turns: TokenTurns,
    recorded: list[Turn],
    messages: list[dict[str, Any]],
    seconds_left: Callable[[], float],
) -> None:
    """Serve the agent of `env`'s session until it is done; `seconds_left`: what remains of the rollout's
    deadline. Turns are appended to `recorded`, the conversation kept in `messages`."""
    calls = AgentCalls(request, turns, recorded, messages)
    grant = await endpoint_for_loop().register(calls)
    run: asyncio.Future[str] | None = None
    stop = asyncio.ensure_future(calls.stopped.wait())
    try:
        left = seconds_left()
        run = asyncio.ensure_future(
            env.run_agent(grant.wire(request.client.model), timeout=left - min(AGENT_MARGIN_S, left / 2))
        )
        await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
        if calls.failure is not None:
            raise calls.failure
        if calls.turns_spent:  # whatever the agent does about its refused call, the episode is over
            return
        if run.done():
            tail = run.result()  # an agent that failed raises here (`EnvCallFailed`, with its output tail)
            if not recorded and not calls.turns_spent:
                message = "the agent finished without calling the model"
                raise EnvCallFailed.of(
                    AgentMadeNoCalls(f"{message}; output tail:\n{tail}" if tail else message)
                )
    finally:
        stop.cancel()
        if run is not None and not run.done():
            run.cancel()  # the wait here; the agent itself stops with the session (`EnvSession.close`)
        elif run is not None and not run.cancelled():
            run.exception()  # retrieved: a turn's failure may have been the one raised
        await asyncio.shield(grant.revoke())
