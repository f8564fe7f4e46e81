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
never imports verifiers, and it relays the frames verifiers packed without opening them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from env_actors.config import EnvPoolConfig
from env_actors.failures import EnvLoadTimeout, EnvStartupError
from env_actors.pool import close_env_pool, start_env_pool
from rollout_actors.kernel import Failure, Ref, new_id
from rollout_actors.kernel.faults import LoadFailed
from rollout_actors.kernel.tasks import TaskOwner
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
    env_config: dict[str, Any]
    """verifiers' `EnvConfig` as a dict: `{"taskset": {"id": ..., ...}, "agent": {...}}`."""
    pool: EnvPoolConfig = EnvPoolConfig()
    """The env pool (its `runtime_env` carries verifiers 0.4's interpreter; `env_packages` its gate)."""
    pool_name: str = ""
    """The env pool actor's name; empty: one of its own per front."""
    run_timeout_s: float = Field(default=3600.0, gt=0)
    """Each run's whole episode, from its arrival (verifiers' own client waits untimed)."""
    load_attempts: int = Field(default=2, ge=1)
    """Loads of the environment before its failure is the answer of every run (docs/design.md contract 8)."""


class ServeEnvFront:
    """The ROUTER, the env pool and the runs in flight, all owned here and closed by `aclose`."""

    def __init__(self, config: ServeEnvConfig) -> None:
        self.config = config
        self.wire: RouterWire | None = None
        self.pool: Any = None
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

    async def wait_loaded(self, timeout: float) -> bool:
        """Whether the environment is loaded (False: its load failed) within `timeout`."""
        await asyncio.wait_for(self._loaded.wait(), timeout)
        return self.pool is not None

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
        if self.pool is not None:
            await close_env_pool(self.pool, CLOSE_TIMEOUT_S)
        if self.wire is not None:
            self.wire.close()
        self._closed.set()

    # ------------------------------------------------------------------------------------ loading

    def _load_wait_s(self) -> float:
        return self.config.load_attempts * (self.config.pool.ready_timeout_s + LOAD_SLACK_S)

    async def _load(self) -> None:
        env = Ref(target=ADAPTER, config={"env_config": self.config.env_config})
        name = self.config.pool_name or new_id("serve-env")
        try:
            while self.pool is None and self.loads < self.config.load_attempts:
                self.loads += 1
                try:
                    self.pool = await start_env_pool(
                        f"{name}-{self.loads}", env, self.config.pool, self.config.pool.ready_timeout_s
                    )
                except EnvStartupError as exc:
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
            if self.pool is not None:
                self.load_failure = None
        finally:
            self._loaded.set()

    async def _ready(self) -> Failure | None:
        """None once loaded; the load's failure when it failed (at once, remembered)."""
        try:
            await asyncio.wait_for(self._loaded.wait(), self._load_wait_s())
        except TimeoutError:
            return EnvLoadTimeout("the environment's load outlived its deadline").failure
        return None if self.pool is not None else self.load_failure

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
                    self.pool, request.payload, send_delta, timeout_s=self.config.run_timeout_s
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
