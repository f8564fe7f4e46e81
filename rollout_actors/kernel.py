"""The kernel: what all three packages share, and nothing else.

It imports nothing of the project, so `renderer_actors` and `env_actors` import it (and only it) from
`rollout_actors` without depending on the rest (DESIGN.md, "Dependency direction"). It holds the failure
type, the caller error, ids, secret redaction, `Ref` with its allowlist (code named by data, resolved
on the side that runs it), the supervision kit every supervisor spends restarts from, and the
per-event-loop coalescer that batches a tick's worth of actor calls (renderer and env calls alike).

Naming code is a capability, so two checks guard it, both owned by the side that resolves:

- the module allowlist (`RefResolver(allowed_prefixes)`), fixed when the resolver is built: nothing in a
  request can reach, pass or widen it;
- the target must be *meant* to be named: a class or function marked with `@ref_target` (an
  `Environment` subclass inherits the mark), defined in an allowed module. A resolver function, `os.system`
  re-exported by an allowed module, or any other callable that happens to be importable is refused.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import threading
import time
import traceback as traceback_module
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

JSON = Any
"""A JSON value: scalars, lists, dicts (and, inside `Ref.config`, nested Refs)."""

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("env_actors.examples.",)
"""What a user runs by default: the bundled example environments. Widening it is explicit config."""

MAX_CONFIG_DEPTH = 32  # JSON nesting a Ref config may have; deeper is an attack or a bug, not a config
MAX_REF_DEPTH = 8  # Refs nested inside Refs
REF_ROLE_ATTR = "__ray_rollouts_ref__"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


_owner: str | None = None


def process_owner() -> str | None:
    """The id of the Ray actor this code runs in, or None outside one (a driver, a test). Pools tag what
    they hand out (env sessions, renderer leases) with it, so when the plane loses that actor (a rollout
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


class CallerError(ValueError):
    """The request itself is invalid (bad Ref, bad task, bad sampling args): a `caller` result."""


# ------------------------------------------------------------------------------------------ secrets

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_secret_pattern: re.Pattern[str] | None = None
REDACTED = "[redacted]"
MIN_SECRET_LEN = 6  # shorter values would redact ordinary words; a real key is far longer


def register_secret(value: str | None) -> None:
    """Remember a secret this process holds (an API key read from the environment): `redact` and every
    `Failure` built here blank it out, whatever echoed it (a server error body, a header in a traceback)."""
    global _secret_pattern
    if not value or len(value) < MIN_SECRET_LEN or value in _secrets:
        return
    with _secrets_lock:
        _secrets.add(value)
        ordered = sorted(_secrets, key=len, reverse=True)
        _secret_pattern = re.compile("|".join(re.escape(s) for s in ordered))


def redact(text: str | None) -> str | None:
    if not text or _secret_pattern is None:
        return text
    return _secret_pattern.sub(REDACTED, text)


# ------------------------------------------------------------------------------------------ failure


class Failure(BaseModel):
    """Why a request failed, classified on the side where it failed. Registered secrets never appear in it."""

    type: str
    """Exception type name, e.g. `APITimeoutError`, `ActorDiedError`, `CallerError`."""
    message: str
    status_code: int | None = None
    traceback: str | None = None
    """Traceback text from the failing side (Ray strips causes at actor boundaries)."""

    @model_validator(mode="after")
    def _redacted(self) -> Failure:
        if _secret_pattern is not None:
            self.message = redact(self.message) or ""
            self.traceback = redact(self.traceback)
        return self

    @classmethod
    def from_exception(cls, exc: BaseException, status_code: int | None = None) -> Failure:
        return cls(
            type=type(exc).__name__,
            message=str(exc) or type(exc).__name__,
            status_code=status_code,
            traceback="".join(traceback_module.format_exception(type(exc), exc, exc.__traceback__)),
        )


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
            check_json(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings, got {key!r}")
            check_json(item, f"{where}.{key}", depth + 1)
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


# -------------------------------------------------------------------------------------- supervision


class RestartIntensity(BaseModel):
    """Restart intensity, as declared data (Erlang/OTP): at most `max_restarts` restarts within any
    `window_s` seconds. Rare deaths over a long run fit inside the window and are tolerated; something that
    dies on every start spends it in seconds and its supervisor stops restarting it, loudly. Both fields
    are required: each supervisor declares its own default beside the reason for it, and a setting never
    silently takes half of a generic default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_restarts: int = Field(ge=0)
    window_s: float = Field(gt=0)

    def describe(self) -> str:
        return f"{self.max_restarts} restarts in {self.window_s:g} s"


@dataclass
class RestartBudget:
    """Spends a `RestartIntensity`. One edge rule everywhere: a restart counts for exactly `window_s`
    seconds after it was spent (at `t + window_s` it no longer does).

    >>> budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=60))
    >>> budget.try_spend(now=0.0), budget.try_spend(now=1.0), budget.try_spend(now=2.0)
    (True, True, False)
    >>> budget.try_spend(now=60.0)  # the first restart left the window
    True
    """

    intensity: RestartIntensity
    spent_total: int = 0
    """Restarts spent over the budget's whole life."""
    _spent: deque[float] = field(default_factory=deque, repr=False)

    def try_spend(self, now: float | None = None) -> bool:
        """Spend one restart if the window has room: True (and it counts), or False (nothing changes)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        if len(self._spent) >= self.intensity.max_restarts:
            return False
        self._spent.append(now)
        self.spent_total += 1
        return True

    def remaining(self, now: float | None = None) -> int:
        self._expire(time.monotonic() if now is None else now)
        return self.intensity.max_restarts - len(self._spent)

    def used(self, now: float | None = None) -> int:
        """Restarts counting against the window now."""
        return self.intensity.max_restarts - self.remaining(now)

    def spent_message(self) -> str:
        return f"restart budget spent ({self.intensity.describe()})"

    def _expire(self, now: float) -> None:
        while self._spent and now - self._spent[0] >= self.intensity.window_s:
            self._spent.popleft()


LossCause = Literal["died", "wedged"]
"""Why a supervisor lost a child: Ray said it *died* (a call or probe raised `RayActorError`), or nothing
showed it alive for its hang timeout: it is *wedged* (frozen, its event loop blocked, its node gone)."""


@dataclass
class Liveness:
    """One rule for every supervisor: a child is alive while something shows it alive, and wedged once
    nothing has for `hang_timeout_s`. A sign of life is an answer to `health()`, dated back by the
    `loop_stall_s` the child reports (an answer from a side loop says nothing of a stalled main loop).
    Time the supervisor itself could not listen (its own loop stalled) is excused, never held against
    the child: load alone must never look like a wedge.

    >>> life = Liveness(hang_timeout_s=10, last_alive=0.0)
    >>> life.heard(loop_stall_s=0.0, now=5.0); life.wedged(now=14.0), life.wedged(now=15.5)
    (False, True)
    >>> life.excuse(4.0, now=15.5); life.wedged(now=15.5)  # the supervisor was deaf for 4 s of that
    False
    """

    hang_timeout_s: float
    last_alive: float = field(default_factory=time.monotonic)

    def heard(self, loop_stall_s: float = 0.0, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_alive = max(self.last_alive, now - max(0.0, loop_stall_s))

    def excuse(self, deaf_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_alive = min(now, self.last_alive + max(0.0, deaf_s))

    def silent_s(self, now: float | None = None) -> float:
        return max(0.0, (time.monotonic() if now is None else now) - self.last_alive)

    def wedged(self, now: float | None = None) -> bool:
        return self.silent_s(now) > self.hang_timeout_s

    def verdict(self, now: float | None = None) -> str:
        return f"no sign of life for {self.silent_s(now):.1f} s (hang_timeout_s {self.hang_timeout_s:g} s)"


# ------------------------------------------------------------------------------------------ metrics

_instruments: dict[str, Any] = {}
_instruments_lock = threading.Lock()


class Metric(BaseModel):
    """One metric, declared where it is recorded and exported through Ray's metrics API
    (`ray.util.metrics`): it shows in the Ray dashboard and on every node's Prometheus endpoint as
    `ray_rollouts_<name>`. The instrument is created in each process on first use; recording never
    raises (a metric must not fail a rollout) and is a no-op outside a connected Ray worker."""

    model_config = ConfigDict(frozen=True)

    kind: str
    """`counter`, `gauge` or `histogram`."""
    name: str
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()
    """Histogram bucket upper bounds."""

    def record(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        try:
            instrument = _instruments.get(self.name) or self._create()
            if instrument is None:
                return
            if self.kind == "counter":
                instrument.inc(value, tags=tags)
            elif self.kind == "gauge":
                instrument.set(value, tags=tags)
            else:
                instrument.observe(value, tags=tags)
        except Exception:  # noqa: BLE001 - observability must never break the thing observed
            pass

    def _create(self) -> Any:
        import ray
        from ray.util import metrics

        if not ray.is_initialized():
            return None
        with _instruments_lock:
            if self.name not in _instruments:
                name, keys = f"rollouts_{self.name}", self.tag_keys
                if self.kind == "counter":
                    made = metrics.Counter(name, description=self.description, tag_keys=keys)
                elif self.kind == "gauge":
                    made = metrics.Gauge(name, description=self.description, tag_keys=keys)
                else:
                    made = metrics.Histogram(
                        name, description=self.description, boundaries=list(self.boundaries), tag_keys=keys
                    )
                _instruments[self.name] = made
            return _instruments[self.name]


LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


# ------------------------------------------------------------------------------ per-tick coalescing


@dataclass(slots=True)
class TickBatch:
    """What the callers of one event-loop tick asked of one target: items in order, one waiter each."""

    target: Any
    """What the flush calls (an actor handle)."""
    items: list[Any] = field(default_factory=list)
    waiters: list[asyncio.Future[Any]] = field(default_factory=list)
    deadline: float = 0.0
    """The largest deadline any caller gave (its meaning is the flush's: seconds or a loop time)."""


class TickCoalescer:
    """Coalesce a process's concurrent calls per event-loop tick: every caller that asks the same key in
    one tick joins one batch, flushed once by one owned task. A quiet loop flushes batches of one.

        coalescer = per_loop(TickCoalescer)
        waiter = coalescer.add(("step", actor_key(server)), server, call, flush_steps)
        answer = await waiter

    `flush(batch)` sends the batch and answers its waiters; if it raises, every waiter still waiting gets
    that exception. A waiter whose caller gave up is done (cancelled): the flush drops its answer.
    Futures belong to one loop, so each loop has its own (`per_loop`).
    """

    def __init__(self) -> None:
        self._open: dict[Any, TickBatch] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def add(self, key: Any, target: Any, item: Any, flush: Any, deadline: float = 0.0) -> asyncio.Future[Any]:
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = TickBatch(target)
            self.own(self._flush(key, flush))
        waiter = asyncio.get_running_loop().create_future()
        batch.items.append(item)
        batch.waiters.append(waiter)
        batch.deadline = max(batch.deadline, deadline)
        return waiter

    async def _flush(self, key: Any, flush: Any) -> None:
        await asyncio.sleep(0)  # every caller of this tick joins the batch
        batch = self._open.pop(key)
        try:
            await flush(batch)
        except BaseException as exc:  # the target died, or the batch outlived its deadline
            fail_all(batch.waiters, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    def own(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` as a task this coalescer holds until it ends (nothing fire-and-forget is lost)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def fail_all(waiters: list[asyncio.Future[Any]], exc: BaseException) -> None:
    """A batch failed as a whole: every waiter still waiting gets that failure. It is marked retrieved, so
    a waiter nobody awaits any more (a notice, a caller past its deadline) logs nothing."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(exc)
            waiter.exception()


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]] = weakref.WeakKeyDictionary()


def per_loop(factory: Any) -> Any:
    """The running loop's one instance of `factory` (built on first use, dropped with the loop)."""
    instances = _PER_LOOP.setdefault(asyncio.get_running_loop(), {})
    instance = instances.get(factory)
    if instance is None:
        instance = instances[factory] = factory()
    return instance


def actor_key(handle: Any) -> Any:
    """A key for an actor that is the same across copies of its handle."""
    to_hex = getattr(getattr(handle, "_actor_id", None), "hex", None)
    return to_hex() if callable(to_hex) else id(handle)
