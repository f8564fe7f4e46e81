"""A verifiers v1 environment (0.4.x) served episode by episode for `rollouts serve-env`, by verifiers' code.

    Ref("env_actors.adapters.verifiers_serve:VerifiersServeEnv",
        {"env_config": {"taskset": {"id": "my-taskset"}, "agent": {"harness": {"id": "null"}}}})

`env_config` is verifiers' `EnvConfig` as a dict (what `vf-eval --env.*` and prime-rl's
`[orchestrator.train.source.env]` hold), narrowed by verifiers' own `resolve_env_config`. The taskset
and a harness that is not one of verifiers' built-ins pass the pool's `env_packages` gate before anything
is imported, as do the functions the taskset config plugs in. Load builds the environment with
`load_environment` and enters its `serving()` (interception, shared tool servers) for the server's life:
readiness means loaded (docs/design.md contract 8).

`serve_run` is verifiers' `EnvServer._run` and `_handle` for one `run` request, step for step: the
request's task rebuilt from its wire data, one slot, `run_slot` under verifiers' own `DeltaStreamer`, and
the `RunResponse` (or the `BaseResponse` of a failure) packed as verifiers packs it. Its frames are bytes
the front relays unopened, so the plane's interpreter never imports verifiers (0.4 needs `openai<3`).
This is not a plane `Environment` for reset/step/score: those are refused, as is a task by index (the
client owns the taskset and ships each task, as verifiers' server expects).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from env_actors.adapters import FrameworkLoop, PackageGate
from env_actors.adapters.verifiers_v1 import check_plugged, import_v1, plugin_module
from env_actors.interface import Environment, Message, Reset, ScoreOut, StepOut
from rollout_actors.kernel import CallerError

logger = logging.getLogger(__name__)

SERVING_START_TIMEOUT_S = 120.0  # verifiers' interception server and shared tool servers, at load

Send = Callable[[bytes], None]
"""Takes one packed delta frame; called on verifiers' loop, so it must be thread-safe and not block."""


class VerifiersServeEnv(Environment):
    def __init__(self, env_config: dict[str, Any]) -> None:
        if not isinstance(env_config, dict) or not isinstance(env_config.get("taskset"), dict):
            raise CallerError("env_config is verifiers' EnvConfig as a dict, with a `taskset` table")
        self._config = env_config
        self._taskset_id = str(env_config["taskset"].get("id") or "")
        self._gate = PackageGate()
        self._env: Any = None
        self._task_cls: Any = None
        self._data_cls: Any = None
        self._loop: FrameworkLoop | None = None
        self._serving = contextlib.AsyncExitStack()

    def allow_packages(self, prefixes: tuple[str, ...]) -> None:
        self._gate.allow(prefixes)

    def load(self) -> None:
        vf, loaders = import_v1()
        if not self._taskset_id:
            raise CallerError("env_config.taskset.id is empty: name the taskset to serve")
        self._gate.check(plugin_module(self._taskset_id))
        harness = ((self._config.get("agent") or {}).get("harness") or {}).get("id")
        if harness and harness not in loaders.builtin_harness_ids():
            self._gate.check(plugin_module(str(harness), "harnesses"))
        check_plugged(self._gate, self._config["taskset"])
        try:
            config = loaders.resolve_env_config(self._config)
        except ValueError as exc:  # pydantic's ValidationError: the config is not this taskset's
            raise CallerError(f"env_config is not a valid EnvConfig for {self._taskset_id}: {exc}") from exc
        self._env = vf.load_environment(config)
        self._task_cls = type(self._env.taskset).task_type()
        self._data_cls = self._task_cls.data_type()
        excluded = [name for name, field in self._data_cls.model_fields.items() if field.exclude]
        if excluded:  # verifiers' EnvServer refuses the same: the task would rebuild silently defaulted
            raise CallerError(f"{self._data_cls.__name__} excludes {excluded} from serialization")
        self._loop = FrameworkLoop(f"verifiers-serve-{self._taskset_id}")
        self._loop.run_sync(self._serving.enter_async_context(self._env.serving()), SERVING_START_TIMEOUT_S)

    async def serve_run(self, payload: bytes, send: Send) -> bytes:
        """One `run` request's packed payload -> its packed reply; its deltas go to `send` as they form.
        Never raises but `CancelledError`: a failed episode is a `success=False` reply, as verifiers'."""
        assert self._loop is not None, "serve_run before load"
        return await self._loop.run(self._handle(payload, send))

    async def _handle(self, payload: bytes, send: Send) -> bytes:
        import msgpack  # noqa: PLC0415
        from verifiers.v1.serve.encoding import msgpack_encoder  # noqa: PLC0415
        from verifiers.v1.serve.types import BaseResponse, RunRequest  # noqa: PLC0415

        try:
            response = await self._run(RunRequest.model_validate(msgpack.unpackb(payload, raw=False)), send)
        except Exception as e:  # verifiers' rule: a failed request is data, reported as its type and text
            logger.warning("serve-env run failed: %s", e, exc_info=True)
            response = BaseResponse(success=False, error=f"{type(e).__name__}: {e}")
        try:
            return msgpack.packb(
                response.model_dump(mode="python"), default=msgpack_encoder, use_bin_type=True
            )
        except Exception as e:
            failed = BaseResponse(success=False, error=f"{type(e).__name__}: {e}")
            return msgpack.packb(failed.model_dump(), use_bin_type=True)

    async def _run(self, req: Any, send: Send) -> Any:
        from verifiers.v1.clients import ModelContext  # noqa: PLC0415
        from verifiers.v1.serve.delta import DeltaStreamer, TraceSummary, dump, pack  # noqa: PLC0415
        from verifiers.v1.serve.types import RunResponse  # noqa: PLC0415

        ctx = ModelContext(client=req.client, model=req.model, sampling=req.sampling)
        task = self._task_cls(self._data_cls.model_validate(req.task_data), self._env.config.taskset.task)
        (slot,) = self._env.slots(task)

        async def send_delta(delta: dict) -> None:
            send(pack(delta))

        async with DeltaStreamer(lambda: slot.traces, send_delta) as streamer:
            episode = await self._env.run_slot(slot, ctx, None, on_trace=streamer.watch)
        return RunResponse(
            head=dump(episode, exclude={"traces"}),
            traces=[
                TraceSummary(id=trace.id, nodes=len(trace.nodes), calls=len(trace.calls))
                for trace in episode.traces
            ],
        )

    # The plane's session calls: this environment serves whole episodes only (`serve_run`).

    def num_tasks(self) -> int:
        return 0  # the client owns the taskset and ships each task with its run

    def task(self, index: int) -> dict[str, Any]:
        raise CallerError("a served verifiers environment takes its tasks from each run request")

    async def reset(self, task: dict[str, Any]) -> Reset:
        raise CallerError(_SERVE_ONLY)

    async def step(self, state: Any, assistant_message: Message) -> StepOut:
        raise CallerError(_SERVE_ONLY)

    async def score(self, state: Any) -> ScoreOut:
        raise CallerError(_SERVE_ONLY)


_SERVE_ONLY = (
    "VerifiersServeEnv runs whole episodes for `rollouts serve-env` (serve_run); for rollouts of the plane "
    "use verifiers_v1:VerifiersV1Env or verifiers_agent:VerifiersV1AgentEnv"
)
