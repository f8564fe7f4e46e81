"""`RendererConfig`: which renderer (tokenizer + chat template) a token-mode rollout uses."""

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
