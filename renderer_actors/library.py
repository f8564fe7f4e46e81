"""Build the `renderers` library renderer a `RendererKey` names: by family name, auto-resolved from the
model name, or a custom class named by a `Ref`.

A custom renderer follows the library's custom-renderer shape (a class with `config_class`, a
`BaseRendererConfig` subclass, constructed as `cls(tokenizer, config)`), but it is never loaded through
the library's `CustomRendererConfig`: that imports any module or file path it is given. Here the class is
resolved by `RefResolver` against the renderer side's allowlist (fixed when the pool starts; nothing in
a request can reach or widen it) and must be marked `@ref_target("renderer")`.
"""

from __future__ import annotations

from typing import Any

from renderer_actors.bundled import BUNDLED_RENDERER, BundledRenderer, BundledRendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.tokenizer import FastTokenizer
from rollout_actors.kernel import CallerError, RefResolver

RENDERER_ROLE = "renderer"


def build_library_renderer(
    key: RendererKey, tokenizer: FastTokenizer, allowed_prefixes: tuple[str, ...]
) -> tuple[Any, str]:
    """(library renderer, the family it resolved to). Blocking: may load a processor or probe a model
    config (auto-resolution of an unmapped model)."""
    from renderers import create_renderer
    from renderers.configs import AutoRendererConfig, config_from_name

    if key.family == "custom":
        assert key.custom is not None
        renderer_class = RefResolver(allowed_prefixes).load(key.custom.target, role=RENDERER_ROLE)
        config = _custom_config(renderer_class, key)
        return renderer_class(tokenizer, config), f"custom:{key.custom.target}"
    if key.family == "auto":
        config = AutoRendererConfig.model_validate(key.renderer_config)
        renderer = create_renderer(tokenizer, config, chat_template_kwargs=key.template_kwargs or None)
        return renderer, renderer.config.name
    if key.family == BUNDLED_RENDERER:
        return BundledRenderer(
            tokenizer, BundledRendererConfig.model_validate(key.renderer_config)
        ), key.family
    config = type(config_from_name(key.family)).model_validate(key.renderer_config)
    return create_renderer(tokenizer, config), key.family


def _custom_config(renderer_class: Any, key: RendererKey) -> Any:
    from renderers.configs import BaseRendererConfig

    config_class = getattr(renderer_class, "config_class", None)
    if not (isinstance(config_class, type) and issubclass(config_class, BaseRendererConfig)):
        raise CallerError(
            f"custom renderer {key.custom.target if key.custom else '?'} must set `config_class` to a "
            "renderers BaseRendererConfig subclass"
        )
    unknown = set(key.template_kwargs) - set(config_class.template_field_names())
    if unknown:
        raise CallerError(f"custom renderer: template kwargs {sorted(unknown)} are not template fields")
    try:
        return config_class.model_validate({**key.renderer_config, **key.template_kwargs})
    except ValueError as exc:
        raise CallerError(f"custom renderer config: {exc}") from None
