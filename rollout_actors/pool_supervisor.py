"""`SupervisedPool`: one pool actor the plane holds one of, kept serving by the plane.

    pool = SupervisedPool("env pool math", "p/env-pool/ab12", start=start_incarnation,
                          stop=stop_incarnation, settings=PoolSupervision())
    handle = await pool.start()                 # the first incarnation; its startup failure is raised
    name = await pool.serving(timeout=60)       # the serving incarnation, waiting for a restart
    ...
    await pool.close()

The plane is the root of the supervision tree; each pool actor (the renderer pool, one env pool per
environment) is the root of a subtree: the renderers or env servers it started are owned by it, so Ray
ends them with it. A `SupervisedPool` probes its actor (`health`) on the driver's loop. When Ray says it
died, or nothing showed it alive for `hang_timeout_s` (`Liveness`: the same rule every supervisor uses),
what is left of it is killed and a new incarnation, a named actor of its own (`<name>@<n>`, so a
replacement never waits for Ray to free the old name), is started within the pool's restart budget
(`RestartBudget`, the same kit). A start that fails spends a restart too; with the budget spent the pool
is `failed` and every request that needs it is answered at once, until the window has room again (the
next request that needs it then starts it anew).

Nothing of a dead incarnation is adopted: its sessions and leases ended with its subtree, and the rollouts
that held them are re-dispatched under their lease (contract 5). The new incarnation is built from what
the plane declared (the environment `Ref`, the pool configs), which is all that survives a pool. Each
dispatch names the serving incarnation (`PoolName`), so a worker looks a replacement up on its first
dispatch and never uses a lost one (`pool_lookup.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

import ray
from pydantic import BaseModel

from rollout_actors.config import PoolSupervision
from rollout_actors.kernel import Failure
from rollout_actors.kernel.faults import ray_loss
from rollout_actors.kernel.supervision import Liveness, LossCause, RestartBudget
from rollout_actors.pool_lookup import PoolName

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 2.0  # one health call of a check asked for by a re-dispatch; then it asks again

PoolState = Literal["starting", "serving", "restarting", "failed", "closed"]


class PoolUnavailable(Exception):
    """A pool a request needs is not serving: its restart budget is spent, its restart failed, or no
    incarnation was back within the time the request could wait. `infrastructure`."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


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


class SupervisedPool:
    """Supervisor of one pool actor: probes it, restarts it within its budget, hands out its handle."""

    def __init__(
        self,
        what: str,
        name: str,
        start: Callable[[str], Awaitable[Any]],
        stop: Callable[[Any], Awaitable[Any]],
        settings: PoolSupervision,
    ) -> None:
        """`start(actor_name)` creates one incarnation under that name, waits until it is ready and returns
        its handle (or raises); `stop(handle)` shuts one down and kills it, never raising."""
        self.what, self.name = what, name
        self._start, self._stop = start, stop
        self._settings = settings
        self._budget = RestartBudget(settings.restart)
        self.state: PoolState = "starting"
        self.incarnation = 0
        self._handle: Any = None
        self._current: asyncio.Future[PoolName] = asyncio.get_running_loop().create_future()
        """Resolved with the serving incarnation's name; replaced while a restart is in progress;
        failed with `PoolUnavailable` when the pool is given up."""
        self._current.add_done_callback(_retrieve)
        self._verifying: asyncio.Task[None] | None = None
        self._served = False
        """An incarnation served once: a later failure is a loss to restart, not a startup failure."""
        self._lost_at = 0.0
        self.last_loss: str | None = None
        self.recovered_in_s: float | None = None
        self.serving_since: float | None = None
        """`time.monotonic()` when the serving incarnation began serving."""
        self._tasks: set[asyncio.Task[Any]] = set()
        """Probe loops, restarts, stops and checks: owned here, cancelled in `close`."""

    # ------------------------------------------------------------------------------------- public

    async def start(self) -> Any:
        """Start the first incarnation. A failure here is the environment's or the config's, not a loss:
        it is raised as it is (with its traceback) and nothing is restarted."""
        try:
            handle = await self._start_incarnation()
        except BaseException as exc:
            self.state = "failed"
            if isinstance(exc, Exception):
                self._current.set_exception(exc)
            else:
                self._current.cancel()
            raise
        self._serve(handle)
        return handle

    async def serving(self, timeout: float, verify: bool = False) -> PoolName:
        """The serving incarnation; while one is being restarted, wait for it up to `timeout`.
        `verify`: the caller saw a part of ours lost (a re-dispatch): wait until the actor answers, or
        its loss is decided and a replacement serves, so a re-dispatch never goes to a pool that is
        already gone (one check shared by every caller)."""
        deadline = time.monotonic() + timeout
        if self.state == "failed" and self._served and self._budget.remaining() > 0:
            self._restart_now("the restart window has room again")
        if not verify and holds_value(self._current):  # the common case: no task, no shield per dispatch
            return self._current.result()
        try:
            if verify and self.state == "serving":
                if self._verifying is None or self._verifying.done():
                    self._verifying = self._own(self._verify(self._handle))
                await asyncio.wait_for(asyncio.shield(self._verifying), timeout)
            return await asyncio.wait_for(
                asyncio.shield(self._current), max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            failure = Failure(
                type="PoolUnavailable",
                message=f"{self.what} was not serving within {timeout:g} s ({self.state}; last loss: "
                f"{self.last_loss})",
            )
            raise PoolUnavailable(failure) from None

    def current(self) -> Any:
        """The serving incarnation's handle, or None while there is none."""
        return self._handle if self.state == "serving" else None

    def status(self) -> PoolStatus:
        return PoolStatus(
            pool=self.what,
            state=self.state,
            incarnation=self.incarnation,
            restarts=self._budget.spent_total,
            restarts_left=self._budget.remaining(),
            last_loss=self.last_loss,
            recovered_in_s=self.recovered_in_s,
        )

    async def close(self) -> None:
        """Stop supervising, then stop the serving incarnation. Whoever waits for it is answered at once."""
        self.state = "closed"
        if not self._current.done():
            closed = Failure(type="PoolUnavailable", message=f"{self.what} is shut down (the plane closed)")
            self._current.set_exception(PoolUnavailable(closed))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        handle, self._handle = self._handle, None
        if handle is not None:
            await self._stop(handle)

    # ---------------------------------------------------------------------------------- liveness

    def _serve(self, handle: Any) -> None:
        self._handle = handle
        self.state = "serving"
        self._served = True
        self.serving_since = time.monotonic()
        if self._current.done():
            self._current = asyncio.get_running_loop().create_future()
            self._current.add_done_callback(_retrieve)
        self._current.set_result(PoolName(self.name, self.incarnation))
        if self._lost_at:
            self.recovered_in_s = time.monotonic() - self._lost_at
            log.warning(
                "%s serving again (incarnation %d) %.1f s after its loss",
                self.what,
                self.incarnation,
                self.recovered_in_s,
            )
        self._own(self._probe(handle))

    async def _probe(self, handle: Any) -> None:
        """Ask one incarnation for `health` every `probe_interval_s` until it is lost."""
        settings = self._settings
        life = Liveness(settings.hang_timeout_s)
        expected = time.monotonic()
        while self._handle is handle and self.state == "serving":
            sent = time.monotonic()
            if sent - expected > settings.probe_interval_s:  # the plane's own loop stalled: not silence
                life.excuse(sent - expected)
            try:
                health = await asyncio.wait_for(handle.health.remote(), settings.hang_timeout_s)
                life.heard(health.loop_stall_s)
            except Exception as exc:
                if ray_loss(exc) == "died":
                    self._lost(handle, "died", _death_detail(exc))
                    return
                # No answer in time, or unreachable for now (its node may be going, which the GCS
                # decides within its health checks): silence, judged below.
            if life.wedged():
                self._lost(handle, "wedged", life.verdict())
                return
            expected = time.monotonic() + max(0.0, settings.probe_interval_s - (time.monotonic() - sent))
            await asyncio.sleep(max(0.0, expected - time.monotonic()))

    async def _verify(self, handle: Any) -> None:
        """Until `handle` answers (alive) or is lost: dead now, or judged by the probe (a pool in doubt,
        unreachable or slow, holds re-dispatches back rather than have them spent on it)."""
        while self._handle is handle and self.state == "serving":
            sent = time.monotonic()
            try:
                await asyncio.wait_for(handle.health.remote(), VERIFY_TIMEOUT_S)
                return
            except Exception as exc:
                if ray_loss(exc) == "died":
                    self._lost(handle, "died", _death_detail(exc))
                    return
                # Unreachable or slow: not dead yet; ask again while the probe judges.
                await asyncio.sleep(max(0.0, self._settings.probe_interval_s - (time.monotonic() - sent)))

    # ---------------------------------------------------------------------------------- restarts

    def _lost(self, handle: Any, cause: LossCause, detail: str) -> None:
        """The one place a pool's loss is decided: out of service at once, the rest killed, restarted."""
        if handle is not self._handle or self.state != "serving":
            return  # an older incarnation, or already being dealt with
        self._lost_at = time.monotonic()
        self.last_loss = f"{cause}: {detail}"
        log.error("%s (incarnation %d) lost: %s", self.what, self.incarnation, self.last_loss)
        self._handle = None
        try:
            # Dead or wedged, what is left of it is killed: its renderers / env servers are owned by it
            # and Ray ends them with it, so nothing of the lost subtree keeps serving (or holding CPUs).
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass
        self._restart_now(self.last_loss)

    def _restart_now(self, why: str) -> None:
        self.state = "restarting"
        if self._current.done():
            self._current = asyncio.get_running_loop().create_future()
            self._current.add_done_callback(_retrieve)
        self._own(self._restart(why))

    async def _restart(self, why: str) -> None:
        """New incarnations until one serves or the budget is spent; every attempt spends a restart."""
        while self.state == "restarting":
            if not self._budget.try_spend():
                self.state = "failed"
                message = f"{self.what} is not restarted: {self._budget.spent_message()}; last loss: {why}"
                log.error("%s", message)
                self._current.set_exception(PoolUnavailable(Failure(type="PoolUnavailable", message=message)))
                return
            try:
                handle = await self._start_incarnation()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                why = f"restart {self.incarnation} failed: {type(exc).__name__}: {exc}"
                self.last_loss = why
                log.error("%s: %s", self.what, why)
                continue
            if self.state != "restarting":  # closed meanwhile
                self._own(self._stop(handle))
                return
            self._serve(handle)

    async def _start_incarnation(self) -> Any:
        self.incarnation += 1
        return await self._start(PoolName(self.name, self.incarnation).actor_name)

    def _own(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _death_detail(exc: BaseException) -> str:
    """Ray's own words for why the actor ended, without its generic advice."""
    text = str(exc)
    start = text.find("The actor is dead because")
    text = text[start:] if start >= 0 else f"{type(exc).__name__}: {text}"
    end = text.find(" Some common causes")
    return " ".join((text[:end] if end >= 0 else text).split())[:500]


def _retrieve(future: asyncio.Future[Any]) -> None:
    """A pool that failed with nobody waiting must not log 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()


def holds_value(future: asyncio.Future[Any]) -> bool:
    """`future` already holds a value (not pending, cancelled or failed)."""
    return future.done() and not future.cancelled() and future.exception() is None
