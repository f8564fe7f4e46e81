"""`InferenceServer`: a Ray actor that runs one OpenAI-compatible server as a supervised subprocess.

    server = InferenceServer.options(**server_actor_options(spec)).remote(spec)
    status = await server.start.remote()      # ServerStatus; ready means /health and /v1/models answered
    raise_for_startup(status)                 # ServerStartupError with the exit code and the log tail
    status = await server.watch.remote(30.0)  # returns at the server's death, or after 30 s

On a GPU node the subprocess is `vllm serve MODEL --tensor-parallel-size N ...` with the N GPUs Ray
assigned to this actor (Ray sets CUDA_VISIBLE_DEVICES for the actor; the child inherits it). On CPU it
is the bundled stand-in. The actor answers with `ServerStatus` data, never by raising across the Ray
boundary; replacing a dead server is the job of `InferenceServerSet`, which owns these actors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, NamedTuple

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_actors.inference.standin.launch import StandinOptions, _child_env
from rollout_actors.kernel import register_secret
from rollout_actors.kernel.renamed import renamed_fields
from rollout_actors.policy.lora import VLLM_LORA_RANKS, AdapterLimits
from rollout_actors.rollout.client import auth_headers

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

GPU_NODE_RESOURCE = "inference_gpu"
"""Custom resource the GPU node type of cluster.yaml offers, one unit per GPU: vLLM actors land there."""
LOG_TAIL_BYTES = 4000  # enough for a Python traceback or vLLM's last error lines, small enough to quote
POLL_INTERVAL = 0.1  # seconds between process checks: a death is seen within this
READY_POLL = 0.2  # seconds between readiness probes during startup
STOP_GRACE = 10.0  # SIGTERM, then SIGKILL: vLLM needs a few seconds to release its GPU workers

ServerState = Literal["created", "starting", "ready", "dead", "stopped"]


class ServerSpec(BaseModel):
    """What to run. Defaults are production ones (vLLM); tests choose `kind="standin"`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["vllm", "standin"] = "vllm"
    model: str
    """Model to serve (HF name or path); for the stand-in, the tokenizer model it samples from."""
    host: str | None = None
    """Interface to bind; None: this node's IP (reachable from the other nodes, not 0.0.0.0)."""
    port: int | None = None
    """None: a free port on the node, chosen at start."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    tool_call_parser: str | None = "auto"
    """`--tool-call-parser` (with `--enable-auto-tool-choice`): without it vLLM answers every chat request
    that carries `tools` with a 400. "auto": the model family's parser (`model_family`); None: no tool
    parsing (token mode parses tools itself and does not need it)."""
    reasoning_parser: str | None = "auto"
    """`--reasoning-parser`: splits the think block into `reasoning`. "auto": the family's; None: off."""
    enable_lora: bool = True
    """vLLM: `--enable-lora` plus runtime load/unload, which policy publication needs."""
    max_lora_rank: int = 64
    """`--max-lora-rank`; vLLM accepts only 1, 8, 16, 32, 64, 128, 256, 320, 512."""
    lora_retain: int = Field(default=4, ge=1)
    """Adapters the publisher keeps loaded (`PolicyPublisher.retain`)."""
    lora_in_use: int = Field(default=2, ge=0)
    """Older adapters still sampled by rollouts in flight, beyond `lora_retain` (off-policy staleness)."""
    max_loras: int | None = None
    """`--max-loras`: adapters one batch can hold. vLLM's default is 1: a request for another adapter
    waits while one runs, so the newest policy starves behind old-version rollouts. None: `lora_retain +
    lora_in_use`, every adapter the publisher can have in use at once."""
    max_cpu_loras: int | None = None
    """`--max-cpu-loras` (>= max_loras): adapters cached in CPU memory. None: twice `max_loras`, so a
    switch never reloads a retained adapter from disk."""
    api_key_var: str | None = None
    """Environment variable (on the server's node) holding the API key. The server gets it as
    `VLLM_API_KEY` in its environment, never on its command line or in a log; every call the project
    makes to it (readiness, LoRA load/unload, pause/resume, weight updates, metrics) sends it."""
    weight_updates: bool = True
    """Serve vLLM's pause/resume and weight-update routes (`VLLM_SERVER_DEV_MODE=1`), which
    `RolloutPlane.update_weights` uses."""
    per_request_metrics: bool = True
    """`--enable-per-request-metrics`: every response carries vLLM's own timing of it, of which the plane
    records the queue time per turn (`Turn.timings.queue_s`)."""
    weight_transfer_backend: str = "nccl"
    """`--weight-transfer-config {"backend": ...}`: how a trainer sends full weights (vLLM's
    `WeightTransferConfig`: nccl, ipc, ...)."""
    generation_config: str = "vllm"
    """`--generation-config`. "vllm": the model's `generation_config.json` is ignored, so the request's
    sampling (and vLLM's neutral defaults for what it leaves out: no top-k, no repetition penalty) is the
    behaviour policy the result records. vLLM's own default ("auto") fills unset fields from the model
    (Qwen3: top_k=20) without the request or the result saying so."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """`--logprobs-mode`. "processed_logprobs": `Turn.logprobs` are under the distribution sampled from
    (after temperature, top-k, top-p), which importance ratios need; vLLM's default returns the raw
    model's logprobs."""
    extra_args: list[str] = Field(default_factory=list)
    """Appended verbatim to the server's command line."""
    standin: dict[str, Any] = Field(default_factory=dict)
    """Stand-in only: `StandinOptions` fields (latency_s, seed, fault_rate, ...)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for the subprocess (no secrets: name them in the server's own config)."""
    ready_timeout_s: float = 900.0
    """Seconds from launch to ready: downloading and loading a large model takes minutes."""
    probe_interval_s: float = 10.0
    """After startup, seconds between /health checks."""
    probe_timeout_s: float = 10.0
    """Seconds one /health check may take before it counts as failed."""
    unhealthy_after: int = 3
    """Consecutive failed /health checks before the server counts as wedged and is killed."""
    num_cpus: float = 1.0
    """CPUs Ray reserves for the actor (the server's own CPU work happens in the subprocess)."""

    _renamed = model_validator(mode="before")(
        renamed_fields(
            {
                "startup_timeout_s": "ready_timeout_s",
                "health_interval_s": "probe_interval_s",
                "health_timeout_s": "probe_timeout_s",
            }
        )
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {VLLM_LORA_RANKS} (vLLM's MaxLoRARanks), got {value}"
            )
        return value

    @model_validator(mode="after")
    def _lora_sizes(self) -> ServerSpec:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.lora_slots:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.lora_slots})")
        return self

    @model_validator(mode="after")
    def _known_family(self) -> ServerSpec:
        if "auto" in (self.tool_call_parser, self.reasoning_parser) and model_family(self.model) is None:
            raise ValueError(
                f"no parser family is known for model {self.model!r} (MODEL_FAMILIES): set tool_call_parser "
                "and reasoning_parser explicitly (a parser name vLLM registers, or None). Qwen3's would be "
                "wrong for it: vLLM's qwen3 reasoning parser refuses a tokenizer without think tokens."
            )
        return self

    @property
    def lora_slots(self) -> int:
        """`--max-loras` as launched."""
        return self.max_loras if self.max_loras is not None else self.lora_retain + self.lora_in_use

    @property
    def parsers(self) -> tuple[str | None, str | None]:
        """(tool-call parser, reasoning parser) as launched, "auto" resolved by model family."""
        family = model_family(self.model) or ModelFamily(None, None)  # "auto" needs a family (validated)
        tool = family.tool_call_parser if self.tool_call_parser == "auto" else self.tool_call_parser
        reasoning = family.reasoning_parser if self.reasoning_parser == "auto" else self.reasoning_parser
        return tool, reasoning

    def adapter_limits(self) -> AdapterLimits:
        """What an adapter must satisfy to load on these servers (checked before publication)."""
        return AdapterLimits(max_lora_rank=self.max_lora_rank)


class ModelFamily(NamedTuple):
    tool_call_parser: str | None
    reasoning_parser: str | None


MODEL_FAMILIES: dict[str, ModelFamily] = {
    # Parser names registered in vLLM 0.33.0 (`vllm/tool_parsers/__init__.py`, `vllm/reasoning/__init__.py`).
    "qwen3-coder": ModelFamily("qwen3_coder", None),
    "qwen3": ModelFamily("hermes", "qwen3"),  # Qwen3's <tool_call> JSON and <think> blocks
    "qwq": ModelFamily("hermes", "deepseek_r1"),
    "qwen2.5": ModelFamily("hermes", None),
    "deepseek-r1": ModelFamily(None, "deepseek_r1"),
    "llama-3": ModelFamily("llama3_json", None),
}
"""Lower-cased substrings of a model name, most specific first. A model none of them names has no
family: `ServerSpec` then needs its parsers set explicitly (tests check every name here is registered in
vLLM and that the launched command parses with vLLM's own `serve` parser)."""


def model_family(model: str) -> ModelFamily | None:
    name = model.lower()
    return next((family for key, family in MODEL_FAMILIES.items() if key in name), None)


class ServerStatus(BaseModel):
    state: ServerState
    url: str | None = None
    """OpenAI base URL (`http://host:port/v1`), set once the port is known."""
    pid: int | None = None
    exit_code: int | None = None
    reason: str | None = None
    """Why the server is not ready: startup failure, death, wedge."""
    log_tail: str = ""
    log_path: str | None = None
    """The full log on the server's node; removed by `close()` (the tail stays here)."""
    node_ip: str | None = None
    started_at: float | None = None
    ready_at: float | None = None
    died_at: float | None = None


class ServerStartupError(RuntimeError):
    """The server did not become ready: it exited (exit code and log tail quoted) or missed its deadline."""

    def __init__(self, status: ServerStatus):
        self.status = status
        code = f" (exit code {status.exit_code})" if status.exit_code is not None else ""
        super().__init__(
            f"inference server failed to start{code}: {status.reason}\n--- log tail ---\n{status.log_tail}"
        )


def raise_for_startup(status: ServerStatus) -> ServerStatus:
    if status.state != "ready":
        raise ServerStartupError(status)
    return status


def server_actor_options(spec: ServerSpec) -> dict[str, Any]:
    """Ray actor options for `spec`: vLLM asks for its GPUs and the GPU nodes' custom resource."""
    options: dict[str, Any] = {"num_cpus": spec.num_cpus, "max_restarts": 0, "max_concurrency": 64}
    if spec.kind == "vllm":
        tp = spec.tensor_parallel_size
        options.update(num_gpus=tp, resources={GPU_NODE_RESOURCE: tp})
    return options


def vllm_command(spec: ServerSpec, host: str, port: int) -> list[str]:
    """`vllm serve` through this actor's interpreter (the console script may not be on PATH)."""
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", spec.model]
    command += ["--host", host, "--port", str(port), "--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.tensor_parallel_size > 1:
        # The GPUs are the ones Ray gave this actor: keep vLLM's workers local, not a Ray placement group.
        command += ["--distributed-executor-backend", "mp"]
    command += ["--generation-config", spec.generation_config, "--logprobs-mode", spec.logprobs_mode]
    command += _parser_args(spec) + _lora_args(spec)
    if spec.weight_updates:
        command += ["--weight-transfer-config", json.dumps({"backend": spec.weight_transfer_backend})]
    if spec.per_request_metrics:
        command += ["--enable-per-request-metrics"]
    return command + list(spec.extra_args)


def _parser_args(spec: ServerSpec) -> list[str]:
    tool, reasoning = spec.parsers
    args = ["--enable-auto-tool-choice", "--tool-call-parser", tool] if tool else []
    return args + (["--reasoning-parser", reasoning] if reasoning else [])


def _lora_args(spec: ServerSpec) -> list[str]:
    if not spec.enable_lora:
        return []
    cpu = spec.max_cpu_loras if spec.max_cpu_loras is not None else 2 * spec.lora_slots
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(spec.max_lora_rank),
        "--max-loras",
        str(spec.lora_slots),
        "--max-cpu-loras",
        str(cpu),
    ]


def vllm_env(spec: ServerSpec) -> dict[str, str]:
    """The vLLM server's environment additions (the API key comes from `_api_key_env`)."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if spec.enable_lora else {}
    if spec.weight_updates:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # serves /pause, /resume and the weight-update routes
    return env | dict(spec.env)


def _api_key_env(spec: ServerSpec) -> dict[str, str]:
    """`VLLM_API_KEY` for the server (vLLM's own variable; the stand-in reads it too), taken from
    `api_key_var` on this node: on no command line, in no log."""
    if spec.api_key_var is None:
        return {}
    key = os.environ.get(spec.api_key_var)
    if not key:
        raise ValueError(f"environment variable {spec.api_key_var!r} (api_key_var) is not set on this node")
    register_secret(key)
    return {"VLLM_API_KEY": key}


def standin_command(spec: ServerSpec, host: str, port: int, port_file: Path) -> list[str]:
    """The bundled stand-in (`launch.StandinOptions` flags). Port 0: it binds a free port itself and
    writes it to `port_file`, so no other process can take the port between choosing and binding."""
    command = [sys.executable, "-m", "rollout_actors.inference.standin", "--host", host]
    command += ["--port", str(port), "--port-file", str(port_file), "--parent-pid", str(os.getpid())]
    return command + standin_options(spec).to_argv() + list(spec.extra_args)


def standin_options(spec: ServerSpec, **overrides: Any) -> StandinOptions:
    """The stand-in started with what `spec` gives a vLLM server (parsers, LoRA limits, weight-update
    routes), so it is exactly as strict; `spec.standin` and `overrides` add stand-in-only settings."""
    tool, reasoning = spec.parsers
    lora: dict[str, Any] = {}
    if spec.enable_lora:
        cpu = spec.max_cpu_loras if spec.max_cpu_loras is not None else 2 * spec.lora_slots
        lora = dict(
            enable_lora=True, max_lora_rank=spec.max_lora_rank, max_loras=spec.lora_slots, max_cpu_loras=cpu
        )
    settings = dict(
        model=spec.model,
        enable_auto_tool_choice=tool is not None,
        tool_call_parser=tool,
        reasoning_parser=reasoning,
        weight_updates=spec.weight_updates,
        weight_transfer_backend=spec.weight_transfer_backend,
        enable_per_request_metrics=spec.per_request_metrics,
        **lora,
    )
    return StandinOptions(**(settings | spec.standin | overrides))


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


DIE_WITH_PARENT = [
    sys.executable,
    "-c",
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit(137); os.execvp(sys.argv[2], sys.argv[2:])",
]
"""Prefix for the server's command: if the actor's process dies (ray.kill, node OOM) the kernel kills the
server too, instead of leaving an orphan that holds the GPU and the port. It survives the exec, and
it is set in the child itself, because `preexec_fn` is unsafe in a process with threads (a Ray worker)."""


@ray.remote
class InferenceServer:
    """One supervised server subprocess. Methods answer with `ServerStatus`; none raises by design."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self._status = ServerStatus(state="created")
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self._port_file = Path()
        self._final_tail = ""
        self._url_host = "127.0.0.1"
        self._exited = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> ServerStatus:
        """Launch and wait until ready or `ready_timeout_s`; a failure stops the process and is reported."""
        if self._status.state != "created":
            return self._status
        spec = self.spec
        node_ip = ray.util.get_node_ip_address()
        host = spec.host or node_ip
        log_dir = Path(tempfile.mkdtemp(prefix="inference-server-"))
        self._log_path = log_dir / "server.log"
        self._port_file = log_dir / "port"
        try:
            key_env = _api_key_env(spec)
        except ValueError as exc:
            self._status = ServerStatus(state="dead", reason=str(exc), node_ip=node_ip)
            return self._status
        if spec.kind == "vllm":
            port: int | None = spec.port or free_port(host)
            command, env = vllm_command(spec, host, port), os.environ | vllm_env(spec) | key_env
        else:
            port = spec.port  # None: the stand-in reports the port it bound in the port file
            command = standin_command(spec, host, port or 0, self._port_file)
            env = _child_env() | key_env | spec.env
        with open(self._log_path, "wb") as log:
            # A file, not a pipe: a chatty server can never block on a full pipe buffer we stopped reading.
            self._process = subprocess.Popen(
                [*DIE_WITH_PARENT, str(os.getpid()), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: close() takes vLLM's workers with it
            )
        self._url_host = node_ip if host in ("0.0.0.0", "::") else host
        self._status = ServerStatus(
            state="starting",
            url=self._url(port) if port else None,
            pid=self._process.pid,
            node_ip=node_ip,
            log_path=str(self._log_path),
            started_at=time.time(),
        )
        self._watcher = asyncio.create_task(self._watch_process())
        await self._wait_ready()
        return self.status()

    def status(self) -> ServerStatus:
        if self._status.state in ("dead", "stopped") or self._status.reason:
            return self._status.model_copy(update={"log_tail": self._log_tail()})
        return self._status

    async def watch(self, timeout: float) -> ServerStatus:
        """Return when the server dies, or after `timeout` seconds with its current status."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._exited.wait(), timeout)
        return self.status()

    async def close(self) -> ServerStatus:
        """Stop the server (SIGTERM to its process group, SIGKILL after a grace period)."""
        if self._process is not None and self._process.poll() is None:
            if self._status.state != "dead":
                self._status = self._status.model_copy(update={"state": "stopped", "reason": "stopped"})
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._exited.wait(), STOP_GRACE)
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                await asyncio.wait_for(self._exited.wait(), STOP_GRACE)
        elif self._status.state != "dead":
            self._status = self._status.model_copy(update={"state": "stopped"})
        if self._watcher is not None:
            self._watcher.cancel()
        final = self.status()
        if self._log_path is not None:
            # The status keeps the log tail; the directory would otherwise pile up in /tmp per restart.
            self._final_tail = final.log_tail
            shutil.rmtree(self._log_path.parent, ignore_errors=True)
        return final

    # ------------------------------------------------------------------------------------ internal

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        headers = auth_headers(self.spec.api_key_var)  # /v1/models is guarded when the server has a key
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0), trust_env=False, headers=headers) as client:
            while not self._exited.is_set():
                if time.monotonic() > deadline:
                    self._fail(f"not ready within ready_timeout_s={self.spec.ready_timeout_s:g}s")
                    self._signal_group(signal.SIGKILL)
                    with contextlib.suppress(TimeoutError):  # let the watcher record the exit code
                        await asyncio.wait_for(self._exited.wait(), STOP_GRACE)
                    return
                if self._status.url is None and self._port_file.exists():
                    self._status = self._status.model_copy(
                        update={"url": self._url(int(self._port_file.read_text()))}
                    )
                root = (self._status.url or "").removesuffix("/v1")
                if (
                    root
                    and await _answers(client, f"{root}/health")
                    and await _answers(client, f"{root}/v1/models")
                ):
                    self._status = self._status.model_copy(update={"state": "ready", "ready_at": time.time()})
                    return
                await asyncio.sleep(READY_POLL)
        # The watcher saw the process exit during startup: its status already carries the exit code.

    async def _watch_process(self) -> None:
        """Owned by the actor: sees the exit within POLL_INTERVAL, and kills a wedged server."""
        assert self._process is not None
        failures, next_check = 0, time.monotonic() + self.spec.probe_interval_s
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(self.spec.probe_timeout_s),
            trust_env=False,
            headers=auth_headers(self.spec.api_key_var),  # /health is unguarded on vLLM; a proxy may not be
        ) as client:
            while (code := self._process.poll()) is None:
                await asyncio.sleep(POLL_INTERVAL)
                if self._status.state != "ready" or time.monotonic() < next_check:
                    continue
                root = (self._status.url or "").removesuffix("/v1")
                failures = 0 if await _answers(client, f"{root}/health") else failures + 1
                next_check = time.monotonic() + self.spec.probe_interval_s
                if failures >= self.spec.unhealthy_after:
                    self._fail(f"wedged: /health failed {failures} times in a row; killed")
                    self._signal_group(signal.SIGKILL)
        if self._status.state == "stopped":
            self._status = self._status.model_copy(update={"exit_code": code, "died_at": time.time()})
        else:
            phase = "during startup" if self._status.state == "starting" else "after startup"
            reason = self._status.reason or f"process exited {phase} with code {code}"
            self._fail(reason, exit_code=code)
        self._exited.set()

    def _url(self, port: int) -> str:
        host = f"[{self._url_host}]" if ":" in self._url_host else self._url_host
        return f"http://{host}:{port}/v1"

    def _fail(self, reason: str, exit_code: int | None = None) -> None:
        update: dict[str, Any] = {"state": "dead", "reason": reason, "died_at": time.time()}
        if exit_code is not None:
            update["exit_code"] = exit_code
        self._status = self._status.model_copy(update=update)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, sig)

    def _log_tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return self._final_tail
        with open(self._log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return log.read().decode("utf-8", errors="replace")


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False
