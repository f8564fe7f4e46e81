"""The configuration reference (`docs/configuration.md`), generated from the pydantic models themselves.

    python -m rollout_actors.job.config_doc > docs/configuration.md

Every settable leaf of `PlaneConfig` and of `rollouts run`'s file sections, with its type, its default (read
off a default instance, so a parent's own default for a nested model wins over the nested class's) and the
attribute docstring under the field. `tests/test_docs.py` holds the committed page equal to this output, so
the page cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class Leaf:
    path: str
    type: str
    default: str
    doc: str


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of `cls` and its bases (the nearest class wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for field, after in zip(body, body[1:] + [None], strict=True):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The one pydantic model an annotation holds (`X`, `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return _model_in(models[0])
    return None


def type_name(annotation: Any) -> str:
    """An annotation as a reader writes it: `float | None`, `list[str]`, constraints left out."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    if origin is not None:
        name = getattr(origin, "__name__", str(origin).replace("typing.", ""))
        return f"{name}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Za-z_]\w*)", r"\1", str(annotation).replace("typing.", ""))


def _value(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError:
        return repr(value)


def leaves(model: type[BaseModel], instance: BaseModel | None, prefix: str = "") -> list[Leaf]:
    """Every settable leaf under `model`, defaults read off `instance` (None: the field has no default
    instance, as an optional section left unset: its class's own defaults)."""
    docs = attribute_docstrings(model)
    out: list[Leaf] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        doc = docs.get(name) or " ".join((field.description or "").split())
        required = instance is None and field.is_required()
        value = getattr(instance, name) if instance is not None else _default(field)
        nested = _model_in(field.annotation)
        if nested is not None:
            if value is None:
                out.append(Leaf(path, type_name(field.annotation), "null", doc or "unset by default"))
                sub = _instance(nested)
            else:
                sub = value
            out.extend(leaves(nested, sub, f"{path}."))
            continue
        out.append(Leaf(path, type_name(field.annotation), "" if required else _value(value), doc))
    return out


def _default(field: Any) -> Any:
    if field.default_factory is not None:
        return field.default_factory()
    return None if field.is_required() else field.default


def _instance(model: type[BaseModel]) -> BaseModel | None:
    try:
        return model()
    except Exception:  # a model whose fields are all required (RestartIntensity): no default instance
        return None


def table(rows: list[Leaf]) -> list[str]:
    lines = ["| key | type | default | what it is |", "|---|---|---|---|"]
    for leaf in rows:
        cells = [
            f"`{leaf.path}`",
            f"`{leaf.type}`",
            f"`{leaf.default}`" if leaf.default else "required",
            leaf.doc or "-",
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def reference() -> str:
    from rollout_actors.job.run_config import CLIENT_PER_SERVER, RunConfig
    from rollout_actors.plane.config import PlaneConfig
    from rollout_actors.wire import ClientConfig

    plane = leaves(PlaneConfig, PlaneConfig())
    run = RunConfig()
    run_plane = {leaf.path: leaf.default for leaf in leaves(PlaneConfig, run.plane)}
    differs = [leaf for leaf in plane if run_plane[leaf.path] != leaf.default]
    client = [
        leaf
        for leaf in leaves(ClientConfig, ClientConfig(base_url="http://localhost:8000/v1", model="m"))
        if leaf.path not in CLIENT_PER_SERVER
    ]
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m rollout_actors.job.config_doc > docs/configuration.md`; do not edit by hand.",
        "tests/test_docs.py fails when this page and the models differ. -->",
        "",
        "Every setting, read off the pydantic models that take it: the key (dotted below a section), its type,",
        "its default and the docstring under the field. Every model refuses an unknown key, at any depth, and",
        "names it by its path. Durations are `*_timeout_s` / `*_s` seconds.",
        "",
        f"## `PlaneConfig` ({len(plane)} settings)",
        "",
        "`rollout_actors.plane.config.PlaneConfig`: how a plane is sized and how patient it is, given to",
        "`RolloutPlane(config)`; in a `rollouts run` file, the `[plane]` section (the same keys, dotted as",
        "tables: `[plane.env_pool]`). Nested settings are set as a whole model or a dict:",
        '`PlaneConfig(env_pool={"num_cpus": 0.5})`. `env_pools` maps an environment Ref target to a pool',
        "config of its own, with the keys of `env_pool`.",
        "",
        *table(plane),
        "",
        "`rollouts run` starts its `[plane]` from other defaults for these keys:",
        "",
        *[f"- `{leaf.path}`: `{run_plane[leaf.path]}`" for leaf in differs],
        "",
        "## `rollouts run` files",
        "",
        "`rollouts run --config run.toml` reads every option from a TOML file (flags override it;",
        "`--print-config` prints the resolved file). Its sections besides `[plane]`:",
        "",
    ]
    sections = (
        ("run", "the batch to run and where its results go"),
        ("servers", "the inference endpoints, or the bundled stand-in's settings when there are none"),
        ("sampling", "`SamplingConfig`: what each model call samples with"),
        ("renderer", "`RendererConfig`: which renderer a token-mode rollout uses"),
    )
    fields = RunConfig.model_fields
    for name, what in sections:
        model = _model_in(fields[name].annotation)
        assert model is not None, name
        rows = leaves(model, getattr(run, name), f"{name}.")
        out += [f"### `[{name}]`: {what}", "", *table(rows), ""]
    out += [
        "### `[client]`: the per-rollout transport budget",
        "",
        "`ClientConfig`'s fields but those `[servers]` decides ("
        + ", ".join(f"`{f}`" for f in CLIENT_PER_SERVER)
        + "), with `ClientConfig`'s defaults:",
        "",
        *table([Leaf(f"client.{leaf.path}", leaf.type, leaf.default, leaf.doc) for leaf in client]),
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reference())
