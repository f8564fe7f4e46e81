"""Policy publication: a new LoRA adapter reaches every inference server while rollouts keep flowing.

    publisher = PolicyPublisher(server_set_endpoints, storage_dir="/shared/adapters")
    handle = await publisher.publish(LoraAdapter(tensors, lora_config(16, 32, ["q_proj", "v_proj"])), 7)
    # the trainer owns its arrays again here; everything below happens off its path
    policy = await handle.wait()          # ActivePolicy("policy-v7", 7), or raises PublishFailure
    publisher.current()                   # what NEW rollouts use; rollouts in flight keep theirs

Order of a publication: capture (the caller's path: copies only) -> write safetensors and
`adapter_config.json` to shared storage (the publisher's writer thread) -> `POST /v1/load_lora_adapter`
on every server (bounded timeout; bounded retries of what may pass: a dropped connection, 502-504) ->
switch `current()` in one assignment. Any failure leaves the previous policy active and unloads the
adapter from the servers that had taken it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, NamedTuple

from rollout_actors.kernel.faults import ModelError, Unavailable
from rollout_actors.policy.lora import (
    AdapterCapture,
    AdapterLimits,
    CaptureBuffers,
    LoraAdapter,
    capture_adapter,
    check_adapter,
    remove_adapter,
    write_adapter,
)
from rollout_actors.rollout.client import auth_headers
from rollout_actors.wire import Failure

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

logger = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT_S = 120.0  # seconds per attempt: vLLM reads the adapter from disk and warms it on GPU
DEFAULT_RETRIES = 2  # a restarting server or a dropped connection, not a server that keeps refusing
RETRIED_STATUSES = frozenset({502, 503, 504})
"""Answers that say "not now" (a proxy, or a server still starting). vLLM 0.33.0 answers a 500 only when
`add_lora` raised (`openai/models/serving.py`: the loader refused the files, or the engine is dead): the
same files get the same answer, so a 500 is a refusal like a 4xx and is not retried."""
DEFAULT_WRITE_TIMEOUT_S = 300.0  # 256 MiB to a slow network filesystem, with room to spare
RETRY_BACKOFF = (0.5, 2.0)  # first delay, cap: retries spread over seconds, never a tight loop
ALREADY_LOADED = "has already been loaded"
"""vLLM's 400 for a name it holds. On a retry it means our timed-out first attempt did land."""

Stage = Literal["servers", "write", "load"]


class ActivePolicy(NamedTuple):
    """The adapter NEW rollouts send as `model`, and the policy version it carries."""

    name: str
    version: int


class NoServers(Unavailable):
    """No live inference server to load the adapter on."""


class LoadRefused(ModelError):
    """An inference server refused the adapter (its status code and body say why)."""


class PublishFailure(Exception):
    """A publication that did not switch the active policy, naming the server that failed it.

    `stage` says where it stopped: "servers" (none live), "write" (shared storage), "load" (a server
    refused or timed out; `failures` maps every such server url to its classified failure).
    """

    def __init__(
        self,
        version: int,
        name: str,
        stage: Stage,
        failures: dict[str, Failure],
        failure: Failure | None = None,
    ):
        self.version = version
        self.name = name
        self.stage = stage
        self.failures = failures
        self.server = next(iter(failures), None) if stage == "load" else None
        """The (first) server that failed the load; None when no server was at fault."""
        self.failure = failure or next(iter(failures.values()))
        where = f"on {self.server}" if self.server else f"at {stage}"
        status = f" {self.failure.status_code}" if self.failure.status_code else ""
        super().__init__(
            f"publishing {name} (v{version}) failed {where}: {self.failure.type}{status}: "
            f"{self.failure.message}" + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")
        )


class PublishHandle:
    """One publication in progress. Owned by its publisher; `wait()` is bounded by the publisher's
    write timeout plus its load timeouts and retries."""

    def __init__(self, name: str, version: int, task: asyncio.Task[ActivePolicy], blocked_s: float):
        self.name = name
        self.version = version
        self.blocked_s = blocked_s
        """Seconds the caller spent inside `publish()` (the capture)."""
        self._task = task

    def done(self) -> bool:
        return self._task.done()

    async def wait(self, timeout: float | None = None) -> ActivePolicy:
        """The policy now active, or raises `PublishFailure` (or TimeoutError past `timeout`)."""
        return await asyncio.wait_for(asyncio.shield(self._task), timeout)


class PolicyPublisher:
    """Publishes LoRA adapters to a set of OpenAI-compatible servers (vLLM or the stand-in).

    `endpoints`: base URLs (`http://host:port` or `.../v1`), or a callable returning the live ones at
    publication time (e.g. `InferenceServerSet.endpoints`). `storage_dir` must be readable by every
    server under the same path (shared storage on a cluster). Call `aclose()` when done.
    """

    def __init__(
        self,
        endpoints: Sequence[str] | Callable[[], Sequence[str]],
        storage_dir: str | os.PathLike[str],
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        *,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        name_prefix: str = "policy",
        retain: int = 4,
        initial: ActivePolicy | None = None,
        limits: AdapterLimits = AdapterLimits(),
        api_key_var: str | None = None,
    ):
        if retries < 0 or load_timeout_s <= 0 or retain < 1:
            raise ValueError("retries >= 0, load_timeout_s > 0 and retain >= 1 are required")
        self._endpoints = endpoints
        self.storage_dir = Path(storage_dir)
        self.load_timeout_s = load_timeout_s
        self.retries = retries
        self.write_timeout_s = write_timeout_s
        self.name_prefix = name_prefix
        self.retain = retain
        self._current = initial
        self._pending: dict[int, PublishHandle] = {}
        self._published: list[tuple[ActivePolicy, Path]] = []
        """Live adapters, oldest first: the newest `retain` (the active one last), and any older one a
        rollout still uses (retired when its last user checks in)."""
        self._users: Counter[int] = Counter()
        """Rollouts in flight per version (`checkout` / `checkin`)."""
        self._retiring: set[asyncio.Task[None]] = set()
        # One writer thread: publications serialise to storage in order and never take the default
        # executor's threads away from whoever else runs on this loop.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-writer")
        self.limits = limits
        """What the servers accept: an adapter past these is refused before anything is written."""
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(load_timeout_s), trust_env=False, headers=auth_headers(api_key_var)
        )
        self._buffers = CaptureBuffers()
        self._order = asyncio.Lock()
        self._closed = False

    def current(self) -> ActivePolicy | None:
        """The active policy; None until the first publication (rollouts use the base model)."""
        return self._current

    def checkout(self, version: int | None = None) -> ActivePolicy | None:
        """The active policy (or, with `version`, that published version while it is still loaded),
        counted as in use until `checkin`: an adapter a rollout is using is never unloaded under it,
        however many versions are published meanwhile. None: no such adapter is loaded."""
        policy = self._current if version is None else self.loaded(version)
        if policy is not None:
            self._users[policy.version] += 1
        return policy

    def loaded(self, version: int) -> ActivePolicy | None:
        """The published adapter of `version`, if every server still holds it."""
        return next((policy for policy, _ in self._published if policy.version == version), None)

    def checkin(self, version: int) -> None:
        """The rollout that checked `version` out is done with it; a retired version is unloaded now."""
        self._users[version] -= 1
        if self._users[version] <= 0:
            del self._users[version]
            if not self._closed and self._retirable():
                task = asyncio.get_running_loop().create_task(self._retire_in_order())
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    def endpoints(self) -> list[str]:
        raw = self._endpoints() if callable(self._endpoints) else self._endpoints
        return [_server_root(url) for url in raw]

    async def publish(
        self, adapter: LoraAdapter | str | os.PathLike[str], version: int, donate: bool = False
    ) -> PublishHandle:
        """Capture `adapter` and return; writing and loading continue in the background. `donate=True`
        hands the arrays over (frozen, not copied; see `capture_adapter`).

        Raises ValueError at once, before anything is written, for an adapter vLLM would refuse (naming
        the tensor or setting: rank past the servers' `max_lora_rank`, `bias`, DoRA, `modules_to_save`,
        tensor names, modules the model cannot adapt) or a version that is not newer than the active one
        and every publication in flight.
        """
        started = time.perf_counter()
        if self._closed:
            raise RuntimeError("publisher is closed")
        newest = max([self._current.version if self._current else -1, *self._pending])
        if version <= newest:
            raise ValueError(f"policy version {version} is not newer than {newest}")
        capture = capture_adapter(adapter, self._buffers, donate=donate)
        try:
            check_adapter(capture, self.limits)  # vLLM's own rules (rank, bias, DoRA, tensor names, modules)
        except ValueError:
            self._buffers.give_back(capture)
            raise
        name = f"{self.name_prefix}-v{version}"
        task = asyncio.create_task(self._run(capture, name, version), name=f"publish-{name}")
        handle = PublishHandle(name, version, task, time.perf_counter() - started)
        self._pending[version] = handle
        task.add_done_callback(functools.partial(self._finished, version))
        return handle

    async def load_current(self, endpoint: str) -> None:
        """Load the active adapter on one server (a replacement joining the set) before it takes
        traffic. Raises `PublishFailure` naming it.

        Waits for a publication in flight: that one read the server list before this server joined,
        so loading the adapter it replaces would leave this server without the new one.
        """
        async with self._order:
            if not self._published:
                return
            policy, path = self._published[-1]
            server = _server_root(endpoint)
            failure = await self._load(server, policy.name, path, accept_loaded=True)
            if failure is not None:
                raise PublishFailure(policy.version, policy.name, "load", {server: failure})

    def _finished(self, version: int, task: asyncio.Task[ActivePolicy]) -> None:
        self._pending.pop(version, None)
        # Retrieved here, so a failure nobody waited for is logged rather than lost at garbage collection.
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning("%s", exc)

    async def aclose(self) -> None:
        """Cancel publications in flight (the active policy stays) and release the writer thread."""
        self._closed = True
        tasks = [handle._task for handle in self._pending.values()] + list(self._retiring)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()
        self._writer.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------- background

    async def _run(self, capture: AdapterCapture, name: str, version: int) -> ActivePolicy:
        async with self._order:  # one publication at a time: servers see versions in order
            servers = self.endpoints()
            if not servers:
                failure = NoServers("no live inference server to load the adapter").failure
                raise PublishFailure(version, name, "servers", {}, failure=failure)
            directory = f"{name}-{uuid.uuid4().hex[:8]}"  # never reuse a path a server may have cached
            loop = asyncio.get_running_loop()
            write = loop.run_in_executor(self._writer, write_adapter, capture, self.storage_dir, directory)
            try:
                path = await asyncio.wait_for(write, self.write_timeout_s)
            except (OSError, TimeoutError) as exc:
                failure = Failure.from_exception(exc)
                raise PublishFailure(version, name, "write", {}, failure=failure) from exc
            # Written: nothing reads the capture any more, so its memory can take the next one.
            # (Not after a timeout: the writer thread may still be reading it.)
            self._buffers.give_back(capture)
            results = await asyncio.gather(*(self._load(server, name, path) for server in servers))
            failures = {server: f for server, f in zip(servers, results, strict=True) if f is not None}
            if failures:
                loaded = [server for server, f in zip(servers, results, strict=True) if f is None]
                await self._unload_all(loaded, name)
                remove_adapter(path)
                raise PublishFailure(version, name, "load", failures)
            policy = ActivePolicy(name, version)
            self._current = policy  # the switch: one assignment, seen by the next rollout to start
            self._published.append((policy, path))
            await self._retire(servers)
            return policy

    async def _load(self, server: str, name: str, path: Path, accept_loaded: bool = False) -> Failure | None:
        """POST load_lora_adapter with bounded attempts; None on success, else the last failure.

        "Already loaded" is success on a retry (our timed-out attempt landed) or with `accept_loaded`;
        on a first attempt it is a refusal: some other adapter holds the name.
        """
        body = {"lora_name": name, "lora_path": str(path)}
        failure: Failure | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(RETRY_BACKOFF[0] * 2 ** (attempt - 1), RETRY_BACKOFF[1]))
            try:
                response = await self._http.post(f"{server}/v1/load_lora_adapter", json=body)
            except httpx.HTTPError as exc:  # refused, reset, timed out: the server may come back
                failure = Failure.from_exception(exc)
                continue
            if response.status_code == 200:
                return None
            text = response.text[:2000]
            if (attempt or accept_loaded) and response.status_code == 400 and ALREADY_LOADED in text:
                return None  # an earlier attempt that timed out on our side did land
            failure = LoadRefused(text, status_code=response.status_code).failure
            if response.status_code not in RETRIED_STATUSES:
                return failure  # a refusal (4xx, or the loader's 500): asking again gets the same answer
        return failure

    async def _unload_all(self, servers: list[str], name: str) -> None:
        async def unload(server: str) -> None:
            try:
                await self._http.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": name})
            except httpx.HTTPError as exc:
                logger.warning("unloading %s from %s failed: %s", name, server, exc)

        await asyncio.gather(*(unload(server) for server in servers))

    def _retirable(self) -> list[tuple[ActivePolicy, Path]]:
        """The newest `retain` adapters stay; an older one stays only while a rollout uses it."""
        older = self._published[: max(0, len(self._published) - self.retain)]
        return [entry for entry in older if entry[0].version not in self._users]

    async def _retire_in_order(self) -> None:
        async with self._order:
            await self._retire(self.endpoints())

    async def _retire(self, servers: list[str]) -> None:
        # Best effort: an old adapter left loaded costs server memory, not correctness.
        for entry in self._retirable():
            self._published.remove(entry)
            await self._unload_all(servers, entry[0].name)
            remove_adapter(entry[1])


def _server_root(url: str) -> str:
    """`http://h:p/v1/` -> `http://h:p`: the admin routes live beside the OpenAI ones."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
