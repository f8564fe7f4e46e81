"""`RendererConfig` (which renderer a token-mode rollout uses, as data on the wire) and
`RendererPoolConfig` (how the pool of renderer actors is sized, timed and what it may resolve).

Rendering comes from the `renderers` package (one hand-coded renderer per model family, plus a default
for any chat template); this config names one of them and carries its settings. It never names code
except through `custom`, a `Ref` the renderer side resolves against its own allowlist.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_actors.kernel import Ref
from rollout_actors.kernel.renamed import renamed_fields, warn_renamed
from rollout_actors.kernel.supervision import RestartIntensity, Supervision

ThinkingRetention = Literal["tool_cycle", "all"]
DEFAULT_RENDERER_PREFIXES: tuple[str, ...] = ("renderer_actors.examples.",)
"""What a rollout can name as a custom renderer by default: the bundled examples. Widening it is explicit
pool config (`RendererPoolConfig.allowed_ref_prefixes`), separate from the environments' allowlist."""
RENDERER_RESTARTS = RestartIntensity(max_restarts=3, window_s=60.0)
"""Per key: rides out an OOM or a lost node; a renderer that dies (or fails to load) on every start spends
it in seconds, and then slots for that key fail with the reason instead of respawning it forever."""


class RendererConfig(BaseModel):
    """Which renderer (tokenizer + model family) a token-mode rollout uses, and how its history extends."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokenizer: str | None = None
    """Tokenizer name or path; `None` means the model name from `ClientConfig`."""
    family: str = "auto"
    """A renderer of the `renderers` package by name (`qwen3`, `qwen3.5`, `deepseek-v3`, `glm-4.5`,
    `kimi-k2`, `llama-3`, `gpt-oss`, ..., or `default` for any chat template), `bundled` (the bundled
    model's template), `auto` to resolve it from the model name, or `custom` with `custom` set."""
    custom: Ref | None = None
    """A custom renderer class (the library's custom-renderer shape: `config_class` + `(tokenizer, config)`)
    named by a Ref; its config holds the renderer config's fields. Resolved on the renderer side, against
    that side's allowlist, and only if the class is marked `@ref_target("renderer")`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Fields of the family's own typed config that are not template kwargs (e.g. `tool_parser` and
    `reasoning_parser` of `default`, `use_system_prompt` of `gpt-oss`)."""
    thinking_retention: ThinkingRetention | None = None
    """Historical reasoning the bridge keeps (the library's setting): `None` follows the model's template
    (a template that drops past reasoning makes a new user turn a full re-render); `tool_cycle` bridges
    within a tool cycle; `all` bridges across user turns, keeping every sampled think block."""
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Chat-template kwargs, checked against the family's allowlist (e.g. `{"enable_thinking": false}`)."""
    history: Literal["append", "fork_on_rewrite"] = "append"
    """`append`: extend the trajectory wherever the library's bridge (or a full render) proves it exact,
    fork only when neither can. `fork_on_rewrite`: also check every turn against a full render of the
    conversation and fork whenever the template would render the history differently (costs a full
    render per turn)."""
    template_faithful: bool = True
    """True: the model's chat template is the reference, also where the library deliberately departs
    from it (Qwen3, 3.5 and 3.6 with `enable_thinking=False` re-emit the prefilled empty think block on
    past turns; the template drops it, which rewrites every past turn: such a trajectory forks each
    turn). False: keep the library's deviation (a stable history that the template itself would not
    render). Qwen3.8 keeps it either way (`renderer.THINKING_OFF_HISTORY`)."""
    multiplex: int = Field(default=256, ge=1)
    """Concurrent rollouts per renderer actor before the pool grows. Not part of the pool key."""


class RendererPoolConfig(BaseModel):
    """Renderer pool sizing and timing. The defaults are production defaults; tests inject short ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    renderer_num_cpus: float = Field(default=0.5, ge=0)
    """Logical CPUs per renderer actor: half a core, as rendering is bursts between model calls."""
    idle_timeout_s: float = 300.0
    """An idle renderer beyond the first of its key retires after this long without slots held."""
    reap_interval_s: float = 5.0
    probe_interval_s: float = 10.0
    """How often each ready renderer is asked for `health`."""
    hang_timeout_s: float = 30.0
    """A renderer that cannot answer a health call this long is wedged: replaced like a dead one (also
    how long one probe may go unanswered)."""
    ready_timeout_s: float = 300.0
    """Tokenizer load budget (a hub download on first use can take minutes)."""
    failure_hold_s: float = 10.0
    """After a startup failure, slots for that key fail at once for this long."""
    max_renderers_per_key: int = Field(default=64, ge=1)
    """Beyond this, slots overfill the least-loaded renderer instead of growing the pool."""
    restart: RestartIntensity = RENDERER_RESTARTS
    """Restart intensity per key: every spawn after the key's first spends one, growth under load and
    replacements of renderers that died, wedged or failed to start alike (docs/design.md contract 9)."""
    slot_timeout_s: float = 6 * 3600.0
    """A slot never released (its holder's process died) stops counting as load after this.
    (It was `max_lease_s`.)"""
    allowed_ref_prefixes: tuple[str, ...] = DEFAULT_RENDERER_PREFIXES
    """Modules a custom renderer Ref may name (the renderer side's allowlist, fixed for the pool's life;
    requests cannot widen it)."""

    _renamed = model_validator(mode="before")(
        renamed_fields(
            {
                "health_interval_s": "probe_interval_s",
                "health_timeout_s": "hang_timeout_s",
                "startup_timeout_s": "ready_timeout_s",
                "max_lease_s": "slot_timeout_s",
            }
        )
    )

    @property
    def supervision(self) -> Supervision:
        """The supervision setting of each key's renderers, as the kernel's supervisor reads it."""
        return Supervision.read(self)


class RendererStats(BaseModel):
    """One renderer of a key, as `RendererPool.stats` shows it."""

    renderer_id: str
    load: int
    """Slots it holds."""
    ready: bool
    idle_s: float
    """Seconds without a slot held (0 while it holds one)."""


class RendererKeyStats(BaseModel):
    """The renderers of one `RendererKey`."""

    multiplex: int
    """The multiplex in force for the key (the first slot's)."""
    loads: list[int]
    """Slots per renderer, oldest renderer first."""
    renderers: list[RendererStats]
    startup_failure: str | None
    restarts_left: int


class RendererPoolStats(BaseModel):
    """A snapshot of a `RendererPool`: per key, then the pool's counters since it started."""

    keys: dict[str, RendererKeyStats]
    """Key JSON -> its renderers."""
    slots: int
    """Renderer slots held now."""
    spawned: int = 0
    retired: int = 0
    """Idle renderers retired."""
    replaced: int = 0
    """Dead, wedged or failed renderers replaced."""
    startup_failures: int = 0
    expired_slots: int = 0
    """Slots dropped at `slot_timeout_s` (their holder never released them)."""
    budget_denials: int = 0

    @property
    def leases(self) -> int:
        """The old name of `slots` (docs/design.md, "Words": a lease is a request's)."""
        warn_renamed("RendererPoolStats.leases", "slots")
        return self.slots

    @property
    def expired_leases(self) -> int:
        """The old name of `expired_slots`."""
        warn_renamed("RendererPoolStats.expired_leases", "expired_slots")
        return self.expired_slots
