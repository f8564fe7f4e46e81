"""`RendererKey`: what makes two renderers interchangeable.

Two rollouts may share a renderer actor when they would render every message list to the same ids: same
tokenizer, same template family, same template kwargs, same history policy. `multiplex` is deliberately
not part of the key: it is the pool's sizing policy, not a property of the rendering, so configs that
differ only in multiplex share one pool (the first lease for a key fixes its multiplex).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from renderer_actors.config import RendererConfig
from renderer_actors.tokenizer import BUNDLED_MODEL

Family = Literal["auto", "qwen3", "hf"]

QWEN3_TEMPLATE_DEFAULTS: dict[str, Any] = {"enable_thinking": True, "drop_past_reasoning": False}
"""The bundled template's kwargs and defaults: filled in so `{}` and the explicit defaults share a key."""


class RendererKey(BaseModel):
    """One tokenizer + template + policy. Canonical: build it with `from_config`, compare by `to_json`."""

    model_config = ConfigDict(frozen=True)

    model: str
    """Tokenizer name or local path (`BUNDLED_MODEL` for the bundled one)."""
    family: Family
    """`qwen3` or `hf`; `auto` only for non-bundled models, resolved by the renderer when it loads."""
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Chat-template kwargs, with the family's defaults filled in where they are known."""
    history: Literal["append", "fork_on_rewrite"] = "append"

    @classmethod
    def from_config(cls, model: str, config: RendererConfig) -> RendererKey:
        """The key a rollout against `model` with renderer `config` uses. `config.tokenizer` wins over the
        model name (LoRA adapters and served aliases share their base model's tokenizer)."""
        name = config.tokenizer or model
        family: Family = config.family
        if family == "auto" and name == BUNDLED_MODEL:
            family = "qwen3"
        kwargs = dict(config.template_kwargs)
        if family == "qwen3":
            kwargs = {**QWEN3_TEMPLATE_DEFAULTS, **kwargs}
        return cls(model=name, family=family, template_kwargs=kwargs, history=config.history)

    def to_json(self) -> str:
        """Canonical JSON: equal keys give equal strings (sorted keys, no whitespace)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RendererKey:
        return cls.model_validate_json(text)

    def short(self) -> str:
        """A readable name for logs and stats."""
        kwargs = ",".join(f"{k}={v}" for k, v in sorted(self.template_kwargs.items()))
        return f"{self.model}[{self.family};{self.history};{kwargs}]"
