"""The stand-in's engine core: which requests run, which wait, and the clock they run on.

Modelled on vLLM's v1 scheduler (vLLM 0.33.0, `vllm/v1/core/sched/scheduler.py`) where the plane depends
on it:

- **A finite KV budget.** A request holds `prompt + completion` tokens of KV cache while it runs; one that
  does not fit waits. `vllm:kv_cache_usage_perc` and `vllm:num_requests_waiting` at `/metrics` are these
  real figures, so load-aware code can be tested.
- **`max_loras`.** A batch holds at most `max_loras` distinct adapters: a request for another adapter is
  skipped (it waits, it does not fail) until a running adapter's last request ends. Base-model requests
  are never held back by it.
- **Pause and resume** (`/pause?mode=keep|wait|abort`, `/resume`): in `keep` mode running requests freeze
  where they are and continue on resume (new ones queue); in `abort` mode they end at once with what they
  sampled so far; in `wait` mode `/pause` returns once they finished. `abort` and `wait` refuse new
  requests with 503 until resume, as vLLM does.
- **The weight version** (`/finish_weight_update`): what every token is sampled under, reported per output
  token range when a request asks for `return_weight_versions`.

Single event loop: plain state, no locks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

PauseMode = Literal["keep", "wait", "abort"]
DEFAULT_VERSION = "default"  # vLLM's label for the weights a server started with


@dataclass(eq=False)
class Slot:
    """One admitted request: what it holds while it runs."""

    adapter: str | None
    kv_tokens: int
    admitted: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    def __init__(self, max_loras: int, kv_cache_tokens: int) -> None:
        self.max_loras = max_loras
        self.kv_cache_tokens = kv_cache_tokens
        self.kv_used = 0
        self.weight_version = DEFAULT_VERSION
        self.pause_mode: PauseMode | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._paused = asyncio.Event()
        """Set while paused: wakes every running clock."""
        self._running: list[Slot] = []
        self._waiting: deque[Slot] = deque()

    # ------------------------------------------------------------------------------------ figures
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_cache_tokens

    def refuses_new(self) -> bool:
        """`abort` and `wait` pauses answer new requests 503 until resume; `keep` queues them."""
        return self.pause_mode in ("abort", "wait")

    # ---------------------------------------------------------------------------------- admission
    async def admit(self, adapter: str | None, kv_tokens: int) -> Slot:
        """Wait until the request may run. The caller must `release` the slot (also when cancelled)."""
        slot = Slot(adapter, min(kv_tokens, self.kv_cache_tokens))
        self._waiting.append(slot)
        self._schedule()
        try:
            await slot.admitted.wait()
        except BaseException:
            self.release(slot)
            raise
        return slot

    def release(self, slot: Slot) -> None:
        if slot in self._running:
            self._running.remove(slot)
            self.kv_used -= slot.kv_tokens
        elif slot in self._waiting:
            self._waiting.remove(slot)
        self._schedule()

    def _schedule(self) -> None:
        """Admit waiting requests in order; one that cannot join the batch (KV, max_loras) is skipped and
        keeps its place, like vLLM's `skip_request`."""
        if self.pause_mode is not None:
            return
        for slot in list(self._waiting):
            if self.kv_used + slot.kv_tokens > self.kv_cache_tokens:
                continue
            adapters = {s.adapter for s in self._running if s.adapter is not None}
            if slot.adapter is not None and slot.adapter not in adapters and len(adapters) >= self.max_loras:
                continue
            self._waiting.remove(slot)
            self._running.append(slot)
            self.kv_used += slot.kv_tokens
            slot.admitted.set()

    # --------------------------------------------------------------------------------------- clock
    async def run_for(self, seconds: float) -> float | None:
        """Spend `seconds` of running time. None when done; if a pause interrupts, the running time spent
        so far (the caller then stops on `abort`, or waits for `resumed` and continues)."""
        if seconds <= 0:
            return None
        loop = asyncio.get_running_loop()
        started = loop.time()
        paused = asyncio.ensure_future(self._paused.wait())
        try:
            done, _ = await asyncio.wait([paused], timeout=seconds)
        finally:
            paused.cancel()
        return None if not done else loop.time() - started

    async def resumed(self) -> None:
        await self._resumed.wait()

    # ---------------------------------------------------------------------------------- pause/resume
    async def pause(self, mode: PauseMode) -> None:
        self.pause_mode = mode
        self._resumed.clear()
        self._paused.set()
        if mode == "wait":
            while self._running:  # in-flight requests finish; nothing new is admitted meanwhile
                await asyncio.sleep(0.01)

    def resume(self) -> None:
        self.pause_mode = None
        self._paused.clear()
        self._resumed.set()
        self._schedule()
