"""The stand-in's engine core: which requests run, which wait, and the clock they run on.

Modelled on vLLM's v1 scheduler (vLLM 0.33.0, `vllm/v1/core/sched/scheduler.py`, with the KV cache of
`standin.kv`) where the plane depends on it:

- **KV blocks as tokens are generated.** A request is admitted (first come, first served) when the blocks
  its tokens need, less those its prefix finds cached, are free; otherwise it and everything behind it
  waits. While it runs it takes one more block each time its sampled tokens fill one.
- **Preemption by recompute.** When a running request needs a block and none is free, the request that
  joined the running batch last is preempted: its blocks are freed (they stay in the prefix cache until
  evicted) and it goes back to the head of the queue with the tokens it has sampled; when it is admitted
  again it recomputes its prompt and those tokens, less what the prefix cache still holds. A request that
  is itself the last one preempts itself. `vllm:num_preemptions` counts these.
- **Prefill on one shared lane.** Computing a prompt's uncached tokens takes `prefill_token_latency_s`
  each, and prefills run one after another (a GPU's compute is shared): a recompute delays the first
  token of every request admitted after it, and while the lane is busy every running request decodes at
  half speed (vLLM's chunked prefill puts prefill chunks into the same steps as decodes). Zero by default
  (prefill is free and instant).
- **The call's own clock**: `latency_s` once, then `per_token_latency_s` per sampled token (all tokens at
  once at `latency_s` when that is zero). Time spent waiting or recomputing does not advance it.
- **`max_loras`.** A batch holds at most `max_loras` distinct adapters: a request for another adapter is
  skipped (it waits, it does not fail) until a running adapter's last request ends. Base-model requests
  are never held back by it.
- **Pause and resume** (`/pause?mode=keep|wait|abort`, `/resume`): in `keep` mode running requests freeze
  where they are and continue on resume (new ones queue); in `abort` mode they end at once with what they
  sampled so far; in `wait` mode `/pause` returns once they finished. `abort` and `wait` refuse new
  requests with 503 until resume, as vLLM does.
- **The weight version** (`/finish_weight_update`): what every token is sampled under, reported per output
  token range when a request asks for `return_weight_versions`.

`vllm:kv_cache_usage_perc`, `vllm:num_requests_running|waiting`, `vllm:num_preemptions` and
`vllm:prefix_cache_queries|hits` at `/metrics` are these real figures, so load-aware code can be tested.

Single event loop: plain state, no locks.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rollout_actors.inference.standin.kv import BLOCK_SIZE, BlockPool, blocks_for, chain_hashes

PauseMode = Literal["keep", "wait", "abort"]
DECODE_SPEED_WHILE_PREFILLING = 0.5  # a step that carries a prefill chunk takes about two decode-only steps
CLOCK_SLACK_S = 1e-3
LANE_HISTORY = 100_000  # prefill spans kept: far more than any clock waits across
DEFAULT_VERSION = "default"  # vLLM's label for the weights a server started with


@dataclass(eq=False)
class Slot:
    """One request: its tokens (the whole completion is drafted up front), its clock and its blocks."""

    adapter: str | None
    token_ids: Sequence[int]
    """Prompt ids followed by every completion id the request will sample."""
    num_prompt: int
    latency: float = 0.0
    per_token: float = 0.0
    others: tuple[int, ...] = ()
    """Prompt lengths of the call's other sequences (a completions call with several prompts): they
    grow alongside this one and hold blocks of their own, outside the prefix cache."""
    salt: str | None = None
    progress: float = 0.0
    """Seconds of the call's own clock spent (fixed latency, then decoding)."""
    blocks: list[int] = field(default_factory=list)
    """The sequence's blocks, in token order."""
    copy_blocks: list[int] = field(default_factory=list)
    """Blocks of the other sequences."""
    hashes: list[bytes] = field(default_factory=list)
    num_cached: int = 0
    """Leading blocks registered in the prefix cache."""
    num_preemptions: int = 0
    prefill_tokens: int = 0
    """Tokens computed at the last admission: what the prefix cache did not hold."""
    max_blocks: int = 0
    """The whole cache: a request larger than it holds all of it (vLLM refuses to start instead)."""
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    preempted: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def tokens_done(self, progress: float | None = None) -> int:
        """Completion tokens sampled after `progress` seconds of the call's clock."""
        progress = self.progress if progress is None else progress
        if progress <= 0 or progress < self.latency:  # nothing is sampled before the clock runs
            return 0
        if self.per_token <= 0:
            return self.num_output
        return min(self.num_output, int((progress - self.latency) / self.per_token + 1e-9))

    def blocks_needed(self, done: int) -> int:
        return min(
            self.max_blocks,
            blocks_for(self.num_prompt + done) + sum(blocks_for(p + done) for p in self.others),
        )

    def next_block_at(self) -> float | None:
        """The clock reading at which the sampled tokens need one more block; None if they never do."""
        held = len(self.blocks) + len(self.copy_blocks)
        for done in range(self.tokens_done() + 1, self.num_output + 1):
            if self.blocks_needed(done) > held:
                return self.latency + (done * self.per_token if self.per_token > 0 else 0.0)
        return None


class Engine:
    def __init__(self, max_loras: int, kv_cache_tokens: int, prefill_token_latency_s: float = 0.0) -> None:
        self.max_loras = max_loras
        self.kv_cache_tokens = kv_cache_tokens
        self.pool = BlockPool(max(1, kv_cache_tokens // BLOCK_SIZE))
        self.prefill_token_latency_s = prefill_token_latency_s
        self.weight_version = DEFAULT_VERSION
        self.pause_mode: PauseMode | None = None
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache at admission (requests never preempted: vLLM's count)."""
        self.prefix_cache_hits = 0
        self._prefill_free_at = 0.0
        """When the shared prefill lane finishes what it was given (loop time)."""
        self._lane_busy: deque[tuple[float, float]] = deque(maxlen=LANE_HISTORY)
        """The prefill lane's busy spans (start, end), in order, that a running clock may still ask about."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._paused = asyncio.Event()
        """Set while paused: wakes every running clock."""
        self._running: dict[Slot, None] = {}
        """In the order they joined the batch: the last one is preempted first. A dict as an ordered set:
        thousands run at once, and joining or leaving must not scan them."""
        self._adapters: Counter[str] = Counter()
        """Running requests per adapter: the distinct adapters of the batch, for `max_loras`."""
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
        return self.pool.usage()

    def refuses_new(self) -> bool:
        """`abort` and `wait` pauses answer new requests 503 until resume; `keep` queues them."""
        return self.pause_mode in ("abort", "wait")

    # ---------------------------------------------------------------------------------- admission
    async def admit(self, slot: Slot) -> Slot:
        """Wait until the request runs and its prompt is computed. The caller must `release` the slot
        (also when cancelled)."""
        slot.max_blocks = self.pool.num_blocks
        slot.hashes = chain_hashes(slot.token_ids[: slot.num_prompt], self._extra(slot), slot.salt)
        self._waiting.append(slot)
        self._schedule()
        try:
            await self._computed(slot)
        except BaseException:
            self.release(slot)
            raise
        return slot

    def release(self, slot: Slot) -> None:
        if slot in self._running:
            self._leave(slot)
            self._free(slot)
        elif slot in self._waiting:
            self._waiting.remove(slot)
        self._schedule()

    async def _computed(self, slot: Slot) -> None:
        """Until `slot` is admitted and its prefill is done; a preemption meanwhile starts it over."""
        loop = asyncio.get_running_loop()
        while True:
            await slot.admitted.wait()
            start = max(loop.time(), self._prefill_free_at)
            done_at = start + slot.prefill_tokens * self.prefill_token_latency_s
            self._prefill_free_at = done_at
            if done_at > start:
                self._lane_busy.append((start, done_at))
            if done_at <= loop.time():
                return
            preempted = asyncio.ensure_future(slot.preempted.wait())
            try:
                await asyncio.wait([preempted], timeout=done_at - loop.time())
            finally:
                preempted.cancel()
            if not slot.preempted.is_set():
                return

    def _schedule(self) -> None:
        """Admit waiting requests in order. One that needs more blocks than are free stops admission
        (vLLM's FCFS `break`); one that cannot join for `max_loras` is skipped and keeps its place."""
        if self.pause_mode is not None:
            return
        skipped: list[Slot] = []
        while self._waiting:
            slot = self._waiting[0]
            adapter = slot.adapter
            if (
                adapter is not None
                and adapter not in self._adapters
                and len(self._adapters) >= self.max_loras
            ):
                skipped.append(self._waiting.popleft())
                continue
            if not self._allocate_prompt(slot):
                break
            self._waiting.popleft()
            self._running[slot] = None
            if adapter is not None:
                self._adapters[adapter] += 1
            slot.preempted.clear()
            slot.admitted.set()
        self._waiting.extendleft(reversed(skipped))

    def _leave(self, slot: Slot) -> None:
        del self._running[slot]
        if slot.adapter is not None:
            self._adapters[slot.adapter] -= 1
            if not self._adapters[slot.adapter]:
                del self._adapters[slot.adapter]

    def _allocate_prompt(self, slot: Slot) -> bool:
        """Blocks for everything the request holds so far, its cached prefix found first (vLLM's
        `get_computed_blocks` then `allocate_slots`). False, with nothing taken, when they do not fit."""
        pool, done = self.pool, slot.tokens_done()
        num_tokens = slot.num_prompt + done
        self._extend_hashes(slot, num_tokens)
        # A full hit still recomputes the last token to get its logits (vLLM: num_tokens - 1).
        hit = pool.longest_hit(slot.hashes[: (num_tokens - 1) // BLOCK_SIZE])
        fresh = slot.blocks_needed(done) - len(hit)
        if fresh > pool.num_free - pool.evictable(hit):
            return False
        pool.take(hit)
        allocated = pool.allocate(fresh)
        assert allocated is not None
        main = blocks_for(num_tokens) - len(hit)
        slot.blocks, slot.copy_blocks = hit + allocated[:main], allocated[main:]
        slot.num_cached = len(hit)
        self._cache_full(slot, num_tokens)
        if slot.num_preemptions == 0:  # vLLM keeps a preempted request's lookups out of these counters
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += len(hit) * BLOCK_SIZE
        slot.prefill_tokens = num_tokens - len(hit) * BLOCK_SIZE
        return True

    # --------------------------------------------------------------------------------- decoding
    def _grow(self, slot: Slot) -> bool:
        """Blocks for the tokens `slot` has sampled, preempting the newest running requests while none
        is free. False when `slot` itself had to be preempted."""
        done, preempted = slot.tokens_done(), False
        while True:
            missing = slot.blocks_needed(done) - len(slot.blocks) - len(slot.copy_blocks)
            if missing <= 0:
                break
            allocated = self.pool.allocate(missing)
            if allocated is not None:
                main = blocks_for(slot.num_prompt + done) - len(slot.blocks)
                slot.blocks += allocated[:main]
                slot.copy_blocks += allocated[main:]
                break
            victim, preempted = next(reversed(self._running)), True
            self._preempt(victim)
            if victim is slot:
                self._schedule()
                return False
        self._cache_full(slot, slot.num_prompt + done)
        if preempted:  # vLLM admits nothing in a step that preempted; the next step may
            self._schedule()
        return True

    def _preempt(self, slot: Slot) -> None:
        self._leave(slot)
        self._free(slot)
        slot.num_preemptions += 1
        self.num_preemptions += 1
        slot.admitted.clear()
        slot.preempted.set()
        self._waiting.appendleft(slot)

    def _free(self, slot: Slot) -> None:
        self.pool.free(slot.copy_blocks)
        self.pool.free(slot.blocks)
        slot.blocks, slot.copy_blocks = [], []

    def _cache_full(self, slot: Slot, num_tokens: int) -> None:
        """Register the blocks `num_tokens` have filled since the last call (vLLM's `cache_full_blocks`)."""
        self._extend_hashes(slot, num_tokens)
        full = min(num_tokens // BLOCK_SIZE, len(slot.blocks))
        for index in range(slot.num_cached, full):
            self.pool.cache(slot.blocks[index], slot.hashes[index])
        slot.num_cached = max(slot.num_cached, full)

    def _extend_hashes(self, slot: Slot, num_tokens: int) -> None:
        if num_tokens // BLOCK_SIZE > len(slot.hashes):
            parent = slot.hashes[-1] if slot.hashes else b""
            slot.hashes += chain_hashes(
                slot.token_ids[:num_tokens], self._extra(slot), slot.salt, len(slot.hashes), parent
            )

    @staticmethod
    def _extra(slot: Slot) -> tuple[str, ...]:
        return (slot.adapter,) if slot.adapter is not None else ()

    def _prefilling(self, start: float, end: float) -> float:
        """Seconds of [start, end] the prefill lane was busy."""
        total = 0.0
        for busy_start, busy_end in reversed(self._lane_busy):
            if busy_end <= start:
                break
            total += max(0.0, min(end, busy_end) - max(start, busy_start))
        return total

    # --------------------------------------------------------------------------------------- clock
    async def run_for(self, slot: Slot, seconds: float) -> float | None:
        """Spend `seconds` of the call's clock, taking blocks as its tokens fill them and riding out
        preemptions (back to the queue, then recompute). None when done; if a pause interrupts, the
        clock time spent so far (the caller then stops on `abort`, or waits for `resumed` and continues)."""
        if seconds <= 0:
            return None
        loop = asyncio.get_running_loop()
        target, spent = slot.progress + seconds, 0.0
        while True:
            if slot.preempted.is_set() or not self._grow(slot):  # preempted while it was paused, or now
                await self._computed(slot)
                continue
            if slot.progress >= target - 1e-9:
                return None
            block_at = slot.next_block_at()
            until = target if block_at is None else min(target, max(block_at, slot.progress))
            started, need = loop.time(), until - slot.progress
            interrupts = [
                asyncio.ensure_future(self._paused.wait()),
                asyncio.ensure_future(slot.preempted.wait()),
            ]
            try:
                await asyncio.wait(interrupts, timeout=need, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in interrupts:
                    waiter.cancel()
            now = loop.time()
            ran = now - started - (1 - DECODE_SPEED_WHILE_PREFILLING) * self._prefilling(started, now)
            if not (slot.preempted.is_set() or self._paused.is_set()) and ran > need - CLOCK_SLACK_S:
                ran = need  # the timer may fire a hair early; the clock reads its own target
            ran = max(0.0, min(ran, need))
            slot.progress += ran
            spent += ran
            if slot.preempted.is_set():
                await self._computed(slot)
            elif self._paused.is_set():
                return spent

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
