"""The stand-in's KV cache behaves like vLLM v1's under pressure: blocks taken as tokens are sampled,
preemption by recompute of the newest running request, the recompute charged on the shared prefill lane,
and a prefix cache of chained full-block hashes with LRU eviction, all visible at `/metrics` under vLLM's
names. Engine tests drive `Engine` on its own loop with small latencies; they assert on order and counts,
never on durations."""

from __future__ import annotations

import asyncio
import re

import pytest
from waiting import runner

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

from conftest import served_like_vllm

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.standin import StandinServer
from rollout_actors.inference.standin.engine import Engine, Slot
from rollout_actors.inference.standin.kv import BLOCK_SIZE

DEADLINE_S = 60


run = runner(DEADLINE_S)


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def slot(prompt_ids: list[int], out: int, per_token: float = 0.0, latency: float = 0.0, **kwargs) -> Slot:
    completion = prompt(50_000 + len(prompt_ids), out)
    adapter = kwargs.pop("adapter", None)
    return Slot(adapter, prompt_ids + completion, len(prompt_ids), latency, per_token, **kwargs)


async def serve(engine: Engine, s: Slot, events: list | None = None, name: str = "") -> Slot:
    """One call: admitted, its whole clock run, released (what the server's `_run` does)."""
    await engine.admit(s)
    if events is not None:
        events.append((name, "computed"))
    try:
        await engine.run_for(s, s.latency + s.per_token * s.num_output)
    finally:
        engine.release(s)
    if events is not None:
        events.append((name, "done"))
    return s


def test_a_running_request_takes_a_block_each_time_its_sampled_tokens_fill_one():
    async def scenario():
        engine = Engine(max_loras=1, kv_cache_tokens=BLOCK_SIZE * 20)
        s = slot(prompt(1, 40), out=40, per_token=0.02)  # 3 blocks of prompt, 5 once all 40 are sampled
        readings = []

        async def watch():
            while True:
                readings.append(round(engine.kv_usage * 20))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        await serve(engine, s)
        watcher.cancel()
        return readings, engine.kv_usage

    readings, after = run(scenario())
    held = [r for r in readings if r]
    assert (
        held[0] == 3 and max(held) == 5 and 4 in held
    )  # one block at a time, not prompt + completion at once
    assert held == sorted(held)
    assert after == 0.0


def test_when_no_block_is_free_the_newest_running_request_is_preempted_and_recomputed_later():
    async def scenario():
        engine = Engine(max_loras=1, kv_cache_tokens=BLOCK_SIZE * 10)
        events: list = []
        # Each holds 4 blocks of prompt and needs 7 at the end: both run (8 <= 10), then growth runs out.
        older = slot(prompt(1, 64), out=48, per_token=0.01)
        newer = slot(prompt(1000, 64), out=48, per_token=0.01)
        first = asyncio.create_task(serve(engine, older, events, "older"))
        await asyncio.sleep(0.005)
        second = asyncio.create_task(serve(engine, newer, events, "newer"))
        await asyncio.gather(first, second)
        return engine, older, newer, events

    engine, older, newer, events = run(scenario())
    assert engine.num_preemptions >= 1
    assert older.num_preemptions == 0 and newer.num_preemptions == engine.num_preemptions
    assert events.index(("older", "done")) < events.index(("newer", "done"))
    assert newer.prefill_tokens > 0  # recomputed on its return: its prompt and what it had sampled
    assert engine.kv_usage == 0.0 and engine.num_running == engine.num_waiting == 0


def test_a_queue_only_engine_would_not_preempt_a_request_that_alone_fits():
    """The old behaviour reserved prompt + completion up front and queued what did not fit; vLLM admits
    on the prompt's blocks, so two requests that only fit while short both start and one is preempted."""

    async def scenario():
        engine = Engine(max_loras=1, kv_cache_tokens=BLOCK_SIZE * 10)
        a, b = slot(prompt(1, 64), out=48, latency=0.05), slot(prompt(1000, 64), out=48, latency=0.05)
        await asyncio.gather(serve(engine, a), serve(engine, b))
        return engine

    engine = run(scenario())
    assert engine.num_preemptions == 1


def test_a_recompute_takes_its_turn_on_the_shared_prefill_lane_before_later_prompts():
    async def scenario():
        engine = Engine(max_loras=1, kv_cache_tokens=BLOCK_SIZE * 10, prefill_token_latency_s=0.002)
        events: list = []
        older = slot(prompt(1, 64), out=48, per_token=0.01)
        newer = slot(prompt(1000, 64), out=48, per_token=0.01)
        calls = [asyncio.create_task(serve(engine, older, events, "older"))]
        await asyncio.sleep(0.001)
        calls.append(asyncio.create_task(serve(engine, newer, events, "newer")))
        while newer.num_preemptions == 0:
            await asyncio.sleep(0.002)
        late = slot(prompt(5000, 16), out=1)  # queues behind the preempted request, FCFS
        calls.append(asyncio.create_task(serve(engine, late, events, "late")))
        await asyncio.gather(*calls)
        return events

    events = run(scenario())
    assert events.index(("newer", "computed"), 1) < events.index(("late", "computed"))


def test_the_prefix_cache_hits_full_blocks_chained_from_the_start_and_counts_tokens_as_vllm_does():
    async def scenario():
        engine = Engine(max_loras=1, kv_cache_tokens=BLOCK_SIZE * 64)
        shared = prompt(1, 100)  # 6 full blocks and 4 tokens
        await serve(engine, slot(shared, out=20))
        counts = [(engine.prefix_cache_queries, engine.prefix_cache_hits)]
        await serve(engine, slot(shared + [7, 7], out=4))
        counts.append((engine.prefix_cache_queries, engine.prefix_cache_hits))
        await serve(engine, slot([999] + shared[1:], out=4))  # first token differs: nothing chains
        counts.append((engine.prefix_cache_queries, engine.prefix_cache_hits))
        await serve(engine, slot(shared, out=4, salt="other-tenant"))
        counts.append((engine.prefix_cache_queries, engine.prefix_cache_hits))
        # A later turn: the prompt is the first call's prompt + completion + more, so its sampled blocks hit.
        turn = slot(shared, out=20, latency=0.01)
        await serve(engine, turn)
        before = engine.prefix_cache_hits
        await serve(engine, slot(list(turn.token_ids) + prompt(70_000, 30), out=4))
        counts.append((0, engine.prefix_cache_hits - before))
        return counts

    counts = run(scenario())
    assert counts[0] == (100, 0)
    assert counts[1] == (100 + 102, 6 * BLOCK_SIZE)
    assert counts[2][1] == counts[1][1]  # a changed first token changes every hash after it
    assert counts[3][1] == counts[2][1]  # cache_salt keys the first block
    assert counts[4][1] == 120 // BLOCK_SIZE * BLOCK_SIZE  # every full block of prompt + completion hits


def test_an_adapter_has_its_own_prefix_cache_entries():
    async def scenario():
        engine = Engine(max_loras=2, kv_cache_tokens=BLOCK_SIZE * 64)
        await serve(engine, slot(prompt(1, 64), out=4, adapter="a"))
        await serve(engine, slot(prompt(1, 64), out=4, adapter="b"))
        miss = engine.prefix_cache_hits
        await serve(engine, slot(prompt(1, 64), out=4, adapter="a"))
        return miss, engine.prefix_cache_hits

    miss, hit = run(scenario())
    assert miss == 0 and hit == 3 * BLOCK_SIZE


def test_blocks_no_request_holds_are_evicted_least_recently_freed_first():
    async def scenario():
        engine = Engine(max_loras=1, kv_cache_tokens=BLOCK_SIZE * 10)
        old, recent = prompt(1, 65), prompt(1000, 65)  # 5 blocks each (4 full + 1)
        await serve(engine, slot(old, out=1))
        await serve(engine, slot(recent, out=1))
        await serve(engine, slot(prompt(5000, 17), out=1))  # 2 blocks: the free queue's head goes
        before = engine.prefix_cache_hits
        await serve(engine, slot(recent, out=1))
        recent_hits = engine.prefix_cache_hits - before
        await serve(engine, slot(old, out=1))
        old_hits = engine.prefix_cache_hits - before - recent_hits
        return recent_hits, old_hits

    recent_hits, old_hits = run(scenario())
    # The old prompt's blocks were freed first (each request's tail first), so they were the ones evicted.
    assert old_hits < recent_hits == 4 * BLOCK_SIZE


@pytest.mark.slow
def test_metrics_report_preemptions_and_prefix_cache_counters_under_vllms_names():
    options = served_like_vllm(kv_cache_tokens=BLOCK_SIZE * 14)
    names = ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")

    async def scenario(server: StandinServer) -> dict[str, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as http:
            headers = {"X-Standin-Latency": "0.2", "X-Standin-Per-Token-Latency": "0.01"}

            async def call(first: int) -> int:
                body = {"model": BUNDLED_MODEL, "prompt": prompt(first, 60), "max_tokens": 64, "seed": 3}
                body["ignore_eos"] = True
                return (await http.post("/v1/completions", json=body, headers=headers)).status_code

            codes = await asyncio.gather(*(call(first) for first in (1, 2000, 4000)))
            assert codes == [200, 200, 200]
            assert await call(1) == 200  # the first prompt again: its blocks may still be cached
            text = (await http.get("/metrics")).text
        figures = {}
        for name in names:
            match = re.search(rf'^{re.escape(name)}\{{model_name="[^"]+",engine="0"\}} (\S+)$', text, re.M)
            assert match, f"{name} missing from /metrics"
            figures[name] = float(match.group(1))
        return figures

    with StandinServer(options) as server:
        figures = run(scenario(server))
    assert figures["vllm:num_preemptions_total"] >= 1
    assert figures["vllm:prefix_cache_queries_total"] >= 4 * 60
    assert figures["vllm:prefix_cache_hits_total"] % BLOCK_SIZE == 0
