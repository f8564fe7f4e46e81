"""The bundled stand-in inference server: vLLM's OpenAI-compatible wire format, served on CPU.

    python -m rollout_actors.inference.standin --host 127.0.0.1 --port 8000 \\
        [--model NAME] [--latency-s F] [--per-token-latency-s F] [--seed N] [--correct-rate F] \\
        [--think-rate F] [--noncanonical-rate F] [--fault-rate F --fault 500|timeout|drop|malformed]

Endpoints: `POST /v1/completions` (token-id or text prompt), `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health` (200 only once the tokenizer is loaded), `GET /metrics`, `POST /v1/load_lora_adapter`,
`POST /v1/unload_lora_adapter`, and with `--admin` (tests) `GET|POST /admin/faults`, `GET /admin/sessions`.
Answers come from the seeded `ScriptedPolicy`; latency is a fixed part plus a per-completion-token part,
slept without blocking the loop. Per request, headers override the server's settings:
`X-Standin-Fault`, `X-Standin-Fault-Rate` (see `standin.traffic`), `X-Standin-Latency` and
`X-Standin-Per-Token-Latency` (seconds), `X-Standin-Correct-Rate`, `X-Standin-Think-Rate`,
`X-Standin-Noncanonical-Rate`. `X-Session-ID` is recorded (`standin_sessions` in /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import random
import resource
import socket
import sys
import time
import zlib
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from renderer_actors.tokenizer import BUNDLED_MODEL, load_tokenizer
from rollout_actors.inference.standin.answers import Answer, Answers, Parsers, Plan, RequestError
from rollout_actors.inference.standin.control import admin_routes, lora_routes, weight_routes
from rollout_actors.inference.standin.engine import DEFAULT_VERSION, Engine, Slot
from rollout_actors.inference.standin.policy import PolicyConfig, ScriptedPolicy
from rollout_actors.inference.standin.traffic import FaultPlan, TrafficGate, TrafficStats, error_body
from rollout_actors.inference.standin.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    FaultKind,
    FaultSettings,
    ModelCard,
    ModelList,
    PerRequestMetrics,
)
from rollout_actors.policy.lora import VLLM_LORA_RANKS, AdapterLimits

log = logging.getLogger("rollout_actors.standin")

BACKLOG = 4096  # 2,048 concurrent rollouts connect at once; the kernel queue must hold them all
KEEP_ALIVE_S = 5  # clients keep idle connections for less (ClientConfig.keepalive_expiry_s = 4 s)
GRACEFUL_SHUTDOWN_S = 2  # a `timeout` fault never answers; shutdown must not wait for it
PARENT_POLL_S = 1.0
RECENT_REQUESTS = 10_000  # what `/admin/requests` remembers
RECENT_BODIES = 512  # `/admin/bodies`: raw bodies hold whole prompts, so far fewer than RECENT_REQUESTS
STANDIN_TOOL_PARSERS = ("hermes",)
STANDIN_REASONING_PARSERS = ("qwen3",)
"""The vLLM parsers `answers.parse_turn` reproduces (tests compare it with vLLM's own on canned turns); a
stand-in started with another would parse differently from the vLLM it stands in for, so it refuses."""
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
"""vLLM 0.33.0's answer (503, retryable) to a new request during an `abort` or `wait` pause; `keep` queues it."""
_POLICY_HEADERS = {
    "x-standin-correct-rate": "correct_rate",
    "x-standin-think-rate": "think_rate",
    "x-standin-noncanonical-rate": "noncanonical_rate",
}


@dataclass(frozen=True)
class StandinOptions:
    """Everything the stand-in server can be told at start (mirrors the command line). Where vLLM has the
    same setting, the flag has vLLM's name and default, so a command line means the same to both."""

    model: str = BUNDLED_MODEL
    """Served model name; also the tokenizer loaded with `load_tokenizer`."""
    latency_s: float = 0.0
    """Fixed latency of every model call."""
    per_token_latency_s: float = 0.0
    """Added latency per completion token."""
    seed: int = 0
    """Seeds the generator that draws a fresh sampling seed for each request that carries none (like
    vLLM's `--seed`): unseeded requests differ from each other, reproducibly per server run."""
    correct_rate: float = 0.7
    think_rate: float = 0.5
    noncanonical_rate: float = 0.0
    fault_rate: float = 0.0
    fault: FaultKind = "500"
    max_model_len: int = 32768
    enable_auto_tool_choice: bool = False
    """vLLM's flag: tool calls are parsed (and `tools` accepted with "auto" choice) only with it and a
    `tool_call_parser`; otherwise such a request is the same 400 vLLM gives."""
    tool_call_parser: str | None = field(default=None, metadata={"type": str})
    reasoning_parser: str | None = field(default=None, metadata={"type": str})
    """Without one, the think block stays in `content`, as on vLLM."""
    enable_lora: bool = False
    """Serve `/v1/load_lora_adapter` and adapters by name (vLLM: `--enable-lora` plus
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING`)."""
    max_lora_rank: int = 16
    max_loras: int = 1
    """Distinct adapters in one batch; a request for another one waits (vLLM's scheduler)."""
    max_cpu_loras: int | None = field(default=None, metadata={"type": int})
    kv_cache_tokens: int = 4_194_304
    """The finite KV budget (tokens, in blocks of 16) behind `vllm:kv_cache_usage_perc`, real waiting
    counts, preemptions and prefix-cache hits (`standin.engine`)."""
    prefill_token_latency_s: float = 0.0
    """Seconds to compute one prompt token the prefix cache does not hold, on a lane all prefills share
    (recomputes after a preemption included)."""
    weight_updates: bool = False
    """Serve `/pause`, `/resume` and the weight-update routes (vLLM: `VLLM_SERVER_DEV_MODE=1`)."""
    weight_transfer_backend: str = "nccl"
    """vLLM's `--weight-transfer-config {"backend": ...}`: whose `init_info` / `update_info` rules apply."""
    startup_delay_s: float = 0.0
    """Delay before loading, so a test can watch `/health` answer 503 first. Zero in production."""
    admin: bool = False
    """Serve the test routes (`/admin/faults`, `/admin/sessions`, `/admin/requests`). Off unless asked."""
    enable_per_request_metrics: bool = False
    """vLLM's flag: every response carries `metrics` (here its `queue_time_ms`: the wait for the batch)."""

    def policy(self) -> PolicyConfig:
        return PolicyConfig(self.seed, self.correct_rate, self.think_rate, self.noncanonical_rate)

    def parsers(self) -> Parsers:
        return Parsers(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)

    def to_argv(self) -> list[str]:
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = f"--{f.name.replace('_', '-')}"
            argv += [flag] if isinstance(value, bool) else [flag, str(value)]
        return argv


class StandinState:
    """What the routes share: settings, the loaded policy (None until ready), adapters, the engine."""

    def __init__(self, options: StandinOptions, api_key: str | None = None) -> None:
        if options.enable_auto_tool_choice and not options.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")  # vLLM's TypeError
        for flag, name, known in (
            ("--tool-call-parser", options.tool_call_parser, STANDIN_TOOL_PARSERS),
            ("--reasoning-parser", options.reasoning_parser, STANDIN_REASONING_PARSERS),
        ):
            if name is not None and name not in known:
                raise ValueError(f"{flag} {name}: the stand-in parses only as vLLM's {known} do")
        if options.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"--max-lora-rank must be one of {VLLM_LORA_RANKS}, got {options.max_lora_rank}")
        if options.max_cpu_loras is not None and options.max_cpu_loras < options.max_loras:
            raise ValueError(
                f"max_cpu_loras ({options.max_cpu_loras}) must be >= max_loras ({options.max_loras})."
            )
        self.options = options
        self.api_key = api_key
        self.policy_config = options.policy()  # validates the rates before a port is bound
        self.faults = FaultPlan(FaultSettings(fault_rate=options.fault_rate, fault=options.fault))
        self.stats = TrafficStats()
        self.engine = Engine(options.max_loras, options.kv_cache_tokens, options.prefill_token_latency_s)
        self.adapter_limits = AdapterLimits(max_lora_rank=options.max_lora_rank)
        self.unseeded = random.Random(options.seed)
        """Draws the sampling seed of each request that carries none."""
        self.answers: Answers | None = None
        self.loras: dict[str, str] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        """What the server saw of its latest model calls (`X-Request-Id`, `cache_salt`, model)."""
        self.bodies: deque[tuple[str, bytes]] = deque(maxlen=RECENT_BODIES)
        """With `--admin` only: the latest model calls' request bodies as sent (`/admin/bodies`), so tests
        can judge what the plane sends with vLLM's own request models."""
        self.load_error: BaseException | None = None
        self.on_fatal: Any = None
        """Asks the HTTP server to exit (set by `main`)."""
        self.parent_pid: int | None = None
        """Exit when this process stops being our parent (set by `main` from `--parent-pid`)."""

    async def load(self) -> None:
        """Readiness means loaded: the tokenizer and the policy's vocabulary index exist."""
        try:
            await asyncio.sleep(self.options.startup_delay_s)
            started = time.monotonic()
            tokenizer = await asyncio.to_thread(load_tokenizer, self.options.model)
            policy = await asyncio.to_thread(ScriptedPolicy, tokenizer, self.policy_config)
            self.answers = Answers(policy, self.options.max_model_len, self.options.parsers())
            log.info("stand-in loaded %s in %.1f s", self.options.model, time.monotonic() - started)
        except Exception as exc:
            self.load_error = exc
            log.exception("stand-in failed to load %s", self.options.model)
            if self.on_fatal is not None:
                self.on_fatal()

    def served(self, model: str | None) -> str | None:
        """The name to answer as, or None when the model is not served (404, like vLLM)."""
        if model is None or model == self.options.model or model in self.loras:
            return model or self.options.model
        return None


class InvalidBody(Exception):
    """A request body vLLM's FastAPI layer would refuse: a 400 in its validation-error shape (vLLM 0.33.0
    `exception_handling/handlers/validation.py`: at most 10 errors, each input summarised, `loc` and
    `param` as the dotted field path under `body`)."""

    def __init__(self, exc: ValidationError, where: str = "body") -> None:
        errors = exc.errors(include_url=False)
        refused = [
            e["ctx"]["error"] for e in errors if isinstance(e.get("ctx", {}).get("error"), RequestError)
        ]
        if refused:  # a check of vLLM's own validators (`VLLMValidationError`): its message and parameter
            self.body = error_body(str(refused[0]), "BadRequestError", 400, refused[0].param)
            super().__init__(self.body["error"]["message"])
            return
        label = "error" if len(errors) == 1 else "errors"
        lines = "".join(f"  {_bounded_error(err, where)}\n" for err in errors[:MAX_REPORTED_ERRORS])
        if len(errors) > MAX_REPORTED_ERRORS:
            lines += f"  ...and {len(errors) - MAX_REPORTED_ERRORS} more {label}\n"
        loc = errors[0].get("loc", ()) if errors else ()
        self.body = error_body(
            f"{len(errors)} validation {label}:\n{lines}".rstrip(),
            "Bad Request",
            400,
            _field_path(loc, where),
        )
        super().__init__(self.body["error"]["message"])


MAX_REPORTED_ERRORS = 10  # vLLM's bounds on a validation error's size (a huge body must not echo back)
MAX_INPUT_CHARS = 200
MAX_ERROR_CHARS = 1000
_SCHEMA_MARKERS = frozenset(
    {"function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
     "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call", "arguments",
     "is-instance", "is-subclass", "callable", "str", "int", "float", "bool", "bytes", "bytearray",
     "list", "tuple", "dict", "set", "frozenset", "complex", "none", "nonetype"}
)  # fmt: skip
"""pydantic-core's schema-kind names, which appear in an error's `loc` for union and wrapped fields and
are not field names: vLLM leaves them out of `param`."""


def _field_path(loc: Any, where: str = "body") -> str:
    """`("prompt", "list[int]", 0)` -> `"body.prompt.0"`: the path a client recognises."""
    parts = [where, *(str(p) for p in loc)]
    kept = [p for p in parts if not any(c in p for c in "[]{}()") and p.lower() not in _SCHEMA_MARKERS]
    return ".".join(kept or parts)


def _summary(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= MAX_INPUT_CHARS else value[:MAX_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= MAX_INPUT_CHARS else text[:MAX_INPUT_CHARS] + "...[truncated]"


def _bounded_error(err: Any, where: str = "body") -> str:
    err = dict(err)
    if "input" in err:
        err["input"] = _summary(err["input"])
    err["loc"] = _field_path(err.get("loc", ()), where)
    text = str(err)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "...[truncated]"


def _error(message: str, err_type: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, code, param), status_code=code)


def _not_ready(state: StandinState) -> JSONResponse:
    return _error(f"model {state.options.model} is still loading", "ServiceUnavailableError", 503)


async def _parse(request: Request, model: type) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise InvalidBody(exc) from exc


def _parse_query(request: Request, model: type) -> Any:
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise InvalidBody(exc, "query") from exc


def _overrides(state: StandinState, request: Request) -> tuple[PolicyConfig, float, float]:
    """Per-request policy config and latency from `X-Standin-*` headers; a bad value is a 400."""
    headers, options = request.headers, state.options
    changes, latency, per_token = {}, options.latency_s, options.per_token_latency_s
    try:
        for header, name in _POLICY_HEADERS.items():
            if header in headers:
                changes[name] = float(headers[header])
        if "x-standin-latency" in headers:
            latency = float(headers["x-standin-latency"])
        if "x-standin-per-token-latency" in headers:
            per_token = float(headers["x-standin-per-token-latency"])
        config = dataclasses.replace(state.policy_config, **changes) if changes else state.policy_config
    except ValueError as exc:
        raise RequestError(f"bad X-Standin-* header: {exc}") from exc
    if latency < 0 or per_token < 0:
        raise RequestError("X-Standin latency headers must be >= 0")
    return config, latency, per_token


def _seed_for(state: StandinState, model: str, seed: int | None) -> int:
    # Without a seed vLLM samples at random: each such request draws its own from the server's generator
    # (seeded by `--seed`, as vLLM's engine generator is), so n unseeded copies of a prompt differ.
    base = state.unseeded.getrandbits(63) if seed is None else seed
    # An adapter is another policy, and so are new weights: same prompt, different answers.
    if model != state.options.model:
        base = base * 1_000_003 + zlib.crc32(model.encode())
    version = state.engine.weight_version
    return base if version == DEFAULT_VERSION else base * 1_000_033 + zlib.crc32(version.encode())


def _tokens_done(elapsed: float, latency: float, per_token: float, total: int) -> int:
    """Output tokens sampled after `elapsed` seconds of running time."""
    if elapsed < latency:
        return 0
    if per_token <= 0:
        return total
    return min(total, int((elapsed - latency) / per_token))


async def _run(
    state: StandinState, plan: Plan, latency: float, per_token: float, drafted_under: str
) -> Answer:
    """Run an admitted call on the engine's clock: a `keep` pause freezes it (new weights resample what is
    left, continuing from the tokens already sampled); an `abort` pause ends it with what it has."""
    assert state.answers is not None
    engine, answers = state.engine, state.answers
    adapter = plan.model if plan.model != state.options.model else None
    lead = plan.drafts[0]
    others = tuple(len(d.prompt_ids) for d in plan.drafts[1:])
    salt = getattr(plan.req, "cache_salt", None)
    slot = Slot(
        adapter, lead.prompt_ids + lead.sampled.ids, len(lead.prompt_ids), latency, per_token, others, salt
    )
    queued = time.monotonic()
    slot = await engine.admit(slot)
    metrics = None
    if state.options.enable_per_request_metrics:
        metrics = PerRequestMetrics(queue_time_ms=(time.monotonic() - queued) * 1e3)
    try:
        for draft in plan.drafts:
            draft.spans = [(engine.weight_version, 0)]
            if engine.weight_version != drafted_under:  # new weights landed while it waited
                answers.resample_tail(plan, draft, 0, _seed_for(state, plan.model, plan.req.seed))
        slot.token_ids = lead.prompt_ids + lead.sampled.ids  # what the engine grows into
        elapsed = 0.0
        while True:
            stopped = await engine.run_for(slot, latency + per_token * len(lead.sampled.ids) - elapsed)
            if stopped is None:
                break
            elapsed += stopped
            done = _tokens_done(elapsed, latency, per_token, len(lead.sampled.ids))
            if engine.pause_mode == "abort":
                for draft in plan.drafts:
                    answers.cut(draft, done, "abort")
                break
            await engine.resumed()
            version = engine.weight_version
            if version != lead.spans[-1][0] and done < len(lead.sampled.ids):
                seed = _seed_for(state, plan.model, plan.req.seed)
                for draft in plan.drafts:
                    answers.resample_tail(plan, draft, done, seed)
                    draft.spans.append((version, done))
                slot.token_ids = lead.prompt_ids + lead.sampled.ids
    finally:
        engine.release(slot)
    return answers.body(plan, metrics)


def build_app(state: StandinState) -> TrafficGate:
    async def model_call(request: Request, kind: str) -> Response:
        if state.answers is None:
            return _not_ready(state)
        if state.engine.refuses_new():  # vLLM 0.33.0 `EngineCoreProc.pause_generation`: abort/wait refuse
            return _error(PAUSED_MESSAGE, "ServiceUnavailableError", 503)
        try:
            body = await _parse(
                request, CompletionRequest if kind == "completions" else ChatCompletionRequest
            )
            model = state.served(body.model)
            if model is None:
                missing = f"The model `{body.model}` does not exist. Valid aliases: {state.options.model}."
                return _error(missing, "NotFoundError", 404, "model")
            config, latency, per_token = _overrides(state, request)
            drafted_under = state.engine.weight_version
            plan = state.answers.plan(kind, body, model, _seed_for(state, model, body.seed), config)
        except RequestError as exc:
            return _error(str(exc), "BadRequestError", 400, exc.param)
        if state.options.admin:
            state.bodies.append((request.url.path, await request.body()))
        state.recent.append(
            {
                "request_id": request.headers.get("x-request-id"),
                "cache_salt": getattr(body, "cache_salt", None),
                "model": model,
            }
        )
        try:
            answer = await _run(state, plan, latency, per_token, drafted_under)
        except Exception as exc:  # a bug here must still answer in the protocol's error shape
            log.exception("stand-in failed to answer a %s call", kind)
            return _error(f"{type(exc).__name__}: {exc}", "InternalServerError", 500)
        state.stats.prompt_tokens += answer.prompt_tokens
        state.stats.completion_tokens += answer.completion_tokens
        return Response(answer.body, media_type="application/json")

    async def completions(request: Request) -> Response:
        return await model_call(request, "completions")

    async def chat_completions(request: Request) -> Response:
        return await model_call(request, "chat")

    async def health(request: Request) -> Response:
        return Response(status_code=200) if state.answers is not None else _not_ready(state)

    async def models(request: Request) -> Response:
        if state.answers is None:
            return _not_ready(state)
        base = state.options.model
        cards = [ModelCard(id=base, root=base, max_model_len=state.options.max_model_len)]
        cards += [ModelCard(id=name, root=path, parent=base) for name, path in state.loras.items()]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    async def metrics(request: Request) -> Response:
        text = state.stats.render(state.options.model, state.engine)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def invalid_body(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidBody)
        return JSONResponse(exc.body, status_code=400)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        tasks = [asyncio.create_task(state.load())]
        if state.parent_pid is not None and state.on_fatal is not None:
            tasks.append(asyncio.create_task(_exit_with_parent(state.parent_pid, state.on_fatal)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if state.options.enable_lora:
        routes += lora_routes(state, _parse, _error)
    if state.options.weight_updates:
        routes += weight_routes(state, _parse, _error, _parse_query)
    if state.options.admin:
        routes += admin_routes(state, _parse)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={InvalidBody: invalid_body})
    vocab = lambda: state.answers.vocab_size if state.answers else 0  # noqa: E731
    return TrafficGate(app, state.stats, state.faults, vocab, api_key=state.api_key)


async def _exit_with_parent(parent_pid: int, exit_now: Any) -> None:
    """A launcher that dies without stopping us must not leave a server behind (tests crash too)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("stand-in: parent %d is gone, shutting down", parent_pid)
    exit_now()


# ----------------------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> tuple[StandinOptions, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_actors.inference.standin", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    defaults = StandinOptions()
    for f in dataclasses.fields(StandinOptions):
        flag = f"--{f.name.replace('_', '-')}"
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default)
            continue
        kind = f.metadata.get("type", type(default)) if f.name != "fault" else str
        choices = get_args(FaultKind) if f.name == "fault" else None
        parser.add_argument(flag, type=kind, default=default, choices=choices)
    args = parser.parse_args(argv)
    options = StandinOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(StandinOptions)})
    return options, args


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def _raise_open_files_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _serve_on_uvloop(main: Any) -> None:
    """On uvloop, as vLLM's `vllm serve` runs its HTTP server: the same event loop, and about 30% less CPU
    per request than asyncio's own (`scripts/bench_long_waits.py` shares the plane's cores with it)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - not built for this platform
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    options, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_open_files_limit()
    # The API key comes as vLLM takes it (`VLLM_API_KEY`), never on the command line.
    state = StandinState(options, api_key=os.environ.get("VLLM_API_KEY") or None)
    sock = _listen(args.host, args.port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(state),
        log_level="warning",
        access_log=False,
        backlog=BACKLOG,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        proxy_headers=False,
        server_header=False,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    state.parent_pid = args.parent_pid
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    log.info("stand-in serving %s on http://%s:%d/v1", options.model, args.host, port)
    _serve_on_uvloop(server.serve(sockets=[sock]))
    return 1 if state.load_error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
