"""Full-weight updates on running servers, the way vLLM takes them, without dropping rollouts in flight.

    updater = WeightUpdater(api_key_var="VLLM_KEY")
    report = await updater.update(["http://gpu-1:8000", "http://gpu-2:8000"], update_info, version=7)

Per server, with vLLM's routes (vLLM 0.33.0, `vllm/entrypoints/rl/online/api_router.py`; served with
`VLLM_SERVER_DEV_MODE=1`, which `ServerSpec(weight_updates=True)` sets):

1. `POST /pause?mode=keep` on every server: requests in flight freeze where they are (their KV stays),
   new ones queue; nothing is aborted.
2. `POST /start_weight_update`, `POST /update_weights {"update_info": ...}` (the transfer backend's
   payload; a trainer that broadcasts over NCCL sends while these calls are open: `transfer`),
   `POST /finish_weight_update {"weight_version": "7"}`: the label vLLM then reports per output token
   range (`weight_versions`), which is how a turn that straddles the update records where it changed.
3. `POST /resume` on every server, whatever happened: frozen requests continue on the new weights.

Every call has a deadline and carries the servers' API key. A failure names the server and stage; the
servers are resumed, and the version is not recorded (servers may hold either weights: update again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Literal

from pydantic import BaseModel

from rollout_actors.client import auth_headers
from rollout_actors.kernel import Failure

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

PauseMode = Literal["keep", "abort"]
DEFAULT_TIMEOUT_S = 600.0  # loading a large model's weights over NCCL takes minutes, not hours
RESUME_TIMEOUT_S = 30.0  # resume is a flag flip; a server that cannot take it in this long is wedged


class WeightUpdateReport(BaseModel):
    version: int
    servers: list[str]
    paused_s: float
    """From the first pause sent until the last server confirmed resume: how long sampling stood still."""
    total_s: float
    """The whole update as the caller waited for it."""


class WeightUpdateFailure(Exception):
    def __init__(self, version: int, stage: str, failures: dict[str, Failure]) -> None:
        self.version, self.stage, self.failures = version, stage, failures
        first = next(iter(failures.items()))
        super().__init__(
            f"weight update to v{version} failed at {stage} on {first[0]}: {first[1].type}: {first[1].message}"
            + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")
        )


class WeightUpdater:
    """Drives vLLM's pause / weight-update / resume routes on a set of servers. One update at a time."""

    def __init__(self, api_key_var: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), trust_env=False, headers=auth_headers(api_key_var)
        )
        self._one_at_a_time = asyncio.Lock()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def update(
        self,
        servers: list[str],
        update_info: dict[str, Any] | list[dict[str, Any]],
        version: int,
        *,
        transfer: Awaitable[Any] | None = None,
        mode: PauseMode = "keep",
        on_updated: Any = None,
    ) -> WeightUpdateReport:
        """Pause every server, load the new weights, label them `version`, resume. `on_updated` is
        awaited after every server holds them and before any resumes (the plane tells its workers the
        new version there, so turns sent after resume carry its `cache_salt`)."""
        roots = [url.rstrip("/").removesuffix("/v1") for url in servers]
        async with self._one_at_a_time:
            started = time.monotonic()
            try:
                await self._each(
                    roots, "pause", lambda s: self._post(s, "/pause", params={"mode": mode}), version
                )
                await self._each(
                    roots, "start_weight_update", lambda s: self._post(s, "/start_weight_update"), version
                )
                body = {"update_info": update_info}
                updates = self._each(
                    roots, "update_weights", lambda s: self._post(s, "/update_weights", body), version
                )
                await (asyncio.gather(updates, transfer) if transfer is not None else updates)
                finish = {"weight_version": str(version)}
                await self._each(
                    roots,
                    "finish_weight_update",
                    lambda s: self._post(s, "/finish_weight_update", finish),
                    version,
                )
                if on_updated is not None:
                    await on_updated()
            finally:
                await self._resume(roots, version)
            now = time.monotonic()
            return WeightUpdateReport(
                version=version, servers=roots, paused_s=now - started, total_s=now - started
            )

    async def _resume(self, roots: list[str], version: int) -> None:
        async def resume(server: str) -> None:
            await self._post(server, "/resume", timeout=RESUME_TIMEOUT_S)

        await self._each(roots, "resume", resume, version)

    async def _each(self, roots: list[str], stage: str, call: Any, version: int) -> None:
        results = await asyncio.gather(*(call(server) for server in roots), return_exceptions=True)
        failures = {
            server: Failure.from_exception(result, getattr(result, "status_code", None))
            for server, result in zip(roots, results, strict=True)
            if isinstance(result, BaseException)
        }
        if failures:
            raise WeightUpdateFailure(version, stage, failures)

    async def _post(
        self, server: str, path: str, body: Any = None, params: Any = None, timeout: float | None = None
    ) -> None:
        options: dict[str, Any] = {"params": params} if params else {}
        if timeout is not None:
            options["timeout"] = timeout
        response = await self._http.post(f"{server}{path}", json=body, **options)
        if response.status_code != 200:
            raise ServerRefused(response.status_code, response.text[:2000])


class ServerRefused(Exception):
    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"{status_code}: {text}")
        self.status_code = status_code
