"""`HeldServeEnv`: an environment that runs whole episodes (`serve_run`, as `adapters.verifiers_serve`
does for `rollouts serve-env`), each one steered by its run's payload, for the serve-env fault tests.

    payload = msgpack.packb({"hold": "/tmp/hold-1", "deltas": 3, "gap_s": 30.0})

The episode waits (awaiting, never blocking) while the file `hold` exists, then sends `deltas` delta
frames `gap_s` apart, then replies. Every frame names the process that produced it (`pid`), so a client
can tell one episode's frames from another's: a run dispatched again after its env server was lost shows
up as frames of two processes. The hold is what lets a test kill the server of a run that has streamed
nothing yet; the gap, of a run that has.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import msgpack

from env_actors.episode_stream import EpisodeOnlyEnvironment

HOLD_POLL_S = 0.05


class HeldServeEnv(EpisodeOnlyEnvironment):
    async def serve_run(self, payload: bytes, send: Callable[[bytes], None]) -> bytes:
        run = msgpack.unpackb(payload, raw=False)
        hold = run.get("hold")
        while hold and Path(hold).exists():
            await asyncio.sleep(HOLD_POLL_S)
        for index in range(int(run.get("deltas", 1))):
            send(msgpack.packb({"index": index, "pid": os.getpid()}))
            await asyncio.sleep(float(run.get("gap_s", 0.0)))
        return msgpack.packb({"success": True, "error": None, "pid": os.getpid()})
