"""What happens to a model call at the stand-in server's door: it is counted, its session recorded, and
maybe faulted instead of answered.

`TrafficGate` is the outermost ASGI callable, in front of the routes, so a fault can do what a route
cannot: never answer (`timeout`), or close the socket without a response (`drop`). Faults come from the
server-wide `FaultSettings` (CLI flags, `POST /admin/faults`) or per request from the headers
`X-Standin-Fault: <kind>|none` and `X-Standin-Fault-Rate: <0..1>` (default 1).

Kinds, each something a real server (or the network in front of it) can do:

- `500`: an error answer; `malformed`: a 200 JSON body without the protocol's shape;
- `timeout`: never answers; `drop`: closes the connection without a response;
- `not_json`: a 200 whose content type says JSON and whose body is not JSON;
- `oov`: the real answer with one sampled token id outside the vocabulary (`X-Standin-Oov-Id`, default:
  the vocabulary size);
- `drip`: a 200 whose body arrives one byte every `DRIP_INTERVAL_S` and never ends, so a per-read timeout
  keeps being reset;
- `retry_after`: a 429 with `Retry-After` (`X-Standin-Retry-After` seconds, default 30);
- `echo_headers`: a 400 whose message repeats every request header, `Authorization` included (servers
  and proxies that echo a request in an error exist; the key must not reach a result).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, get_args

from rollout_actors.inference.standin.wire import FaultKind, FaultSettings

MODEL_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)
MAX_SESSIONS = 100_000  # distinct session ids remembered; past it new ones are only counted as overflow
DROP_BODY_PROMISE = b"4096"  # fallback drop: promise a body, send none, so the client sees a cut response
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
DRIP_INTERVAL_S = 0.5  # below any sane read timeout: a drip never trips it
DEFAULT_RETRY_AFTER_S = 30

Scope = dict[str, Any]


@dataclass
class TrafficStats:
    """Counters for `/metrics`. Single event loop: plain ints, no locks."""

    requests: Counter = field(default_factory=Counter)
    """Model calls received, by endpoint."""
    responses: Counter = field(default_factory=Counter)
    """Model calls answered, by HTTP status."""
    faults: Counter = field(default_factory=Counter)
    """Faults injected, by kind."""
    in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sessions: dict[str, int] = field(default_factory=dict)
    """Requests per `X-Session-ID`."""
    sessions_overflow: int = 0
    """Requests whose session id arrived after `MAX_SESSIONS` distinct ones were remembered."""

    def record_session(self, session_id: str) -> None:
        if session_id in self.sessions or len(self.sessions) < MAX_SESSIONS:
            self.sessions[session_id] = self.sessions.get(session_id, 0) + 1
        else:
            self.sessions_overflow += 1

    def render(self, model: str, engine: Any) -> str:
        """Prometheus text. The `vllm:` series carry vLLM 0.33's names and labels
        (`vllm/v1/metrics/loggers.py`: `model_name`, `engine`) with the engine's real figures."""
        label = f'model_name="{model}",engine="0"'
        lines = [
            "# TYPE standin_requests_total counter",
            *(f'standin_requests_total{{endpoint="{k}"}} {v}' for k, v in sorted(self.requests.items())),
            "# TYPE standin_responses_total counter",
            *(f'standin_responses_total{{code="{k}"}} {v}' for k, v in sorted(self.responses.items())),
            "# TYPE standin_faults_injected_total counter",
            *(f'standin_faults_injected_total{{kind="{k}"}} {self.faults[k]}' for k in FAULT_KINDS),
            "# TYPE standin_requests_in_flight gauge",
            f"standin_requests_in_flight {self.in_flight}",
            "# TYPE standin_prompt_tokens_total counter",
            f"standin_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE standin_completion_tokens_total counter",
            f"standin_completion_tokens_total {self.completion_tokens}",
            "# TYPE standin_sessions gauge",
            f"standin_sessions {len(self.sessions)}",
            "# TYPE standin_session_overflow_requests_total counter",
            f"standin_session_overflow_requests_total {self.sessions_overflow}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {engine.num_running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{label}}} {engine.num_waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} {engine.kv_usage:.6f}",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{label}}} {engine.num_preemptions}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{label}}} {engine.prefix_cache_queries}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{label}}} {engine.prefix_cache_hits}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{label}}} {self.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{label}}} {self.completion_tokens}",
        ]
        return "\n".join(lines) + "\n"


class BadFaultHeader(ValueError):
    pass


class FaultPlan:
    """Decides, per model call, whether to inject a fault and which. Not seeded: faults are traffic
    weather, independent of what the policy would have said."""

    def __init__(self, settings: FaultSettings) -> None:
        self.settings = settings
        self._rng = random.Random()

    def decide(self, headers: dict[bytes, bytes]) -> str | None:
        kind = headers.get(b"x-standin-fault", b"").decode().strip().lower()
        rate_text = headers.get(b"x-standin-fault-rate")
        if kind == "none":
            return None
        if kind:
            if kind not in FAULT_KINDS:
                raise BadFaultHeader(
                    f"X-Standin-Fault must be one of {FAULT_KINDS + ('none',)}, got {kind!r}"
                )
            rate = _rate(rate_text) if rate_text is not None else 1.0
        else:
            kind, rate = self.settings.fault, self.settings.fault_rate
            if rate_text is not None:
                rate = _rate(rate_text)
        return kind if rate > 0 and self._rng.random() < rate else None


def _rate(raw: bytes) -> float:
    try:
        rate = float(raw)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise BadFaultHeader(f"X-Standin-Fault-Rate must be a number within [0, 1], got {raw!r}")
    return rate


class TrafficGate:
    """ASGI wrapper: model calls are counted and maybe faulted; everything else passes straight on."""

    def __init__(
        self,
        app: Any,
        stats: TrafficStats,
        faults: FaultPlan,
        vocab_size: Any = lambda: 0,
        api_key: str | None = None,
    ) -> None:
        self.app = app
        self.stats = stats
        self.faults = faults
        self.api_key = api_key
        """With a key, every `/v1` route answers 401 without `Authorization: Bearer <key>` (vLLM 0.33's
        `AuthenticationMiddleware`: guarded prefixes `/v1`, `/v2`, `/inference`, `/cohere`)."""
        self.vocab_size = vocab_size
        """The tokenizer's vocabulary size once loaded: the id an `oov` fault plants by default."""

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.api_key is not None and scope["type"] == "http" and not self._authorized(scope):
            await send_json(send, 401, {"error": "Unauthorized"})
            return
        endpoint = MODEL_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        stats = self.stats
        stats.requests[endpoint] += 1
        stats.in_flight += 1
        headers = dict(scope["headers"])
        session = headers.get(b"x-session-id")
        if session:
            stats.record_session(session.decode(errors="replace"))
        try:
            try:
                kind = self.faults.decide(headers)
            except BadFaultHeader as exc:
                await send_json(send, 400, error_body(str(exc), "BadRequestError", 400), stats)
                return
            if kind is None:
                await self.app(scope, receive, _counting(send, stats))
                return
            stats.faults[kind] += 1
            if kind == "oov":
                await self.app(scope, receive, _with_oov_id(send, headers, self.vocab_size(), stats))
                return
            await inject(kind, receive, send, stats, headers)
        finally:
            stats.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        if scope.get("method") == "OPTIONS" or not scope.get("path", "").startswith(GUARDED_PREFIXES):
            return True
        value = dict(scope["headers"]).get(b"authorization", b"").decode(errors="replace")
        scheme, _, token = value.partition(" ")
        expected = hashlib.sha256(self.api_key.encode()).digest()  # type: ignore[union-attr]
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), expected
        )


def _counting(send: Any, stats: TrafficStats) -> Any:
    async def counted(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            stats.responses[str(message["status"])] += 1
        await send(message)

    return counted


async def inject(
    kind: str, receive: Any, send: Any, stats: TrafficStats, headers: dict[bytes, bytes]
) -> None:
    if kind == "500":
        body = error_body("stand-in: injected fault 500", "InternalServerError", 500)
        await send_json(send, 500, body, stats)
    elif kind == "not_json":
        payload = b"<html><body>502 Bad Gateway</body></html>"
        await _send_raw(send, 200, payload, stats)
    elif kind == "retry_after":
        delay = headers.get(b"x-standin-retry-after", str(DEFAULT_RETRY_AFTER_S).encode())
        body = error_body("stand-in: injected fault 429", "RateLimitError", 429)
        await send_json(send, 429, body, stats, extra_headers=[(b"retry-after", delay)])
    elif kind == "echo_headers":
        echoed = "; ".join(
            f"{k.decode(errors='replace')}: {v.decode(errors='replace')}" for k, v in headers.items()
        )
        body = error_body(f"stand-in: bad request with headers {echoed}", "BadRequestError", 400)
        await send_json(send, 400, body, stats)
    elif kind == "drip":
        await _drip(receive, send, stats)
    elif kind == "malformed":
        # Valid JSON with the wrong shape: the SDK parses it leniently, so the caller's own validation
        # (no `choices`) is what must notice.
        await send_json(send, 200, {"standin_fault": "malformed", "detail": "not a completion"}, stats)
    elif kind == "timeout":
        await _until_disconnect(receive)  # never answer; the client's read timeout has to fire
    else:
        await _drop(receive, send)


def _with_oov_id(send: Any, headers: dict[bytes, bytes], vocab_size: int, stats: TrafficStats) -> Any:
    """The route's real answer with its first sampled id replaced by one outside the vocabulary."""
    oov_id = int(headers.get(b"x-standin-oov-id", str(vocab_size).encode()))
    start: dict[str, Any] = {}

    async def rewrite(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            return
        payload = message.get("body", b"")
        if start.get("status") == 200:
            answer = json.loads(payload)
            for choice in answer.get("choices", []):
                if choice.get("token_ids"):
                    choice["token_ids"][0] = oov_id
                tokens = (choice.get("logprobs") or {}).get("tokens")
                if tokens and str(tokens[0]).startswith("token_id:"):  # `return_tokens_as_token_ids`
                    tokens[0] = f"token_id:{oov_id}"
            payload = json.dumps(answer).encode()
        await _send_raw(send, start.get("status", 200), payload, stats)

    return rewrite


async def _send_raw(send: Any, status: int, payload: bytes, stats: TrafficStats | None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if stats is not None:
        stats.responses[str(status)] += 1
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _drip(receive: Any, send: Any, stats: TrafficStats) -> None:
    """A 200 JSON answer whose body never ends: one byte per `DRIP_INTERVAL_S` until the client leaves."""
    stats.responses["200"] += 1
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    disconnected = asyncio.ensure_future(_until_disconnect(receive))
    try:
        while not disconnected.done():
            await send({"type": "http.response.body", "body": b" ", "more_body": True})
            await asyncio.wait([disconnected], timeout=DRIP_INTERVAL_S)
    except OSError:  # the client closed mid-send
        pass
    finally:
        disconnected.cancel()


async def _drop(receive: Any, send: Any) -> None:
    """Close the connection without a response. uvicorn's `send` is bound to the request cycle that
    owns the transport; with another server, promise a body and return without it (the server then
    closes the connection mid-response, which the client sees the same way: no usable answer)."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None and hasattr(transport, "close"):
        transport.close()
        await _until_disconnect(receive)
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", DROP_BODY_PROMISE)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


async def send_json(
    send: Any,
    status: int,
    body: Any,
    stats: TrafficStats | None = None,
    extra_headers: list[tuple[bytes, bytes]] = (),
) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += list(extra_headers)
    if stats is not None:
        stats.responses[str(status)] += 1
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
