"""Adapters: the field's environment packages served unchanged, each as an `Environment` named by a Ref.

- `verifiers_classic:VerifiersClassicEnv`: a verifiers classic environment (`verifiers.legacy` of 0.3.x, the
  top level of older releases): `load_environment(**args)`, its dataset, its multi-turn loop, its rubric.
- `verifiers_v1:VerifiersV1Env`: a verifiers 0.4 taskset whose agent is a plain chat loop.
- `verifiers_agent:VerifiersV1AgentEnv`: a verifiers 0.4 environment run by verifiers itself, its harness
  calling the model through the rollout's agent-mode endpoint (`mode="agent"`).
- `skyrl_gym:SkyRLGymEnv`: a skyrl-gym text environment (`make`, `init`, `step(raw text)`, `close`).

Two allowlists guard them. The adapter classes are in the default Ref allowlist (`env_actors.adapters.`),
but an adapter imports the user's package only when the pool allows it: `EnvPoolConfig.env_packages`,
handed to the adapter by its `EnvServer` (`allow_packages`) before `load`, never by a request. The
frameworks themselves are imported in `load`, so this package imports without them: they live in the
pool's own `runtime_env` (`EnvPoolConfig.runtime_env`), apart from the plane's packages.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
from collections.abc import Coroutine
from types import ModuleType
from typing import Any, TypeVar

from env_actors.env_calls import on_loop, watch_loop
from rollout_actors.kernel import CallerError

T = TypeVar("T")


class PackageGate:
    """The user's packages an adapter may import: the pool's `env_packages`, set once by the server.

    Nothing is imported before the check, and a gate never given an allowlist allows nothing."""

    def __init__(self) -> None:
        self._prefixes: tuple[str, ...] = ()

    def allow(self, prefixes: tuple[str, ...]) -> None:
        self._prefixes = tuple(prefixes)

    def check(self, module: str) -> None:
        if not any(module == p.rstrip(".") or module.startswith(p) for p in self._prefixes):
            raise CallerError(
                f"environment package {module!r} is outside this pool's env_packages {list(self._prefixes)}; "
                "an adapter imports only packages its pool names (EnvPoolConfig.env_packages)"
            )

    def load(self, module: str) -> ModuleType:
        self.check(module)
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise CallerError(f"cannot import environment package {module!r}: {exc}") from exc


def import_framework(module: str, wanted: str) -> ModuleType:
    """Import the framework an adapter hosts; a missing one is the pool's configuration at fault."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CallerError(
            f"{module} is not importable in this env server ({exc}); give its pool the packages it needs, "
            f"e.g. EnvPoolConfig.runtime_env = {{'pip': [{wanted!r}]}}"
        ) from exc


class FrameworkLoop:
    """An event loop on a thread of its own for a framework's coroutines (verifiers is async, and its
    reward functions may block for seconds on CPU): whatever they do, the server's own loop keeps turning.
    Sessions share it, as they would share the framework's own loop; so a coroutine that blocks it past its
    call's deadline (a tool's `time.sleep`) wedges the server, its session named (`env_calls.on_loop`); a
    whole episode that blocks it does so at `hang_timeout_s` (`env_calls.watch_loop`)."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        watch_loop(self._loop)

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the framework's loop from a thread that is not on it (a synchronous `load`)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the framework's loop and wait for it here. Cancelling the waiter cancels it."""
        future = asyncio.run_coroutine_threadsafe(on_loop(coro), self._loop)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise


def arguments_text(arguments: Any) -> str:
    """A sampled tool call's arguments as the JSON text verifiers records."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {})


def sampled_tool_calls(vf: Any, message: dict[str, Any]) -> list[Any]:
    """The plane's sampled tool calls (OpenAI shape) as verifiers' `ToolCall`s (same in 0.3 and 0.4)."""
    return [
        vf.ToolCall(
            id=call.get("id") or f"call_{i}",
            name=call["function"]["name"],
            arguments=arguments_text(call["function"].get("arguments")),
        )
        for i, call in enumerate(message.get("tool_calls") or [])
    ]


def openai_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """verifiers' flat tool calls (`id`, `name`, `arguments`) nested under `function`, as OpenAI's."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]
