"""Full-weight updates on running servers, the way vLLM takes them, without dropping rollouts in flight.

    updater = WeightUpdater(api_key_var="VLLM_KEY")
    await updater.init_transfer(servers, init_info, transfer=trainer_joins_group, join=trainer_adds)
    await updater.join_server(replacement)     # a server that joins later: its own init, via `join`
    report = await updater.update(servers, update_info, version=7)

Per server, with vLLM's routes (vLLM 0.33.0, `vllm/entrypoints/rl/online/api_router.py`; served with
`VLLM_SERVER_DEV_MODE=1`, which `ServerSpec(weight_updates=True)` sets):

0. `POST /init_weight_transfer_engine {"init_info": ...}` once per server (NCCL: `master_address`,
   `master_port`, `rank_offset`, `world_size`; the trainer joins the same group meanwhile: `transfer`).
   The NCCL backend fails every update until this happened, so `update` refuses a server it has not
   initialised instead of pausing it for nothing.
1. `POST /pause?mode=keep` on every server: requests in flight freeze where they are (their KV stays),
   new ones wait; nothing is aborted.
2. `POST /start_weight_update`, `POST /update_weights {"update_info": ...}` (the backend's payload,
   checked here per backend first: NCCL needs `names`, `dtype_names`, `shapes` of one length),
   `POST /finish_weight_update {"weight_version": "7"}`: the label vLLM then reports per output token
   range (`weight_versions`), which is how a turn that straddles the update records where it changed.
3. `POST /resume` on every server: frozen requests continue on the new weights.

Every call has a deadline and carries the servers' API key. A failure raises `WeightUpdateFailure` naming
the server and stage. A failure at the pause itself resumes (no weight was touched). A failure once the
update started leaves every server PAUSED (`WeightUpdateFailure.paused`): a server may hold half of the
new weights, and serving them under the old label would be silent corruption. The open update session is
closed first (`/finish_weight_update` with no label), so a retry can start again; recovery is a retry of
`update` (which resumes on success) or, deliberately, `resume(servers)`.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel

from rollout_actors.kernel import Failure
from rollout_actors.rollout.client import auth_headers

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

PauseMode = Literal["keep", "abort"]
NCCL_UPDATE_FIELDS = ("names", "dtype_names", "shapes")
"""vLLM 0.33.0 `NCCLWeightTransferUpdateInfo` (`vllm/distributed/weight_transfer/nccl_engine.py`): one entry
per tensor in each list, all of one length; all three empty reuse the previous update's metadata; any
other key is refused. A list of such objects addresses the workers rank by rank."""
NCCL_INIT_FIELDS = (
    "master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
    "packed_buffer_size_bytes", "packed_num_buffers",
)  # fmt: skip
NCCL_UNIQUE_ID_BYTES = 128  # ncclUniqueId, as vLLM decodes `nccl_unique_id_b64`
"""vLLM 0.33.0 `NCCLWeightTransferInitInfo` (`nccl_common.py`): `rank_offset` and `world_size` required,
and exactly one rendezvous: `master_address` + `master_port`, or `nccl_unique_id_b64`."""
DEFAULT_TIMEOUT_S = 600.0  # loading a large model's weights over NCCL takes minutes, not hours
RESUME_TIMEOUT_S = 30.0  # resume is a flag flip; a server that cannot take it in this long is wedged


class WeightUpdateReport(BaseModel):
    version: int
    servers: list[str]
    paused_s: float
    """From the first pause sent until the last server confirmed resume: how long sampling stood still."""
    total_s: float
    """The whole update as the caller waited for it."""


class TransferJoin(NamedTuple):
    """How a server joining after `init_transfer` (a replacement) enters the trainer's transfer: its own
    `init_info` (NCCL: a rendezvous and ranks for the group the trainer forms with it) and `transfer`, the
    trainer's side of that join, run while the server's call is open."""

    init_info: dict[str, Any]
    transfer: Awaitable[Any] | None = None


Joiner = Callable[[str], Awaitable[TransferJoin]]
"""Given a joining server's URL, the trainer prepares its side and says how the server joins."""


class WeightUpdateFailure(Exception):
    def __init__(self, version: int, stage: str, failures: dict[str, Failure], paused: bool = False) -> None:
        self.version, self.stage, self.failures = version, stage, failures
        self.paused = paused
        """The servers were left paused (the update had started): retry the update, or `resume` them."""
        first = next(iter(failures.items()))
        super().__init__(
            f"weight update to v{version} failed at {stage} on {first[0]}: {first[1].type}: {first[1].message}"
            + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")
            + ("; servers left paused until a retry succeeds or resume()" if paused else "")
        )


def update_info_problems(backend: str, update_info: Any) -> list[str]:
    """Why the servers' transfer `backend` would refuse `update_info` (empty: it would take it). Only
    NCCL's payload is known here; other backends' pass through unchecked."""
    if backend != "nccl":
        return []
    infos = update_info if isinstance(update_info, list) else [update_info]
    for info in infos:
        if not isinstance(info, dict):
            return [f"nccl update_info must be an object (or a list of them), got {type(info).__name__}"]
        unknown = sorted(set(info) - set(NCCL_UPDATE_FIELDS))
        if unknown:
            return [f"nccl update_info has unknown field(s) {unknown} (it takes {list(NCCL_UPDATE_FIELDS)})"]
        values = {key: info.get(key, []) for key in NCCL_UPDATE_FIELDS}
        if not all(isinstance(v, list) for v in values.values()):
            return [f"nccl update_info fields {list(NCCL_UPDATE_FIELDS)} must be lists"]
        lengths = {key: len(v) for key, v in values.items()}
        if len(set(lengths.values())) != 1:
            return [
                f"nccl update_info needs one dtype_names and shapes entry per name, got lengths {lengths}"
            ]
    return []


def init_info_problems(backend: str, init_info: Any) -> list[str]:
    """Why the servers' transfer `backend` would refuse `init_info` (empty: it would take it)."""
    if backend != "nccl":
        return []
    if not isinstance(init_info, dict):
        return [f"nccl init_info must be an object, got {type(init_info).__name__}"]
    unknown = sorted(set(init_info) - set(NCCL_INIT_FIELDS))
    missing = [key for key in ("rank_offset", "world_size") if key not in init_info]
    if unknown or missing:
        return [f"nccl init_info: unknown field(s) {unknown}, missing {missing}"]
    uid = init_info.get("nccl_unique_id_b64")
    addressed = [init_info.get(k) is not None for k in ("master_address", "master_port")]
    if uid and any(addressed) or not uid and not all(addressed):
        return [
            "nccl init_info needs exactly one rendezvous: master_address + master_port, or nccl_unique_id_b64"
        ]
    if uid:
        try:
            decoded = base64.b64decode(uid, validate=True)
        except (ValueError, TypeError):
            return ["nccl init_info: nccl_unique_id_b64 is not standard base64"]
        if len(decoded) != NCCL_UNIQUE_ID_BYTES:
            return [f"nccl init_info: nccl_unique_id_b64 must decode to {NCCL_UNIQUE_ID_BYTES} bytes"]
    return []


class WeightUpdater:
    """Drives vLLM's pause / weight-update / resume routes on a set of servers. One update at a time."""

    def __init__(
        self, api_key_var: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "nccl"
    ) -> None:
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), trust_env=False, headers=auth_headers(api_key_var)
        )
        self._one_at_a_time = asyncio.Lock()
        self.backend = backend
        """The servers' `--weight-transfer-config` backend (`ServerSpec.weight_transfer_backend`)."""
        self._initialised: set[str] = set()
        self._joiner: Joiner | None = None
        self._transfer_started = False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def init_transfer(
        self,
        servers: list[str],
        init_info: dict[str, Any],
        *,
        transfer: Awaitable[Any] | None = None,
        join: Joiner | None = None,
    ) -> None:
        """`/init_weight_transfer_engine` on every server (once each, before its first update). `transfer`
        (the trainer joining the same process group) runs while the calls are open. `join` brings a server
        that joins later (`join_server`) into the transfer; without it such a server is refused."""
        roots = _roots(servers)
        if join is not None:
            self._joiner = join
        problems = init_info_problems(self.backend, init_info)
        if problems:
            raise ValueError("; ".join(problems))
        await self._init(roots, init_info, transfer)
        self._transfer_started = True

    async def join_server(self, server: str) -> None:
        """Before `server` joins routing (a replacement): once transfers were initialised, give it its own
        `/init_weight_transfer_engine` through the `join` callback, since vLLM's NCCL backend fails every
        update on a server that never had one. Raises (keeping it out) when there is no `join`.

        The address is forgotten first: a replacement may reuse a dead server's host and port, and the new
        process has no transfer engine whatever the old one had. Waits for an update in flight."""
        root = _roots([server])[0]
        self._initialised.discard(root)
        if not self._transfer_started:
            return  # the first init_transfer will reach it with the others
        if self._joiner is None:
            raise RuntimeError(
                f"{root} joins after init_weight_transfer and vLLM refuses its updates until it has one: "
                "pass `join` to init_weight_transfer to bring new servers into the transfer"
            )
        init_info, transfer = await self._joiner(server)
        problems = init_info_problems(self.backend, init_info)
        if problems:
            raise ValueError(f"join of {root}: " + "; ".join(problems))
        await self._init([root], init_info, transfer)

    async def _init(
        self, roots: list[str], init_info: dict[str, Any], transfer: Awaitable[Any] | None
    ) -> None:
        async with self._one_at_a_time:
            call = self._each(
                roots,
                "init_weight_transfer_engine",
                lambda s: self._post(s, "/init_weight_transfer_engine", {"init_info": init_info}),
                0,
            )
            await (asyncio.gather(call, transfer) if transfer is not None else call)
            self._initialised.update(roots)

    async def resume(self, servers: list[str]) -> None:
        """Resume servers a failed update left paused, serving whatever weights they hold (a deliberate
        choice: retrying the update is the safe recovery)."""
        await self._resume(_roots(servers), 0)

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
        roots = _roots(servers)
        problems = update_info_problems(self.backend, update_info)
        if problems:
            raise ValueError(f"weight update to v{version}: " + "; ".join(problems))
        async with self._one_at_a_time:
            uninitialised = [root for root in roots if root not in self._initialised]
            if uninitialised:
                refused = RuntimeError("call init_transfer (/init_weight_transfer_engine) before updating")
                failures = {root: Failure.from_exception(refused) for root in uninitialised}
                raise WeightUpdateFailure(version, "init_weight_transfer_engine", failures)
            started = time.monotonic()
            try:
                await self._each(
                    roots, "pause", lambda s: self._post(s, "/pause", params={"mode": mode}), version
                )
            except WeightUpdateFailure:
                await self._resume(roots, version)  # no weight was touched: serving on is safe
                raise
            try:
                await self._load(roots, update_info, version, transfer)
                if on_updated is not None:
                    await on_updated()
            except WeightUpdateFailure as failure:
                await self._close_sessions(roots)
                raise WeightUpdateFailure(version, failure.stage, failure.failures, paused=True) from failure
            except BaseException:
                await self._close_sessions(roots)
                raise
            await self._resume(roots, version)
            now = time.monotonic()
            return WeightUpdateReport(
                version=version, servers=roots, paused_s=now - started, total_s=now - started
            )

    async def _load(
        self, roots: list[str], update_info: Any, version: int, transfer: Awaitable[Any] | None
    ) -> None:
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
            roots, "finish_weight_update", lambda s: self._post(s, "/finish_weight_update", finish), version
        )

    async def _close_sessions(self, roots: list[str]) -> None:
        """Best effort: end an update session a failure left open, without a new label, so a retry can
        start one (vLLM refuses a second start while one is active). The servers stay paused."""
        await asyncio.gather(
            *(self._post(root, "/finish_weight_update", {}, timeout=RESUME_TIMEOUT_S) for root in roots),
            return_exceptions=True,
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


def _roots(servers: list[str]) -> list[str]:
    return [url.rstrip("/").removesuffix("/v1") for url in servers]


class ServerRefused(Exception):
    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"{status_code}: {text}")
        self.status_code = status_code
