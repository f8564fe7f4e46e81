"""`ServeEnvFront`: verifiers 0.4's env server, as prime-rl's orchestrator sees one, backed by the plane.

    front = ServeEnvFront(ServeEnvConfig(address="tcp://127.0.0.1:5555", env_config={...}, pool=...))
    await front.start()        # binds the ROUTER at once; the env pool loads in the background
    await front.closed()       # serves until `aclose` (the CLI closes on SIGINT / SIGTERM)

It answers the three methods of `verifiers.v1.serve` to any `EnvClient`:

- `health`: success once an env server has loaded the environment (readiness is loaded, not bound:
  docs/design.md contract 8). While it loads, a health request is answered when the load ends; a load that
  failed is answered `success=False` with why.
- `run`: one supervised episode (`runs.serve_run`), its deltas relayed as the env server yields them,
  ended by exactly one reply. Runs that arrive while the environment loads wait for it; once its load
  has failed `load_attempts` times, every waiting and later run is answered with that failure at once.
- `cancel`: the run's task is cancelled (its session ended on its env server) and the run still gets
  verifiers' reply `success=False, error="Cancelled: rollout aborted"`; the cancel is answered
  `cancelled=True` when the run was live.

The env pool is the plane's `EnvPool` (restart budget, readiness, probes, wedge detection), its servers
running `adapters.verifiers_serve` in the pool's own interpreter (`EnvPoolConfig.runtime_env`): the front
never imports verifiers, and it relays the frames verifiers packed without opening them. The pool actor
is the front's one actor: pinned to the front's own node and supervised as the plane supervises its
pools (`SupervisedPool`: lost, it is restarted within its restart budget; each dispatch asks for the
serving incarnation). The ROUTER lives in the front's own process (the CLI's driver), so the front
survives the loss of any node but its own; losing its own process ends it (docs/prime-rl.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack
import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from env_actors.config import EnvPoolConfig
from env_actors.failures import EnvLoadTimeout, EnvStartupError
from env_actors.pool import start_env_pool
from rollout_actors.kernel import Failure, Ref, new_id
from rollout_actors.kernel.faults import LoadFailed
from rollout_actors.kernel.tasks import TaskOwner
from rollout_actors.plane.config import PoolSupervision
from rollout_actors.plane.pool_supervisor import PoolUnavailable, SupervisedPool
from rollout_actors.serve_env.runs import failure_reply, pack_reply, serve_run
from rollout_actors.serve_env.wire import Inbound, RouterWire

logger = logging.getLogger(__name__)

ADAPTER = "env_actors.adapters.verifiers_serve:VerifiersServeEnv"
CANCELLED_ERROR = "Cancelled: rollout aborted"
"""verifiers' own reply text for a run aborted by `cancel` (`EnvServer._handle`), byte for byte."""
LOAD_SLACK_S = 30.0  # past the pool's readiness deadline: the pool actor's own start and answer
CLOSE_TIMEOUT_S = 10.0


class ServeEnvConfig(BaseModel):
    """What `rollouts serve-env` serves, where, and how its pool is sized and supervised."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = "tcp://127.0.0.1:5000"
    """Where the ROUTER binds (verifiers' default); prime-rl's `serve.address` points here."""
    env_config: dict[str, Any] = {}
    """verifiers' `EnvConfig` as a dict: `{"taskset": {"id": ..., ...}, "agent": {...}}`."""
    env: Ref | None = None
    """Another environment that runs whole episodes (`serve_run`) instead of verifiers' over `env_config`
    (the fault tests' `env_actors.faults.serve_envs`); it must pass the pool's Ref allowlist."""
    pool: EnvPoolConfig = EnvPoolConfig()
    """The env pool (its `runtime_env` carries verifiers 0.4's interpreter; `env_packages` its gate)."""
    pool_name: str = ""
    """The env pool actor's name; empty: one of its own per front."""
    run_timeout_s: float = Field(default=3600.0, gt=0)
    """Each run's whole episode, from its arrival (verifiers' own client waits untimed)."""
    load_attempts: int = Field(default=2, ge=1)
    """Loads of the environment before its failure is the answer of every run (docs/design.md contract 8)."""
    pool_supervision: PoolSupervision = PoolSupervision()
    """How the env pool actor is supervised once loaded: restarted within its budget when lost."""

    def env_ref(self) -> Ref:
        return self.env or Ref(target=ADAPTER, config={"env_config": self.env_config})


class ServeEnvFront:
    """The ROUTER, the env pool and the runs in flight, all owned here and closed by `aclose`."""

    def __init__(self, config: ServeEnvConfig) -> None:
        self.config = config
        self.wire: RouterWire | None = None
        self.supervised: SupervisedPool | None = None
        """The env pool's supervisor, once the environment loaded."""
        self.load_failure: Failure | None = None
        """The environment's load failure, once it failed `load_attempts` times: remembered, not retried."""
        self.loads = 0
        self._loaded: asyncio.Event = asyncio.Event()
        """Set when the load ended, either way."""
        self._runs: dict[bytes, asyncio.Task[None]] = {}
        self._tasks = TaskOwner("serve-env")
        self._closed = asyncio.Event()

    @property
    def address(self) -> str:
        assert self.wire is not None, "start() first"
        return self.wire.address

    async def start(self) -> None:
        self.wire = RouterWire(self.config.address)
        self._tasks.own(self._load(), "load")
        self._tasks.own(self._receive(), "receive")
        logger.info("serve-env: listening at %s; loading %s", self.address, self.config.env_config)

    @property
    def pool(self) -> Any:
        """The serving env pool actor's handle; None before the load, after its failure, or while the
        pool is being restarted."""
        return self.supervised.current() if self.supervised is not None else None

    async def wait_loaded(self, timeout: float) -> bool:
        """Whether the environment is loaded (False: its load failed) within `timeout`."""
        await asyncio.wait_for(self._loaded.wait(), timeout)
        return self.supervised is not None

    async def closed(self) -> None:
        await self._closed.wait()

    async def aclose(self) -> None:
        """Cancel the runs in flight (each still answered), close the pool and the socket. Idempotent."""
        if self._closed.is_set():
            return
        for task in list(self._runs.values()):
            task.cancel()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=CLOSE_TIMEOUT_S)
        await self._tasks.close()
        if self.supervised is not None:
            try:  # it asks the pool to close, then kills it; a pool that does not answer is killed
                await asyncio.wait_for(self.supervised.close(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                logger.warning("serve-env: the env pool did not close within %g s", CLOSE_TIMEOUT_S)
        if self.wire is not None:
            self.wire.close()
        self._closed.set()

    # ------------------------------------------------------------------------------------ loading

    def _load_wait_s(self) -> float:
        return self.config.load_attempts * (self.config.pool.ready_timeout_s + LOAD_SLACK_S)

    async def _load(self) -> None:
        name = self.config.pool_name or new_id("serve-env")
        # Pinned to this process's node (the ROUTER's): the front dies with that node anyway, and so
        # survives the loss of any other. Servers go wherever the pool's config lets Ray put them.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        try:
            while self.supervised is None and self.loads < self.config.load_attempts:
                self.loads += 1
                supervised = SupervisedPool(
                    f"serve-env env pool ({self.config.env_ref().target})",
                    f"{name}-{self.loads}",
                    lambda actor: start_env_pool(
                        actor, self.config.env_ref(), self.config.pool, self.config.pool.ready_timeout_s, here
                    ),
                    self.config.pool_supervision,
                )
                try:
                    await supervised.start()
                except (EnvStartupError, PoolUnavailable) as exc:
                    failure = exc.failure
                    logger.warning(
                        "serve-env: load %d failed: %s: %s", self.loads, failure.type, failure.message
                    )
                    self.load_failure = LoadFailed(
                        f"the environment failed to load {self.loads} time(s); last: {failure.type}: "
                        f"{failure.message}",
                        traceback=failure.traceback,
                        kind="caller" if failure.fault == "caller" else "infrastructure",
                    ).failure
                else:
                    self.supervised = supervised
            if self.supervised is not None:
                self.load_failure = None
        finally:
            self._loaded.set()

    async def _serving_pool(self, timeout: float, verify: bool) -> Any:
        """The serving env pool's handle, waiting up to `timeout` for one being restarted (`verify`: a run
        lost a server, so the pool is checked alive first); `PoolUnavailable` when there is none."""
        assert self.supervised is not None
        # A restart loads the environment afresh: bounded as one load is, not by the run's whole deadline.
        await self.supervised.serving(min(timeout, self.config.pool.ready_timeout_s + LOAD_SLACK_S), verify)
        return self.supervised.current()  # `serving` just found it serving, and nothing ran since

    async def _ready(self) -> Failure | None:
        """None once loaded; the load's failure when it failed (at once, remembered)."""
        try:
            await asyncio.wait_for(self._loaded.wait(), self._load_wait_s())
        except TimeoutError:
            return EnvLoadTimeout("the environment's load outlived its deadline").failure
        return None if self.supervised is not None else self.load_failure

    # ------------------------------------------------------------------------------------ serving

    async def _receive(self) -> None:
        assert self.wire is not None
        while True:
            request = await self.wire.receive()
            if request is None:
                continue
            if request.method == b"run":
                # registered before it runs: a cancel right behind it (ZMQ keeps one client's order) finds it
                task = self._tasks.own(self._run(request), "run")
                self._runs[request.request_id] = task
                task.add_done_callback(lambda _, rid=request.request_id: self._runs.pop(rid, None))
            elif request.method == b"health":
                self._tasks.own(self._health(request), "health")
            elif request.method == b"cancel":
                await self._cancel(request)
            else:
                error = f"unknown method {request.method.decode(errors='replace')!r}"
                await self.wire.send(request, b"reply", pack_reply({"success": False, "error": error}))

    async def _health(self, request: Inbound) -> None:
        failure = await self._ready()
        assert self.wire is not None
        if failure is None:
            await self.wire.send(request, b"reply", pack_reply({"success": True, "error": None}))
        else:
            await self.wire.send(request, b"reply", failure_reply(failure))

    async def _run(self, request: Inbound) -> None:
        wire = self.wire
        assert wire is not None

        async def send_delta(frame: bytes) -> None:
            await wire.send(request, b"delta", frame)

        try:
            failure = await self._ready()
            if failure is not None:
                reply = failure_reply(failure)
            else:
                reply = await serve_run(
                    self._serving_pool, request.payload, send_delta, timeout_s=self.config.run_timeout_s
                )
        except asyncio.CancelledError:  # `cancel`, or the front closing: answered all the same, as verifiers
            await asyncio.shield(
                wire.send(request, b"reply", pack_reply({"success": False, "error": CANCELLED_ERROR}))
            )
            raise
        await wire.send(request, b"reply", reply)

    async def _cancel(self, request: Inbound) -> None:
        assert self.wire is not None
        try:
            target = str(msgpack.unpackb(request.payload, raw=False)["request_id"]).encode()
        except Exception as exc:  # a malformed cancel is answered, as verifiers answers a bad request
            error = f"{type(exc).__name__}: {exc}"
            await self.wire.send(request, b"reply", pack_reply({"success": False, "error": error}))
            return
        task = self._runs.get(target)
        if task is not None:
            task.cancel()
            logger.info("serve-env: cancelled run %s on client request", target.decode())
        await self.wire.send(
            request, b"reply", pack_reply({"success": True, "error": None, "cancelled": task is not None})
        )
