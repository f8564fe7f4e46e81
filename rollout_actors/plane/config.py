"""`PlaneConfig`: how a plane is sized and how patient it is, typed down to its pools."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from env_actors.config import EnvPoolConfig
from renderer_actors.config import RendererPoolConfig
from rollout_actors.kernel import DEFAULT_ALLOWED_PREFIXES
from rollout_actors.kernel.coalescer import DEFAULT_BATCH_WINDOW_S
from rollout_actors.kernel.supervision import RestartIntensity
from rollout_actors.plane.concurrency import ConcurrencyConfig
from rollout_actors.plane.placement import PlacementConfig

WORKER_RESTARTS = RestartIntensity(max_restarts=10, window_s=60.0)
"""Rides out a node's worth of rollout workers lost at once; a worker that dies on every start fails loudly."""
POOL_RESTARTS = RestartIntensity(max_restarts=3, window_s=300.0)
"""Per pool. A pool restart costs every rollout it served a re-dispatch: three in five minutes rides out a
lost node plus an OOM, and a pool that dies on every start fails loudly instead of flapping."""


class PoolSupervision(BaseModel):
    """How the plane supervises the pool actors it holds one of (the renderer pool, each env pool)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    restart: RestartIntensity = POOL_RESTARTS
    """Restarts of one pool actor (its renderers or env servers die with it and restart with it)."""
    hang_timeout_s: float = Field(default=30.0, gt=0)
    """A pool that shows no sign of life this long is wedged: killed and restarted like a dead one. Its
    `health` answers on the loop that serves every renderer slot and placement, so this is generous."""
    probe_interval_s: float = Field(default=1.0, gt=0)
    """How often each pool is asked for `health`; a death is seen within about this long."""
    node_id: str | None = None
    """The Ray node the pool actors are placed on while it is alive (a restart after its loss goes to the
    driver's node). `None`: the driver's node, so a pool dies only with the driver's node, a kill, or its
    own crash; pools need no CPU, so a head node without schedulable CPUs (`cluster.yaml`) hosts them."""


class PlaneConfig(BaseModel):
    """How a plane is sized and how patient it is. Defaults are production defaults. Frozen, and an unknown
    key (at any depth) is an error when the config is built, not at the first request that uses it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lanes: dict[str, int] = Field(default_factory=lambda: {"train": 1024, "eval": 256})
    """Lane name -> most rollouts in flight at once."""
    workers: int | None = None
    """RolloutWorker actors; `None` sizes from the lane bounds and `rollouts_per_worker`."""
    rollouts_per_worker: int = 1024
    worker_num_cpus: float = 1.0
    fit_cpus: bool | None = None
    """Scale every CPU request of the plane's actors (workers, renderers, env servers) down at `start()`
    when the cluster's free CPUs cannot hold its smallest working set (`rollout_actors.plane.sizing`).
    None: where the cluster cannot grow, a local Ray this process started (`ray.init()`); on a cluster an
    autoscaler grows, a set that does not fit is named in a warning and left to it."""
    hang_timeout_s: float = 30.0
    """A worker that misses liveness probes this long is lost (Ray takes ~65 s to declare a hung node)."""
    probe_interval_s: float = 2.0
    worker_restart: RestartIntensity = WORKER_RESTARTS
    """How many lost rollout workers are replaced in a window; past it a lost worker is not replaced."""
    max_dispatches: int = Field(default=3, ge=1)
    """First dispatch plus at most two re-dispatches after a lost worker, then `infrastructure`."""
    answer_grace_s: float = 60.0
    """How long past a request's own deadline the plane waits for its worker before giving up."""
    cancel_grace_s: float = 10.0
    """How long a cancelled rollout may take to clean up before the plane answers `cancelled` itself."""
    call_timeout_s: float = 120.0
    """Ceiling for one renderer or env call inside a rollout."""
    batch_window_s: float = Field(default=DEFAULT_BATCH_WINDOW_S, ge=0, le=1)
    """How long a loaded rollout worker's renderer and env calls wait to travel together. Batching is
    what makes a remote call cheap per turn (each Ray call costs ~0.6 ms of CPU on each side); a worker
    whose calls come one at a time never waits. 0: batch within one event-loop tick only."""
    endpoints: list[str] = Field(default_factory=list)
    """Inference base URLs to spread rollouts over (each rollout keeps the one it starts on). Empty: every
    request uses its own `client.base_url`."""
    env_pool: EnvPoolConfig = Field(default_factory=EnvPoolConfig)
    """Every env pool this plane starts (one per environment Ref), unless `env_pools` names its target.
    Its `allowed_ref_prefixes`, when unset, is the plane's."""
    env_pools: dict[str, EnvPoolConfig] = Field(default_factory=dict)
    """Pools of particular environments, by their Ref's target (`"env_actors.adapters.skyrl_gym:SkyRLGymEnv"`):
    each may carry its own packages (`runtime_env`) and adapter allowlist (`env_packages`), so clashing
    environment stacks run side by side in one plane."""
    renderer_pool: RendererPoolConfig = Field(default_factory=RendererPoolConfig)
    """The plane's renderer pool: sizing, health checks, startup budget."""
    pool_supervision: PoolSupervision = Field(default_factory=PoolSupervision)
    """Placement, liveness and restart budget of the pool actors themselves."""
    env_ready_timeout_s: float = 120.0
    allowed_ref_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES
    """Module prefixes a request's Refs may name. Widening it is explicit."""
    concurrency: ConcurrencyConfig | None = None
    """Load-aware lane limits (`rollout_actors.plane.concurrency`): None keeps the limits fixed."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Which inference server a rollout runs on (`rollout_actors.plane.placement`): by default where its prefix
    is cached, within a load bound."""
    max_off_policy_steps: int | None = Field(default=None, ge=0)
    """When a new policy becomes active, cancel rollouts in flight that started more than this many
    versions before it (the trainer would drop them anyway). None: never."""
    policy_storage_dir: str | None = None
    """Where published LoRA adapters are written; every server must read it under the same path."""
    server_api_key_var: str | None = None
    """Environment variable holding the inference servers' API key, sent with the plane's own calls to
    them (LoRA load/unload, pause/resume, weight updates). Given an `InferenceServerSet`, its
    `ServerSpec.api_key_var` is used. Rollouts send `ClientConfig.api_key_var`."""
    name_prefix: str | None = None
    """Prefix of the named actors this plane starts; `None` picks a unique one."""

    @field_validator("lanes")
    @classmethod
    def _lanes(cls, lanes: dict[str, int]) -> dict[str, int]:
        if not lanes:
            raise ValueError("a plane needs at least one lane")
        bad = {name: limit for name, limit in lanes.items() if limit < 1}
        if bad:
            raise ValueError(f"lane limits must be >= 1, got {bad}")
        return lanes
