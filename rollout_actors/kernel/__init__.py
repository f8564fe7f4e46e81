"""The kernel: what all three packages share, and nothing else.

It imports nothing of the project, so `renderer_actors` and `env_actors` import it (and only it) from
`rollout_actors` without depending on the rest (docs/design.md, "Dependency direction"). It holds ids, the
exact-JSON model config, `Ref` with its allowlist (code named by data, resolved on the side that runs it),
and re-exports the failure type with secret redaction (`failure`) and the caller error (`faults`). Four small modules beside it hold the other shared machinery, and like it
import nothing else of the project: `supervision` (the restart kit and liveness rule every supervisor
uses), `coalescer` (the per-event-loop batching of a tick's actor calls, renderer and env calls alike),
`collector` (how our actor processes collect garbage) and `metric` (metrics declared where they are
recorded, exported through Ray).

Naming code is a capability, so two checks guard it, both owned by the side that resolves:

- the module allowlist (`RefResolver(allowed_prefixes)`), fixed when the resolver is built: nothing in a
  request can reach, pass or widen it;
- the target must be *meant* to be named: a class or function marked with `@ref_target` (an
  `Environment` subclass inherits the mark), defined in an allowed module. A resolver function, `os.system`
  re-exported by an allowed module, or any other callable that happens to be importable is refused.
"""

from __future__ import annotations

import importlib
import inspect
import math
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The failure as data, then the exceptions it is the data of: both import only kernel modules below this
# one, never this module, and are re-exported so `from rollout_actors.kernel import X` works for every side.
from rollout_actors.kernel.failure import (  # noqa: F401
    MIN_SECRET_LEN,
    REDACTED,
    Failure,
    FaultName,
    How,
    Loss,
    Part,
    redact,
    register_secret,
)
from rollout_actors.kernel.faults import CallerError, Fault  # noqa: F401

JSON = Any
"""A JSON value: scalars, lists, dicts (and, inside `Ref.config`, nested Refs)."""

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("env_actors.examples.", "env_actors.adapters.")
"""What a user runs by default: the bundled example environments and the adapters (which import a user's
package only within their pool's own `env_packages`). Widening it is explicit config."""

MAX_CONFIG_DEPTH = 32  # JSON nesting a Ref config may have; deeper is an attack or a bug, not a config
MAX_REF_DEPTH = 8  # Refs nested inside Refs
REF_ROLE_ATTR = "__ray_rollouts_ref__"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


_owner: str | None = None


def process_owner() -> str | None:
    """The id of the Ray actor this code runs in, or None outside one (a driver, a test). Pools tag what
    they hand out (env sessions, renderer slots) with it, so when the plane loses that actor (a rollout
    worker) it can have everything the actor held released at once (`release_owned`, `close_owned`)."""
    global _owner
    if _owner is None:
        try:
            import ray  # the kernel imports nothing of the project; Ray is the engine, not the project

            if not ray.is_initialized():  # asking the runtime context would start a local Ray
                return None
            _owner = ray.get_runtime_context().get_actor_id()
        except Exception:
            return None
    return _owner


EXACT_JSON = ConfigDict(ser_json_inf_nan="constants")
"""For models whose JSON must read back exactly: a result and its parts cross Ray as their JSON
(`RolloutWorker.run`). A non-finite float (a `-inf` logprob some server sent, a NaN in leniently parsed
tool arguments) is written as `-Infinity` / `NaN`, which pydantic reads back, not as `null`, which a float
field refuses. `rollouts run` writes the same JSON."""

# --------------------------------------------------------------------------------------------- Refs


class Ref(BaseModel):
    """Names code on the far side: `Ref("package.module:attr", {json config})`, the config passed as
    keyword arguments. Config values are JSON scalars, lists, dicts or nested Refs; a nested Ref is
    resolved (and called) before the outer target is called with it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    """`"package.module:attr"`: a class or function marked `@ref_target`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the target; JSON values and nested Refs only."""

    def __init__(self, target: str | None = None, config: dict[str, Any] | None = None, **data: Any):
        if target is not None:
            data["target"] = target
        if config is not None:
            data["config"] = config
        super().__init__(**data)

    @field_validator("target")
    @classmethod
    def _target_shape(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if (
            len(value) > 300
            or not sep
            or not attr.isidentifier()
            or not all(p.isidentifier() for p in module.split("."))
        ):
            raise ValueError(f"Ref target must look like 'package.module:attr', got {value[:100]!r}")
        return value

    @field_validator("config", mode="before")
    @classmethod
    def _config_is_json(cls, value: Any) -> Any:
        check_json(value, "config")
        return value


def is_ref_dict(value: Any) -> bool:
    """A dict spelled like a Ref (`{"target": ..., "config": ...}`) inside a config is a nested Ref."""
    return isinstance(value, dict) and "target" in value and set(value) <= {"target", "config"}


def check_json(value: Any, where: str, depth: int = 0) -> None:
    """Refuse (ValueError) anything in a config that is not JSON or a Ref, or that nests absurdly deep."""
    if not _plain_json(value, depth):
        _check_json_exactly(value, where, depth)


def _plain_json(value: Any, depth: int) -> bool:
    """Whether `value` is JSON of the built-in types alone within the depth limit: the common case (every
    env step's messages), walked without building a path per node. False hands it to the exact walk,
    which names what is wrong, or accepts what only it knows (subclasses of the types, Refs)."""
    if depth > MAX_CONFIG_DEPTH:
        return False
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not _plain_json(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:
            if not _plain_json(item, depth + 1):
                return False
        return True
    return False


def _check_json_exactly(value: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_CONFIG_DEPTH} levels")
    if value is None or isinstance(value, (str, int, bool, Ref)):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{where}: {value} is not a JSON number")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json_exactly(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings, got {key!r}")
            _check_json_exactly(item, f"{where}.{key}", depth + 1)
        return
    raise ValueError(f"{where}: {type(value).__name__} is not JSON; name code with a Ref instead")


def ref_target(role: str = "part"):
    """Mark a class or function as meant to be named by a `Ref`. `Environment` carries
    `role="environment"` and its subclasses inherit it; helpers an environment takes as nested Refs
    (graders, tools) are marked `@ref_target()` one by one."""

    def mark(obj: Any) -> Any:
        setattr(obj, REF_ROLE_ATTR, role)
        return obj

    return mark


def ref_role(obj: Any) -> str | None:
    if inspect.isclass(obj):
        return getattr(obj, REF_ROLE_ATTR, None)
    if inspect.isfunction(obj):
        return obj.__dict__.get(REF_ROLE_ATTR)  # functions inherit nothing: marked here or not at all
    return None


def _under(module_name: str, prefixes: tuple[str, ...]) -> bool:
    return any(module_name == p.rstrip(".") or module_name.startswith(p) for p in prefixes)


class RefResolver:
    """Resolves Refs against an allowlist fixed at construction, on the side that runs the code.

        resolver = RefResolver(("env_actors.examples.",))
        env = resolver.resolve(ref, role="environment")

    `CallerError` for a target outside the allowlist, not meant to be named, missing, or whose config
    it rejects: those are the requester's mistakes. Nothing is imported before the allowlist check.
    """

    def __init__(self, allowed_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES) -> None:
        self._prefixes = tuple(allowed_prefixes)

    @property
    def allowed_prefixes(self) -> tuple[str, ...]:
        return self._prefixes

    def check_allowed(self, target: str) -> None:
        """Refuse a target whose module is outside the allowlist, without importing anything."""
        if not _under(target.partition(":")[0], self._prefixes):
            raise CallerError(
                f"Ref {target!r} is outside the allowlist {list(self._prefixes)}; widen it explicitly "
                "(allowed_ref_prefixes) to run code from other packages"
            )

    def load(self, target: str, role: str | None = None) -> Any:
        """Import the target and check it is meant to be named (and, with `role`, that it has that role)."""
        self.check_allowed(target)
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise CallerError(f"Ref {target!r}: cannot import {module_name!r}: {exc}") from exc
        obj = getattr(module, attr, None)
        if obj is None:
            raise CallerError(f"Ref {target!r}: module {module_name!r} has no attribute {attr!r}")
        defined_in = getattr(obj, "__module__", None) or ""
        found_role = ref_role(obj)
        if found_role is None or not _under(defined_in, self._prefixes):
            raise CallerError(
                f"Ref {target!r} names something that is not meant to be named: only environments and "
                "their parts marked @ref_target, defined in an allowed module, can be"
            )
        if role is not None and found_role != role:
            raise CallerError(f"Ref {target!r} is a {found_role}, not an {role}")
        return obj

    def resolve(self, ref: Ref | dict[str, Any], role: str | None = None, _depth: int = 0) -> Any:
        """Load `ref.target` and call it with its config, nested Refs resolved first."""
        if _depth > MAX_REF_DEPTH:
            raise CallerError(f"Refs nested deeper than {MAX_REF_DEPTH} levels")
        try:
            ref = Ref.model_validate(ref) if isinstance(ref, dict) else ref
        except ValueError as exc:
            raise CallerError(f"invalid Ref: {exc}") from exc
        target = self.load(ref.target, role)
        kwargs = {key: self._value(value, _depth) for key, value in ref.config.items()}
        try:
            return target(**kwargs)
        except TypeError as exc:
            raise CallerError(f"Ref {ref.target} rejected its config: {exc}") from exc

    def _value(self, value: Any, depth: int) -> Any:
        if isinstance(value, Ref) or is_ref_dict(value):
            return self.resolve(value, None, depth + 1)
        if isinstance(value, list):
            return [self._value(v, depth) for v in value]
        if isinstance(value, dict):
            return {k: self._value(v, depth) for k, v in value.items()}
        return value
