"""`AgentEndpoint`: the interception endpoint agent-mode rollouts serve their agents, one per worker process.

It lives in the rollout worker's process, on its event loop, beside the rollouts it serves: an agent's
call reaches the rollout that owns it with no hop between processes, and the rollout answers it with its
own client and renderer session as a token-mode turn would (why here and not in a proxy actor, with the
measurement: docs/agent-mode.md; `scripts/bench_agent.py`). One listening socket per process, opened
on first use and closed with the loop; a rollout only *registers* a route:

    grant = await endpoint_for_loop().register(calls)      # calls: the rollout's `AgentCalls`
    ...  # the agent POSTs {grant.base_url}/chat/completions with `Authorization: Bearer {grant.api_key}`
    await grant.revoke()                                   # in `finally`: later calls are refused

A route is `/rollouts/<route id>/v1/...` and answers only its own key (compared in constant time), so one
rollout's agent can never reach another's turns. Revoking refuses every later call (410), cancels calls
still in flight and closes the connections the rollout's agent opened: nothing of the agent outlives its
rollout here. The key is never logged; the access log is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from aiohttp import web

from rollout_actors.kernel import new_id

KEEPALIVE_S = 5.0  # an idle agent connection is closed after this (aiohttp's default is an hour)
MAX_BODY_BYTES = 64 * 1024 * 1024  # a long agent history with tools: far above any context window's text
ENDED_MEMORY = 10_000  # revoked route ids remembered (answered 410, not 404), oldest forgotten first
CANCEL_WAIT_S = 2.0  # revoking waits this long for cancelled in-flight calls to finish unwinding


class CallHandler(Protocol):
    """What a route serves: the rollout's side of one intercepted chat-completions call."""

    async def chat_completion(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...

    def model_list(self) -> dict[str, Any]: ...


@dataclass
class _Route:
    key: bytes
    handler: CallHandler
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    transports: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


@dataclass
class Grant:
    """A rollout's registration: what its agent is given, and how the rollout ends it."""

    base_url: str
    api_key: str = field(repr=False)
    route_id: str
    _endpoint: AgentEndpoint = field(repr=False)

    def wire(self, model: str) -> dict[str, str]:
        """What travels to the env server for its agent (`env_actors.agent.AgentEndpoint.from_wire`)."""
        return {"base_url": self.base_url, "api_key": self.api_key, "model": model}

    async def revoke(self) -> None:
        """End the route: later calls are refused, calls in flight cancelled, its connections closed."""
        await self._endpoint.revoke(self.route_id)


class AgentEndpoint:
    """The process's interception endpoint (one per event loop: `endpoint_for_loop`)."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._server: asyncio.Server | None = None
        self._web: web.Server | None = None
        self._host = ""
        self._port = 0
        self._starting = asyncio.Lock()
        self.calls_served = 0

    async def register(self, handler: CallHandler) -> Grant:
        await self._start()
        route_id = new_id("agent")
        key = secrets.token_urlsafe(32)
        self._routes[route_id] = _Route(key.encode(), handler)
        base_url = f"http://{_url_host(self._host)}:{self._port}/rollouts/{route_id}/v1"
        return Grant(base_url, key, route_id, self)

    async def revoke(self, route_id: str) -> None:
        route = self._routes.pop(route_id, None)
        if route is None:
            return
        self._ended[route_id] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        for task in route.calls:
            task.cancel()
        if route.calls:
            await asyncio.wait(list(route.calls), timeout=CANCEL_WAIT_S)
        for transport in list(route.transports):
            transport.close()

    def stats(self) -> dict[str, Any]:
        """Routes registered now, connections open now, calls served: what a leak check reads."""
        return {
            "listening": self._server is not None,
            "port": self._port,
            "routes": len(self._routes),
            "connections": len(self._web.connections) if self._web is not None else 0,
            "calls_served": self.calls_served,
        }

    async def aclose(self) -> None:
        for route_id in list(self._routes):
            await self.revoke(route_id)
        if self._web is not None:
            await self._web.shutdown(timeout=CANCEL_WAIT_S)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), CANCEL_WAIT_S)
        self._server = self._web = None

    async def _start(self) -> None:
        async with self._starting:
            if self._server is not None:
                return
            self._host = _node_host()
            self._web = web.Server(
                self._handle,
                handler_cancellation=True,  # an agent that hung up (killed) stops its turn's sampling
                keepalive_timeout=KEEPALIVE_S,
                access_log=None,
                request_factory=self._request,
            )
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(self._web, self._host, 0)
            self._port = self._server.sockets[0].getsockname()[1]

    def _request(self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        loop = asyncio.get_running_loop()
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=MAX_BODY_BYTES)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        parts = request.path.strip("/").split("/")
        # /rollouts/<route id>/v1/chat/completions | /rollouts/<route id>/v1/models
        if len(parts) < 4 or parts[0] != "rollouts" or parts[2] != "v1":
            return _error(404, "not_found", f"no such route: {request.path[:200]}")
        route_id, tail = parts[1], "/".join(parts[3:])
        route = self._routes.get(route_id)
        if route is None:
            if route_id in self._ended:
                return _error(
                    410, "rollout_ended", "this rollout has ended: its endpoint serves no more calls"
                )
            return _error(404, "not_found", "no such rollout on this endpoint")
        offered = request.headers.get("Authorization", "").removeprefix("Bearer ").strip().encode()
        if not hmac.compare_digest(offered, route.key):
            return _error(401, "invalid_api_key", "this key is not valid for this rollout")
        if tail == "models" and request.method == "GET":
            return _json(200, route.handler.model_list())
        if tail != "chat/completions" or request.method != "POST":
            return _error(404, "not_found", f"{request.method} {tail} is not served: only chat completions")
        try:
            body = orjson.loads(await request.read())
        except (orjson.JSONDecodeError, ValueError):
            return _error(400, "invalid_request_error", "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "invalid_request_error", "the body must be a JSON object")
        task = asyncio.current_task()
        assert task is not None
        route.calls.add(task)
        if request.transport is not None:
            route.transports.add(request.transport)
        try:
            status, answer = await route.handler.chat_completion(body)
            self.calls_served += 1
            if status == 200 and body.get("stream"):
                return await _stream(request, answer, _include_usage(body))
        finally:
            route.calls.discard(task)
        return _json(status, answer)


async def _stream(request: web.BaseRequest, answer: dict[str, Any], usage: bool) -> web.StreamResponse:
    """A sampled turn as server-sent events, for agents that stream: the whole message in one delta, then
    the finish reason (and usage when asked), then `[DONE]`. The turn is sampled whole either way."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {key: answer[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = answer["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    chunks = [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]},
        {
            **head,
            "choices": [
                {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None}
            ],
        },
    ]
    if usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    for chunk in chunks:
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _error(status: int, code: str, message: str) -> web.Response:
    return _json(status, error_body(status, code, message))


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """OpenAI's error shape, so an agent's SDK raises its usual exception class for the status."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _node_host() -> str:
    """The address other nodes reach this process at (Ray's node IP); loopback outside a Ray worker."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AgentEndpoint] = weakref.WeakKeyDictionary()


def endpoint_for_loop() -> AgentEndpoint:
    """The running loop's endpoint (built on first use; it listens once a rollout registers)."""
    loop = asyncio.get_running_loop()
    endpoint = _PER_LOOP.get(loop)
    if endpoint is None:
        endpoint = _PER_LOOP[loop] = AgentEndpoint()
    return endpoint


def endpoint_stats() -> dict[str, Any]:
    """`AgentEndpoint.stats` of every loop in this process (a worker has one), for `debug_resources`."""
    totals: dict[str, Any] = {"routes": 0, "connections": 0, "calls_served": 0, "listening": 0}
    for endpoint in list(_PER_LOOP.values()):
        stats = endpoint.stats()
        for key in ("routes", "connections", "calls_served"):
            totals[key] += stats[key]
        totals["listening"] += int(stats["listening"])
    return totals
