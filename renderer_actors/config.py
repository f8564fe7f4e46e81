"""`RendererConfig` (which renderer a token-mode rollout uses) and `RendererPoolConfig` (how the pool of
renderer actors is sized and timed)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class RendererConfig(BaseModel):
    """Which renderer (tokenizer + chat template) a token-mode rollout uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokenizer: str | None = None
    """Tokenizer name or path; `None` means the model name from `ClientConfig`."""
    family: Literal["auto", "qwen3", "hf"] = "auto"
    """Template family: `qwen3` bridges natively; `hf` is any HF chat template (full render + prefix check)."""
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the chat template, e.g. `{"enable_thinking": false}`."""
    history: Literal["append", "fork_on_rewrite"] = "append"
    """When a full re-render would differ from the bridged history: keep appending, or fork a branch."""
    multiplex: int = Field(default=256, ge=1)
    """Concurrent rollouts per renderer actor before the pool grows. Not part of the pool key."""


class RendererPoolConfig(BaseModel):
    """Renderer pool sizing and timing. The defaults are production defaults; tests inject short ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    renderer_num_cpus: float = Field(default=0.5, ge=0)
    """Logical CPUs per renderer actor: half a core, as rendering is bursts between model calls."""
    idle_timeout_s: float = 300.0
    """An idle renderer beyond the first of its key retires after this long without leases."""
    reap_interval_s: float = 5.0
    health_interval_s: float = 10.0
    health_timeout_s: float = 30.0
    """A renderer that cannot answer a health call this long is wedged: replaced like a dead one."""
    startup_timeout_s: float = 300.0
    """Tokenizer load budget (a hub download on first use can take minutes)."""
    failure_hold_s: float = 10.0
    """After a startup failure, leases for that key fail at once for this long."""
    max_renderers_per_key: int = Field(default=64, ge=1)
    """Beyond this, leases overfill the least-loaded renderer instead of growing the pool."""
    max_lease_s: float = 6 * 3600.0
    """A lease never released (its holder's process died) stops counting as load after this."""
