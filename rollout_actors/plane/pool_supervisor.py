"""`SupervisedPool`: one pool actor the plane holds one of, kept serving by the plane.

    pool = SupervisedPool("env pool math", "p/env-pool/ab12", start=start_incarnation,
                          settings=PoolSupervision())
    handle = await pool.start()                 # the first incarnation; its startup failure is raised
    name = await pool.serving(timeout=60)       # the serving incarnation, waiting for a restart
    ...
    await pool.close()

The plane is the root of the supervision tree; each pool actor (the renderer pool, one env pool per
environment) is the root of a subtree: the renderers or env servers it started are owned by it, so Ray
ends them with it. A `SupervisedPool` is a kind composed into the kernel's `Supervisor` (a child spec:
one incarnation at a time, closed gracefully only at shutdown), on the driver's loop. When Ray says the
pool actor died, or nothing showed it alive for `hang_timeout_s`, what is left of it is killed and a new
incarnation, a named actor of its own (`<name>@<n>`, so a replacement never waits for Ray to free the
old name), is started within the pool's restart budget. A start that fails
spends a restart too; with the budget spent the pool is `failed` and every request that needs it is
answered at once, until the window has room again (then one is started: the kernel keeps a floor of one).

Nothing of a dead incarnation is adopted (docs/operations.md: what survives a pool's loss); each
dispatch names the serving incarnation (`PoolName`), so a worker never uses a lost one (`pool_lookup.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from rollout_actors.kernel.faults import Unavailable
from rollout_actors.kernel.supervision import Supervision
from rollout_actors.kernel.supervisor import Child, ChildKind, ChildSpec, RetireCause, Supervisor
from rollout_actors.plane.config import PoolSupervision
from rollout_actors.rollout.pool_lookup import PoolName

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 2.0  # one health call of a check asked for by a re-dispatch; then it asks again
START_TIMEOUT_S = 3600.0  # a backstop only: `start` applies the pool's own readiness deadlines

PoolState = Literal["starting", "serving", "restarting", "failed", "closed"]


class PoolUnavailable(Unavailable):
    """A pool a request needs is not serving: its restart budget is spent, its restart failed, or no
    incarnation was back within the time the request could wait. `infrastructure`."""


class PoolStatus(BaseModel):
    """What the plane reports of one supervised pool (`RolloutPlane.stats().pools`)."""

    pool: str
    state: PoolState
    incarnation: int
    """1 for the first actor; each restart adds one."""
    restarts: int
    restarts_left: int
    last_loss: str | None = None
    """Why the last incarnation was lost (died / wedged, with Ray's words), or why a restart failed."""
    recovered_in_s: float | None = None
    """Seconds from the last loss to its replacement serving."""


@dataclass(eq=False)
class _Incarnation(Child):
    number: int = 0


class SupervisedPool(ChildKind[_Incarnation]):
    """Supervisor of one pool actor: the kernel's, with one child at a time, restarted by incarnation."""

    def __init__(
        self,
        what: str,
        name: str,
        start: Callable[[str], Awaitable[Any]],
        settings: PoolSupervision,
    ) -> None:
        """`start(actor_name)` creates one incarnation under that name, waits until it is ready and returns
        its handle (or raises); at shutdown the serving one is asked to `close` (then killed)."""
        self.what, self.pool = what, name
        self._start = start
        self._serving: _Incarnation | None = None
        self._start_failure: BaseException | None = None
        self._verifying: asyncio.Task[None] | None = None
        self._lost_at = 0.0
        self.recovered_in_s: float | None = None
        self.serving_since: float | None = None
        """`time.monotonic()` when the serving incarnation began serving."""
        supervision = Supervision.read(settings, ready_timeout_s=START_TIMEOUT_S)
        # Dead or wedged, what is left of an incarnation is killed at once: its renderers / env servers are
        # owned by it and Ray ends them with it, so nothing of the lost subtree keeps serving (or holding
        # CPUs). At close, the serving one is closed gracefully first (its `close` stops its children).
        spec = ChildSpec(
            kind="pool",
            name=lambda n: PoolName(name, n + 1).actor_name,
            record=_Incarnation,
            stop="close",
            stop_only_at_close=True,
        )
        self.supervisor = Supervisor(what, spec, supervision, self)
        self.supervisor.floor = 1  # a lost incarnation is replaced at once; a failed start, on the next tick

    # ------------------------------------------------------------------------------------- public

    async def start(self) -> Any:
        """Start the first incarnation. A failure here is the environment's or the config's, not a loss:
        it is raised as it is (with its traceback) and nothing is restarted."""
        try:
            (child,) = await self.supervisor.start()
        except BaseException as exc:  # the kernel closed the supervisor: nothing is left running
            self._start_failure = exc
            raise
        return child.handle

    async def serving(self, timeout: float, verify: bool = False) -> PoolName:
        """The serving incarnation; while one is being restarted, wait for it up to `timeout`.
        `verify`: the caller saw a part of ours lost (a re-dispatch): wait until the actor answers, or
        its loss is decided and a replacement serves, so a re-dispatch never goes to a pool that is
        already gone (one check shared by every caller)."""
        deadline = time.monotonic() + timeout
        if not self.supervisor.children:  # a restart failed or was refused: try now, not at the tick
            self.supervisor.spawn("restart")
        serving = self._serving
        if verify and serving is not None:
            if self._verifying is None or self._verifying.done():
                # A pool in doubt (unreachable or slow) holds re-dispatches back rather than have them
                # spent on it, until it answers or its loss is decided.
                confirm = self.supervisor.confirm(serving, VERIFY_TIMEOUT_S)
                self._verifying = self.supervisor.tasks.own(confirm, "verify")
            try:
                await asyncio.wait_for(asyncio.shield(self._verifying), timeout)
            except TimeoutError:
                raise self._unavailable(timeout) from None
            serving = self._serving
        if serving is None:  # the common case never waits: no task, no timer per dispatch
            serving = await self.supervisor.wait_for(lambda: self._serving, deadline - time.monotonic())
        if serving is None:
            raise self._unavailable(timeout)
        return PoolName(self.pool, serving.number)

    @property
    def state(self) -> PoolState:
        if self._start_failure is not None:
            return "failed"
        if self.closed:
            return "closed"
        if self.supervisor.starved:
            return "failed"  # its restart budget is spent: requests that need it are answered at once
        if self._serving is not None:
            return "serving"
        return "restarting" if self._lost_at else "starting"

    @property
    def closed(self) -> bool:
        return self.supervisor.closed

    async def close(self) -> None:
        await self.supervisor.close()

    def current(self) -> Any:
        """The serving incarnation's handle, or None while there is none."""
        return self._serving.handle if self._serving is not None else None

    def status(self) -> PoolStatus:
        return PoolStatus(
            pool=self.what,
            state=self.state,
            incarnation=self.incarnation,
            restarts=self.supervisor.budget.spent_total,
            restarts_left=self.supervisor.budget.remaining(),
            last_loss=self.supervisor.last_loss,
            recovered_in_s=self.recovered_in_s,
        )

    # ------------------------------------------------------------------------- the kind's hooks

    @property
    def incarnation(self) -> int:
        """The number of the newest incarnation (0 before the first)."""
        return self.supervisor.spawns

    def on_created(self, child: _Incarnation) -> None:
        child.number = self.supervisor.spawns

    async def handshake(self, child: _Incarnation) -> None:
        child.handle = await self._start(child.name)

    def on_ready(self, child: _Incarnation) -> None:
        self._serving = child
        self.serving_since = time.monotonic()
        if self._lost_at:
            self.recovered_in_s = time.monotonic() - self._lost_at
            log.warning(
                "%s serving again (incarnation %d) %.1f s after its loss",
                self.what,
                child.number,
                self.recovered_in_s,
            )

    def on_retired(self, child: _Incarnation, reason: str, cause: RetireCause) -> None:
        if child is self._serving:
            self._serving = None
            if cause != "shutdown":  # its replacement is spawned by the kernel, on the budget
                self._lost_at = time.monotonic()
                log.error("%s (incarnation %d) lost: %s", self.what, child.number, reason)
        elif self._lost_at and cause != "shutdown":
            self.supervisor.last_loss = f"restart {child.number} failed: {reason}"
            log.error("%s: %s", self.what, self.supervisor.last_loss)

    def _unavailable(self, timeout: float) -> BaseException:
        if self._start_failure is not None:  # its first start failed: that failure, as it was raised
            return self._start_failure
        if self.closed:
            message = f"{self.what} is shut down (the plane closed)"
        elif self.state == "failed":
            message = str(self.supervisor.budget_spent(self.what))
        else:
            last = self.supervisor.last_loss
            message = f"{self.what} was not serving within {timeout:g} s ({self.state}; last loss: {last})"
        return PoolUnavailable(message)
