"""Per-rollout OpenAI clients, cheap to build (docs/design.md contract 6).

Each rollout builds one client from its `ClientConfig`, uses it for every turn (one server: prefix-cache
affinity) and closes it in `finally`. What is shared is only what is immutable: one SSL context per process.
Building TLS state costs ~47 ms per default `AsyncOpenAI()`; with the shared context it is well under 1 ms,
while connection pool, retries and state stay per rollout.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import os
import ssl
import threading
from typing import TYPE_CHECKING, Any

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover - openai 1.x / 2.x
    import httpx

from rollout_actors.kernel import register_secret
from rollout_actors.wire import CallerError, ClientConfig

if TYPE_CHECKING:  # imported where a client is built: `auth_headers` alone must not cost an actor ~1 s
    import openai

_ssl_lock = threading.Lock()
_ssl_context: ssl.SSLContext | None = None

CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "model_call_deadline", default=None
)
"""The running model call's deadline on the loop's clock (set by `model_call`): what a retry may wait for."""

NO_KEY = "EMPTY"
"""vLLM accepts any key when it runs without `--api-key`; the SDK insists on one being set."""


def shared_ssl_context() -> ssl.SSLContext:
    """One verified client SSL context per process. Never mutated after creation, so sharing it between
    rollouts shares no connection or session state."""
    global _ssl_context
    if _ssl_context is None:
        with _ssl_lock:
            if _ssl_context is None:
                try:
                    import certifi

                    _ssl_context = ssl.create_default_context(cafile=certifi.where())
                except ImportError:  # pragma: no cover
                    _ssl_context = ssl.create_default_context()
    return _ssl_context


def api_key_from_env(config: ClientConfig) -> str:
    """The key named by `api_key_var`, read on the side that makes the call. It is never stored in a
    request, a result or a log line."""
    if config.api_key_var is None:
        return NO_KEY
    key = os.environ.get(config.api_key_var)
    if not key:
        raise CallerError(
            f"environment variable {config.api_key_var!r} (api_key_var) is not set on this node"
        )
    register_secret(key)  # whatever echoes it back (an error body, a traceback) is redacted
    return key


def auth_headers(api_key_var: str | None) -> dict[str, str]:
    """The `Authorization` header for the plane's own calls to a server started with an API key (LoRA
    load/unload, pause/resume, weight updates, readiness, metrics). Empty without a key. The key is read
    here, on the side that calls, and registered so anything echoing it is redacted."""
    if api_key_var is None:
        return {}
    key = os.environ.get(api_key_var)
    if not key:
        raise ValueError(f"environment variable {api_key_var!r} (the servers' API key) is not set here")
    register_secret(key)
    return {"Authorization": f"Bearer {key}"}


def build_client(config: ClientConfig, session_id: str | None = None) -> openai.AsyncOpenAI:
    """A fresh client for one rollout. The caller owns it and must `await client.close()`."""

    if config.base_url is None:
        raise CallerError("client.base_url is not set and no endpoint was routed to this rollout")
    timeout = httpx.Timeout(
        connect=config.connect_timeout_s,
        read=config.read_timeout_s,
        write=config.write_timeout_s,
        pool=config.pool_timeout_s,
    )
    limits = httpx.Limits(
        max_connections=config.max_connections,
        max_keepalive_connections=config.max_connections,
        keepalive_expiry=config.keepalive_expiry_s,
    )
    http_client = httpx.AsyncClient(
        verify=shared_ssl_context(), timeout=timeout, limits=limits, trust_env=False
    )
    headers = dict(config.headers)
    if session_id is not None:
        # Lets a router (vLLM's, or any prefix-cache-aware one) keep this rollout on one replica.
        headers["X-Session-ID"] = session_id
    client = _client_class()(
        base_url=config.base_url,
        api_key=api_key_from_env(config),
        timeout=timeout,
        max_retries=config.max_retries,
        default_headers=headers,
        http_client=http_client,
    )
    if getattr(client, "_platform", False) is None:
        # The SDK finds the platform for its headers on a client's first request, in a thread (it may read
        # files): one thread hop per rollout, every rollout of a process asking the same question.
        client._platform = _platform()
    return client


@functools.cache
def _client_class() -> type[openai.AsyncOpenAI]:
    """`AsyncOpenAI` whose retries never wait past the call's deadline (docs/design.md contract 6). The SDK
    honours a `Retry-After` of up to two minutes; a wait that would end past `CALL_DEADLINE` cannot be
    followed by an attempt, so the server's answer (the 429 or 5xx) is raised at once instead of the call
    idling until its deadline and reporting only that it ran out. Shorter waits are the SDK's own."""
    import openai

    class DeadlineBoundClient(openai.AsyncOpenAI):
        async def _sleep_for_retry(
            self, *, retries_taken: int, max_retries: int, options: Any, response: Any
        ) -> None:
            deadline = CALL_DEADLINE.get()
            if deadline is not None and response is not None:
                left = max_retries - retries_taken
                wait = self._calculate_retry_timeout(left, options, response.headers)
                if asyncio.get_running_loop().time() + wait >= deadline:
                    raise self._make_status_error_from_response(response) from None
            await super()._sleep_for_retry(
                retries_taken=retries_taken, max_retries=max_retries, options=options, response=response
            )

    return DeadlineBoundClient


@functools.cache
def _platform() -> object:
    from openai._base_client import get_platform

    return get_platform()


def open_client_count() -> int:
    """Debug: OpenAI clients in this process not yet closed, found by walking the heap when asked (leak
    checks: `RolloutWorker.debug_resources`). Nothing is recorded as clients are built."""
    import openai

    return sum(1 for obj in gc.get_objects() if isinstance(obj, openai.AsyncOpenAI) and not obj.is_closed())
