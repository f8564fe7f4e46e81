"""Benchmark: renderer bridge vs full re-render as history grows, and a cold start at many rollouts.

    python scripts/bench_renderer.py [--quick] [--rollouts 2048] [--multiplex 256] [--tokens-per-turn 1000]

(1) Per-turn cost at turns 1, 10, 50, 100 of one agentic trajectory (each turn: reasoning + a tool call
    sampled, then a tool result; about `--tokens-per-turn` tokens a turn, ~100k at turn 100):
      bridge session   `RendererSession.bridge` through a renderer actor (the path a rollout takes)
      bridge local     the renderer's bridge in-process (no Ray): the library's bridge from the prompt's tail
      lib whole        the library's `bridge_to_next_turn` handed the whole previous prompt (what it costs
                       without the tail: it copies the prompt into its answer, several times over)
      full native      re-rendering and tokenizing the whole history with the library's renderer
      full jinja       `apply_chat_template` over the whole history + tokenizing (what a naive loop does)
    Median of repeated calls from the same trajectory state. Target: bridge turn100/turn1 <= 2, while the
    full re-render grows with the history.
(2) Cold start: `--rollouts` concurrent rollouts open a session for one new key at once and render their
    first prompt. Latency (open -> first prompt) by start-order quartile, q1/q4 (target <= 1.2), and the
    number of renderers the pool grew to (rollouts / multiplex).

The last line is `bridge turn100/turn1: <ratio>` (the session path).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from typing import Any

import ray

from renderer_actors.calls import BridgeRequest
from renderer_actors.key import RendererKey
from renderer_actors.pool import get_or_create_renderer_pool
from renderer_actors.renderer import Renderer
from renderer_actors.session import RendererSession
from renderer_actors.tokenizer import BUNDLED_MODEL, load_tokenizer
from rollout_actors.wire import RendererConfig

TURNS = (1, 10, 50, 100)
IM_END = 151645
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
WORDS = "the a model token prefix cache json tool call result search query answer value list of".split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def turn_text(rng: random.Random, tokens: int) -> tuple[str, str]:
    """One sampled turn (reasoning + tool call, as the model writes it) and the tool's answer; about
    `tokens` tokens together (a word is about one token here)."""
    half = max(4, tokens // 2)
    sampled = (
        f"<think>\n{words(rng, half // 2)}\n</think>\n\n<tool_call>\n"
        f'{{"name": "search", "arguments": {{"q": "{words(rng, half // 2)}"}}}}\n</tool_call>'
    )
    return sampled, words(rng, half)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def amedian_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def growth(pool: Any, tokens_per_turn: int, repeats: int) -> list[dict[str, float]]:
    config = RendererConfig()
    local = Renderer.load(RendererKey.from_config(BUNDLED_MODEL, config))
    hf = load_tokenizer(BUNDLED_MODEL)
    rng = random.Random(0)
    session = await RendererSession.open(pool, BUNDLED_MODEL, config, timeout=120)
    rows = []
    try:
        messages = [{"role": "user", "content": "Find out everything about prefix caches."}]
        await session.start(messages, TOOLS, timeout=30)
        for turn in range(1, max(TURNS) + 1):
            sampled, result = turn_text(rng, tokens_per_turn)
            completion = local.encode(sampled) + [IM_END]
            new = [{"role": "tool", "content": result}]
            if turn in TURNS:
                rows.append(await measure_turn(session, local, hf, completion, new, turn, repeats))
            await session.bridge(completion, "stop", new, TOOLS, timeout=30)
    finally:
        await session.close()
    return rows


async def measure_turn(session, local, hf, completion, new, turn, repeats) -> dict[str, float]:
    # Repeat the same bridge from the same trajectory state: snapshot, bridge, restore.
    saved = (list(session._prompt), list(session._messages), list(session._tail), session.branch)

    async def bridge_session() -> None:
        await session.bridge(completion, "stop", new, TOOLS, timeout=30)
        session._prompt, session._messages = list(saved[0]), list(saved[1])
        session._tail, session.branch = list(saved[2]), saved[3]

    request = BridgeRequest(completion_ids=completion, new_messages=new, tools=TOOLS, prompt_tail=saved[2])
    reply = local.bridge(request)
    history = [*saved[1], reply.assistant_message, *new]
    bridged = len(saved[0]) + len(completion) + len(reply.appended_ids)

    def full_jinja() -> None:
        text = hf.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        hf.encode(text, add_special_tokens=False)

    await bridge_session()  # warm
    return {
        "turn": turn,
        "tokens": bridged,
        "session": await amedian_s(bridge_session, repeats),
        "local": median_s(lambda: local.bridge(request), repeats),
        "whole": median_s(
            lambda: local.library.bridge_to_next_turn(saved[0], completion, new, tools=TOOLS), repeats
        ),
        "native": median_s(lambda: local.start(history, TOOLS), max(3, repeats // 4)),
        "jinja": median_s(full_jinja, max(3, repeats // 4)),
    }


async def cold_start(pool: Any, rollouts: int, multiplex: int) -> dict[str, Any]:
    config = RendererConfig(multiplex=multiplex)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
    latencies: list[float] = [0.0] * rollouts
    sessions: list[RendererSession | None] = [None] * rollouts

    async def rollout(i: int) -> None:
        started = time.perf_counter()
        session = await RendererSession.open(pool, BUNDLED_MODEL, config, timeout=300)
        sessions[i] = session
        await session.start(messages, TOOLS, timeout=60)
        latencies[i] = time.perf_counter() - started

    started = time.perf_counter()
    # Started in order: task i issues its lease before task i + 1 (one event loop, FIFO scheduling).
    await asyncio.gather(*(rollout(i) for i in range(rollouts)))
    wall = time.perf_counter() - started
    stats = await pool.stats.remote()
    renderers = sum(len(k.renderers) for k in stats.keys.values())
    await asyncio.gather(*(s.close() for s in sessions if s is not None))
    quarter = rollouts // 4
    quartiles = [statistics.mean(latencies[q * quarter : (q + 1) * quarter]) for q in range(4)]
    return {"quartiles": quartiles, "renderers": renderers, "wall": wall}


async def run(args: argparse.Namespace) -> None:
    prefix = f"bench-renderer-{uuid.uuid4().hex[:6]}"
    growth_pool = get_or_create_renderer_pool(f"{prefix}/growth")
    cold_pool = get_or_create_renderer_pool(f"{prefix}/cold")
    try:
        rows = await growth(growth_pool, args.tokens_per_turn, args.repeats)
        cold = await cold_start(cold_pool, args.rollouts, args.multiplex)
    finally:
        for pool in (growth_pool, cold_pool):
            await asyncio.wait_for(pool.close.remote(), 30)
            ray.kill(pool, no_restart=True)

    first = rows[0]
    print(f"(1) per-turn cost, median of {args.repeats}; ratios are turn k / turn 1")
    print(
        f"{'turn':>5} {'tokens':>8} {'bridge session ms':>18} {'bridge local ms':>16} "
        f"{'lib whole ms':>13} {'full native ms':>15} {'full jinja ms':>14} {'session x':>10} {'local x':>8} "
        f"{'whole x':>8} {'jinja x':>8}"
    )
    for r in rows:
        print(
            f"{r['turn']:>5} {r['tokens']:>8} {r['session'] * 1e3:>18.2f} {r['local'] * 1e3:>16.2f} "
            f"{r['whole'] * 1e3:>13.2f} {r['native'] * 1e3:>15.2f} {r['jinja'] * 1e3:>14.2f} "
            f"{r['session'] / first['session']:>10.2f} {r['local'] / first['local']:>8.2f} "
            f"{r['whole'] / first['whole']:>8.2f} {r['jinja'] / first['jinja']:>8.2f}"
        )
    last = rows[-1]
    q = cold["quartiles"]
    print(
        f"(2) cold start: {args.rollouts} rollouts, one new key, multiplex {args.multiplex}: "
        f"grew to {cold['renderers']} renderers, all first prompts in {cold['wall']:.1f} s"
    )
    print(f"{'quartile':>9} {'mean latency s':>15}")
    for i, value in enumerate(q, 1):
        print(f"{'q' + str(i):>9} {value:>15.2f}")
    print(f"cold start q1/q4: {q[0] / q[3]:.2f}")
    print(f"full jinja turn100/turn1: {last['jinja'] / first['jinja']:.1f}")
    print(f"bridge turn100/turn1: {last['session'] / first['session']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller run: 512 rollouts, 300 tokens a turn")
    parser.add_argument("--rollouts", type=int, default=None, help="cold-start rollouts (default 2048)")
    parser.add_argument("--multiplex", type=int, default=None, help="renderer multiplex (default 256)")
    parser.add_argument("--tokens-per-turn", type=int, default=None, help="default 1000 (~100k at turn 100)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measured turn")
    args = parser.parse_args()
    quick = args.quick
    args.rollouts = args.rollouts or (512 if quick else 2048)
    args.multiplex = args.multiplex or (128 if quick else 256)
    args.tokens_per_turn = args.tokens_per_turn or (300 if quick else 1000)
    args.repeats = args.repeats or (10 if quick else 30)
    # Renderers take half a logical CPU each; logical CPUs above the physical ones let them pack.
    ray.init(num_cpus=16, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        asyncio.run(run(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
