"""`RendererKey`: what makes two renderers interchangeable.

Two rollouts may share a renderer actor when they would render every message list to the same ids: same
tokenizer, same library renderer config (family, settings, template kwargs), same history policy. The
key is canonical: a named family's config is validated by the library and dumped with every default
filled in, so `{}` and the explicit defaults share one key. `multiplex` is deliberately not part of the
key: it is the pool's sizing policy, not a property of the rendering, so configs that differ only in
multiplex share one pool (the first slot for a key fixes its multiplex).

Built in the rollout's process, so it imports no code a request names: a `custom` renderer stays a Ref
here and is resolved (or refused) on the renderer side, under that side's allowlist.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from renderer_actors.config import RendererConfig
from renderer_actors.tokenizer import BUNDLED_FAMILY, BUNDLED_MODEL
from rollout_actors.kernel import CallerError, Ref


class RendererKey(BaseModel):
    """One tokenizer + library renderer config + history policy. Build it with `from_config`."""

    model_config = ConfigDict(frozen=True)

    model: str
    """Tokenizer name or local path (`BUNDLED_MODEL` for the bundled one)."""
    family: str
    """The library renderer's name; `auto` when the model is not one the library maps (resolved when
    the renderer loads: a chat-template model gets `default`); `custom` for a Ref-named class."""
    renderer_config: dict[str, Any] = Field(default_factory=dict)
    """The library's typed config for `family`, defaults filled in (named families); for `auto` and
    `custom`, the settings as given, validated when the renderer loads."""
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Only for `auto` and `custom` (a named family carries them inside `renderer_config`)."""
    custom: Ref | None = None
    history: Literal["append", "fork_on_rewrite"] = "append"
    template_faithful: bool = True

    @classmethod
    def from_config(cls, model: str, config: RendererConfig) -> RendererKey:
        """The key a rollout against `model` with renderer `config` uses. `config.tokenizer` wins over the
        model name (LoRA adapters and served aliases share their base model's tokenizer). `CallerError`
        for a family or setting the library refuses."""
        name = config.tokenizer or model
        family = config.family
        if config.custom is not None and family not in ("auto", "custom"):
            raise CallerError(f"renderer: `custom` is set but family is {family!r}; use family='custom'")
        if config.custom is not None or family == "custom":
            if config.custom is None:
                raise CallerError("renderer: family 'custom' needs `custom`, a Ref to the renderer class")
            settings = dict(config.custom.config)
            if config.thinking_retention is not None:
                settings["thinking_retention"] = config.thinking_retention
            return cls(
                model=name,
                family="custom",
                renderer_config=settings,
                template_kwargs=dict(config.template_kwargs),
                custom=config.custom,
                history=config.history,
                template_faithful=config.template_faithful,
            )
        if family == "auto":
            family = BUNDLED_FAMILY if name == BUNDLED_MODEL else _mapped_family(name)
        if family == "auto":
            if config.options:
                raise CallerError("renderer: `options` need a named family (auto cannot tell whose they are)")
            settings = {"name": "auto"}
            if config.thinking_retention is not None:
                settings["thinking_retention"] = config.thinking_retention
            return cls(
                model=name,
                family="auto",
                renderer_config=settings,
                template_kwargs=dict(config.template_kwargs),
                history=config.history,
                template_faithful=config.template_faithful,
            )
        return cls(
            model=name,
            family=family,
            renderer_config=library_config(family, config),
            history=config.history,
            template_faithful=config.template_faithful,
        )

    def to_json(self) -> str:
        """Canonical JSON: equal keys give equal strings (sorted keys, no whitespace)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RendererKey:
        return cls.model_validate_json(text)

    def short(self) -> str:
        """A readable name for logs and stats."""
        settings = {**self.renderer_config, **self.template_kwargs}
        settings.pop("name", None)
        shown = ",".join(f"{k}={v}" for k, v in sorted(settings.items()) if v is not None)
        family = self.custom.target if self.custom is not None else self.family
        return f"{self.model}[{family};{self.history};{shown}]"


def library_config(family: str, config: RendererConfig) -> dict[str, Any]:
    """The library's typed config for a named family, validated (options, retention, template kwargs)
    and dumped with its defaults: the canonical form the key holds and the renderer is built from."""
    from renderers.base import merge_chat_template_kwargs
    from renderers.configs import config_from_name

    from renderer_actors.bundled import BUNDLED_RENDERER, BundledRendererConfig

    if family in ("auto", "custom"):
        raise CallerError(f"renderer: family {family!r} is not a concrete renderer")
    try:
        config_class = BundledRendererConfig if family == BUNDLED_RENDERER else type(config_from_name(family))
    except ValueError as exc:
        raise CallerError(f"renderer: unknown family {family!r}: {exc}") from None
    settings = {**config.options}
    if config.thinking_retention is not None:
        settings["thinking_retention"] = config.thinking_retention
    try:
        typed = merge_chat_template_kwargs(config_class(**settings), config.template_kwargs)
    except (ValueError, TypeError) as exc:
        raise CallerError(f"renderer {family!r}: {exc}") from None
    return typed.model_dump(mode="json")


def _mapped_family(name: str) -> str:
    """The library's exact-name map (fine-tunes and local paths miss on purpose: they may ship another
    template); a miss stays `auto` and resolves when the tokenizer is loaded."""
    from renderers.base import MODEL_RENDERER_MAP

    return MODEL_RENDERER_MAP.get(name, "auto")
