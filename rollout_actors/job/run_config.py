"""`RunConfig`: everything `rollouts run` can be told, as one typed object, from a TOML file and flags.

    rollouts run --config run.toml --concurrency 128     # flags override the file
    rollouts run --config run.toml --print-config        # the resolved configuration, as TOML

Sections: `[run]` (what to run and where results go), `[servers]` (inference endpoints, or the bundled
stand-in's settings when there are none), `[client]` (the per-rollout transport budget), `[sampling]`,
`[renderer]`, `[plane]` (lanes, workers, `[plane.env_pool]`, `[plane.renderer_pool]`). Every section
refuses unknown keys, and an error names the key by its path (`plane.env_pool.min_workres`).
`scripts/run.example.toml` lists every key with its default.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from renderer_actors.config import RendererConfig
from rollout_actors.kernel import JSON
from rollout_actors.kernel.renamed import renamed_fields
from rollout_actors.plane.config import PlaneConfig
from rollout_actors.wire import ClientConfig, RolloutMode, SamplingConfig

DEFAULT_ENV = "env_actors.examples.calculator_env:CalculatorEnv"
CLIENT_PER_SERVER = ("base_url", "model", "api_key_var")
"""`ClientConfig` fields that `[servers]` decides; `[client]` holds the rest (timeouts, retries, limits)."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JobSettings(_Section):
    """`[run]`: the batch to run and where its results go."""

    env: str = DEFAULT_ENV
    """Environment Ref target, `package.module:Class` (under the plane's allowlist)."""
    env_config: dict[str, JSON] = Field(default_factory=dict)
    tasks: int = Field(default=64, ge=1)
    """Task indices 0..tasks-1, one group each."""
    group_size: int = Field(default=4, ge=1)
    max_turns: int = Field(default=4, ge=1)
    mode: RolloutMode = "token"
    """`agent`: the environment's own agent program drives the turns (an `AgentEnvironment`)."""
    timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    """Seconds each rollout may take (`RolloutRequest.timeout_s`; was `deadline_s`)."""
    seed: int = 0
    """Base sampling seed; each rollout of a task adds its index."""
    output: str | None = None
    """JSON-lines results file; default `rollouts-<time>.jsonl`."""
    messages: bool = False
    """Also write each conversation as chat messages (`RolloutRequest.return_messages`); the token ids
    already hold it, so lines grow by about the text of every message."""
    report_png: str | None = None
    """Write the run report's plots here at the end (see `rollouts report`)."""
    progress: bool = True
    """A live progress bar; off, a plain status line every few seconds (what `ray job logs` shows)."""
    max_failed_fraction: float = Field(default=0.0, ge=0, le=1)
    """The command exits 1 when more than this share of the rollouts failed (`cancelled` is no failure):
    by default any failure fails the command, as a CI step or a job should."""

    _renamed = model_validator(mode="before")(renamed_fields({"deadline_s": "timeout_s"}))
    ray_address: str | None = None
    """Join this Ray cluster; default `$RAY_ADDRESS`, else an embedded local Ray."""


class StandinSettings(_Section):
    """`[servers.standin]`: the bundled CPU stand-in, started only when `servers.endpoints` is empty."""

    latency_s: float = Field(default=0.05, ge=0)
    per_token_latency_s: float = Field(default=0.0005, ge=0)
    correct_rate: float = Field(default=0.7, ge=0, le=1)


class ServersSettings(_Section):
    """`[servers]`: where the model is served."""

    endpoints: list[str] = Field(default_factory=list)
    """OpenAI-compatible base URLs (a vLLM server's `/v1`); empty starts the bundled stand-in."""
    model: str | None = None
    """Served model name; required with endpoints (the stand-in serves the bundled model)."""
    api_key_var: str | None = None
    """Environment variable holding the API key on the worker nodes; the key itself never travels."""
    standin: StandinSettings = Field(default_factory=StandinSettings)


class RunConfig(_Section):
    run: JobSettings = Field(default_factory=JobSettings)
    servers: ServersSettings = Field(default_factory=ServersSettings)
    client: dict[str, JSON] = Field(default_factory=dict)
    """`ClientConfig` fields other than base URL, model and key variable (timeouts, retries, limits)."""
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(max_tokens=256))
    renderer: RendererConfig = Field(default_factory=RendererConfig)
    plane: PlaneConfig = Field(default_factory=lambda: PlaneConfig(lanes={"train": 64, "eval": 16}))

    @field_validator("client")
    @classmethod
    def _client_budget(cls, value: dict[str, Any]) -> dict[str, Any]:
        decided = sorted(set(value) & set(CLIENT_PER_SERVER))
        if decided:
            raise ValueError(f"{', '.join(decided)}: set under [servers], not [client]")
        unknown = sorted(set(value) - set(ClientConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(f'client.{k}' for k in unknown)}")
        try:
            ClientConfig(base_url="http://placeholder/v1", model="placeholder", **value)
        except ValidationError as exc:
            raise ValueError(_describe(exc, "client")) from None
        return value

    def client_config(self, base_url: str, model: str) -> ClientConfig:
        return ClientConfig(
            base_url=base_url, model=model, api_key_var=self.servers.api_key_var, **self.client
        )


class ConfigError(ValueError):
    """A configuration file or flag that does not validate; the message names each bad key by path."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []
        """(dotted path, what is wrong) per bad key, in the order pydantic found them."""


def _problems(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    return [
        (".".join(str(part) for part in ((prefix,) if prefix else ()) + tuple(error["loc"])), error["msg"])
        for error in exc.errors()
    ]


def _describe(exc: ValidationError, prefix: str = "") -> str:
    return "; ".join(f"{path}: {message}" for path, message in _problems(exc, prefix))


def load_run_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The file (if any) with `overrides` (dotted keys from flags) applied on top, validated."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
    for dotted, value in (overrides or {}).items():
        _set(data, dotted, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path or 'flags'}: {_describe(exc)}", _problems(exc)) from None


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a table in the config file")
        node = child
    node[leaf] = value


def to_toml(config: RunConfig) -> str:
    """The resolved configuration as TOML (tables after keys; `None` values left out: TOML has no null)."""
    lines: list[str] = []
    _emit(config.model_dump(mode="json"), [], lines)
    return "\n".join(lines).strip() + "\n"


INLINE_TABLES = frozenset({"env_config", "template_kwargs", "extra_body", "headers", "lanes", "resources"})
"""Free-form mappings: written inline (`lanes = {"train" = 64}`), not as `[section]` tables."""


def _emit(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    # Keys first (scalars and inline tables), then sub-tables: a key after a `[header]` would belong to it.
    keys = {
        k: v for k, v in table.items() if v is not None and (not isinstance(v, dict) or k in INLINE_TABLES)
    }
    tables = {k: v for k, v in table.items() if isinstance(v, dict) and k not in INLINE_TABLES}
    if path and (keys or not tables):
        lines.append(f"\n[{'.'.join(path)}]")
    for key, value in keys.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables.items():
        _emit(value, [*path, key], lines)


def _inline(value: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, float) or value == value else "nan"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return _inline(value)
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
