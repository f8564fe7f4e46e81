"""Configuration and observable state of an `EnvPool`: small typed objects with production defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_actors.kernel.renamed import renamed_fields, warn_renamed
from rollout_actors.kernel.supervision import Health, RestartIntensity, Supervision

ENV_RESTARTS = RestartIntensity(max_restarts=3, window_s=60.0)
"""Rides out one OOM plus a retry, few enough that a crash loop fails loudly; a minute catches a crash
loop and forgives sporadic deaths."""


class EnvRuntimeEnv(BaseModel):
    """The packages and settings one env pool's servers run with: the subset of Ray's `runtime_env` an
    environment stack needs, so pools with clashing packages (verifiers 0.3 and 0.4) share one cluster
    beside a plane on its own `openai`. Ray builds it on each node before the server starts; a build that
    fails (a pip error, a missing interpreter) fails the pool's start with the build's error, not at the
    readiness deadline: a missing interpreter at spawn, one that cannot start a Ray worker (no `ray`, an
    import that crashes) after one `import ray` run by it before any server is spawned, a `pip` requirement
    that cannot be installed after one pip resolution run beside Ray's build
    (`env_actors.runtime_env_check`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pip: list[str] | None = None
    """Requirements pip installs at server start, into a virtualenv over the cluster's own packages."""
    py_executable: str | None = None
    """An interpreter to run the servers with (a prepared virtualenv's `bin/python`), same path on every
    node; it must import `ray` of the cluster's version and this project."""
    working_dir: str | None = None
    """A local folder (or a zip / remote URI Ray accepts) the servers run in and import from."""
    py_modules: list[str] | None = None
    """Local packages (folders or wheels) shipped to the servers and importable there."""
    env_vars: dict[str, str] = Field(default_factory=dict)

    def ray_dict(self) -> dict[str, Any]:
        """What `ray.remote(...).options(runtime_env=...)` takes: the fields that are set."""
        return self.model_dump(exclude_none=True, exclude_defaults=True)


class EnvPoolConfig(BaseModel):
    """How one environment's pool is sized, timed and supervised. One pool per environment Ref."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_servers: int = Field(default=1, ge=1)
    """Env servers started with the pool (no restart budget spent) and kept through idle periods."""
    max_servers: int = Field(default=8, ge=1)
    multiplex: int = Field(default=64, ge=1)
    """Concurrent sessions one server is meant to hold; the growth threshold is measured in these."""
    grow_fraction: float = Field(default=0.75, gt=0.0, le=1.0)
    """Grow by one server when open sessions reach this fraction of ready servers x multiplex."""
    idle_timeout_s: float = Field(default=300.0, gt=0)
    """A server above `min_servers` with no session for this long is retired."""
    num_cpus: float = Field(default=0.25, ge=0)
    """CPU reservation of each EnvServer: environments mostly wait, so a fraction of a core."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Extra Ray resources each EnvServer needs (e.g. `{"sandbox": 1}`)."""

    reset_timeout_s: float = Field(default=60.0, gt=0)
    step_timeout_s: float = Field(default=120.0, gt=0)
    score_timeout_s: float = Field(default=60.0, gt=0)
    close_timeout_s: float = Field(default=10.0, gt=0)
    ready_timeout_s: float = Field(default=300.0, gt=0)
    """From spawn to ready, for a server spawned while serving (load included); then it is killed."""

    hang_timeout_s: float = Field(default=30.0, gt=0)
    """A server with no sign of life (probe answered, event loop turning) for this long is wedged: it is
    retired, its calls fail and it is killed. Ray alone would wait ~65 s for a hung node, forever for a
    frozen process."""
    probe_interval_s: float = Field(default=0.5, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    restart: RestartIntensity = ENV_RESTARTS
    """Replacements and growth spawns share it; the initial `min_servers` do not spend it, nor does the
    replacement of a server wedged by a known request's call (`EnvPoolStats.culprit_replacements`)."""
    session_idle_timeout_s: float = Field(default=3600.0, gt=0)
    """A session untouched this long is closed by the pool (its owner is presumed gone)."""
    allowed_ref_prefixes: tuple[str, ...] | None = None
    """Module prefixes the environment Ref may name; None means the project's own packages."""
    env_packages: tuple[str, ...] = ()
    """Module prefixes an adapter (`env_actors.adapters`) may import as the user's environment package
    (a verifiers environment id, a skyrl-gym registering module). Empty: adapters load nothing. Like the
    Ref allowlist it is the pool's own, out of any request's reach."""
    runtime_env: EnvRuntimeEnv | None = None
    """The packages this pool's servers run with (see `EnvRuntimeEnv`); None: the cluster's own."""

    @property
    def supervision(self) -> Supervision:
        """The supervision setting of this pool's servers, as the kernel's supervisor reads it."""
        return Supervision.read(self)

    _renamed = model_validator(mode="before")(
        renamed_fields(
            {"spawn_timeout_s": "ready_timeout_s", "min_workers": "min_servers", "max_workers": "max_servers"}
        )
    )

    @model_validator(mode="after")
    def _sizes(self) -> EnvPoolConfig:
        if self.max_servers < self.min_servers:
            raise ValueError(f"max_servers ({self.max_servers}) < min_servers ({self.min_servers})")
        return self


@dataclass(frozen=True, slots=True)
class EnvCallLimits:
    """The pool's per-call ceilings, handed to each EnvServer: sessions call it directly, so it caps their
    deadlines itself."""

    reset_s: float = math.inf
    step_s: float = math.inf
    score_s: float = math.inf

    @classmethod
    def of(cls, config: EnvPoolConfig) -> EnvCallLimits:
        return cls(
            reset_s=config.reset_timeout_s, step_s=config.step_timeout_s, score_s=config.score_timeout_s
        )

    def timeout_s_of(self, method: str, timeout_s: float, score_if_done: bool = False) -> float:
        """How long a session call may take (seconds): the caller's timeout, capped by its method's limit."""
        if method == "step":
            return min(timeout_s, self.step_s + (self.score_s if score_if_done else 0.0))
        if method == "reset":
            return min(timeout_s, self.reset_s)
        if method == "score":
            return min(timeout_s, self.score_s)
        return timeout_s  # an agent run: its own deadline sits inside the caller's


class EnvServerHealth(Health):
    """An `EnvServer`'s answer to `health()`, from its probe loop (so it answers while env code blocks)."""

    phase: str
    """`created`, `constructing`, `loading`, `ready` or `failed`."""
    blocking: str | None = None
    """The session whose env call holds the server's loop, once it has held it a while, or whose env code
    runs on in a thread past its call's deadline (`env_calls`; `loop_stall_s` then counts from there)."""
    sessions: int = 0
    calls: int = 0
    """Env calls running now (an operator, or a test, sees a call start without guessing)."""


class EnvServerInfo(BaseModel):
    """One env server of a pool, as `EnvPoolStats.servers` shows it."""

    name: str
    """The EnvServer's actor name (reachable with `ray.get_actor`)."""
    state: Literal["starting", "ready"]
    sessions: int
    inflight: int
    pid: int | None = None
    node_id: str | None = None

    @property
    def worker(self) -> str:
        """The old name of `name`."""
        warn_renamed("EnvServerInfo.worker", "name")
        return self.name


WorkerInfo = EnvServerInfo
"""The old name of `EnvServerInfo` (docs/design.md, "Words": a worker is a rollout worker)."""


class EnvPoolStats(BaseModel):
    """What the supervisor knows, for tests, logs and the plane's status line."""

    name: str
    servers: list[EnvServerInfo]
    ready: int
    starting: int
    sessions: int
    num_tasks: int | None = None
    spawns: int
    """EnvServer actors created, initial ones included."""
    spawn_failures: int
    """Spawns that never became ready (load error, died while loading, readiness deadline)."""
    deaths: int
    """Ready servers lost: died or wedged."""
    restarts_left: int
    budget_denials: int
    """Spawns wanted (replacement or growth) but refused because the restart budget was spent."""
    culprit_replacements: int = 0
    """Servers wedged by a known session's call and replaced outside the restart budget: the request that
    wedged each is charged instead (its poison bound limits what it costs)."""
    quarantined: int = 0
    """Servers started for one suspect session alone (quarantine: its request lost env servers at one point
    among other sessions twice), outside the restart budget."""
    spawning_stopped: str | None = None
    """Set when the pool gave up spawning (a crash loop); why."""
    retired: list[str] = Field(default_factory=list)
    """The most recent retirements, newest last: `"<server>: <reason>"`."""

    @property
    def workers(self) -> list[EnvServerInfo]:
        """The old name of `servers` (docs/design.md, "Words": a worker is a rollout worker)."""
        warn_renamed("EnvPoolStats.workers", "servers")
        return self.servers
