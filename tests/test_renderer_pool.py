"""RendererPool and RendererSession against real Ray actors: growth, release, reuse, retirement,
replacement of a killed renderer, startup failure, and a multi-turn trajectory through the session."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import ray
from waiting import eventually, runner

from renderer_actors.config import RendererKeyStats
from renderer_actors.key import RendererKey
from renderer_actors.pool import get_or_create_renderer_pool
from renderer_actors.session import BridgeStep, RendererCallerError, RendererLoadFailed, RendererSession
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.kernel import Loss
from rollout_actors.kernel.faults import PartLost, Unavailable
from rollout_actors.plane.redispatch import REDISPATCH
from rollout_actors.wire import RendererConfig

FAST = {"idle_timeout_s": 600.0, "reap_interval_s": 0.2, "probe_interval_s": 0.5, "hang_timeout_s": 10.0}
IM_END = 151645


run = runner(60.0)


@pytest.fixture
def make_pool(ray_session):
    pools = []

    def make(**config):
        pool = get_or_create_renderer_pool(f"test-renderer-pool-{uuid.uuid4().hex[:8]}", {**FAST, **config})
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        try:
            ray.get(pool.close.remote(), timeout=10)
        finally:
            ray.kill(pool, no_restart=True)


def key_json(**config) -> str:
    return RendererKey.from_config(BUNDLED_MODEL, RendererConfig(**config)).to_json()


async def key_stats(pool, key: str) -> RendererKeyStats:
    return (await pool.stats.remote()).keys[key]


async def wait_until_ready(pool, key: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not all(r.ready for r in (await key_stats(pool, key)).renderers):
        assert time.monotonic() < deadline, "renderers did not become ready"
        await asyncio.sleep(0.1)


def test_pool_grows_one_renderer_per_multiplex_leases_and_reuses_released_slots(make_pool):
    pool = make_pool()
    key = key_json()

    async def scenario():
        leases = await asyncio.gather(*(pool.acquire.remote(key, 4) for _ in range(10)))
        stats = await key_stats(pool, key)
        assert stats.loads == [4, 4, 2]
        assert len({lease.renderer_id for lease in leases}) == 3
        released = await asyncio.gather(*(pool.release.remote(lease.slot_id) for lease in leases))
        assert all(released)
        assert (await key_stats(pool, key)).loads == [0, 0, 0]
        assert await pool.release.remote(leases[0].slot_id) is False  # idempotent
        await wait_until_ready(pool, key)  # a lease prefers ready renderers; compare like with like
        again = await asyncio.gather(*(pool.acquire.remote(key, 4) for _ in range(10)))
        assert (await key_stats(pool, key)).loads == [4, 3, 3]  # least-loaded first: spread
        assert {lease.renderer_id for lease in again} <= {lease.renderer_id for lease in leases}
        assert (await pool.stats.remote()).spawned == 3

    run(scenario())


def test_ten_concurrent_sessions_at_multiplex_four_grow_the_pool_to_four_four_two(make_pool):
    """The same through sessions: their leases are coalesced into one pool call, placed identically."""
    pool = make_pool()

    async def scenario():
        config = RendererConfig(multiplex=4)
        sessions = await asyncio.gather(
            *(RendererSession.open(pool, BUNDLED_MODEL, config, timeout=40) for _ in range(10))
        )
        try:
            assert (await key_stats(pool, key_json())).loads == [4, 4, 2]
            prompts = await asyncio.gather(
                *(
                    s.start([{"role": "user", "content": f"hi {i}"}], None, timeout=10)
                    for i, s in enumerate(sessions)
                )
            )
            assert len({tuple(p) for p in prompts}) == 10
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
        assert (await key_stats(pool, key_json())).loads == [0, 0, 0]

    run(scenario())


def test_configs_differing_only_in_multiplex_share_one_pool_and_the_first_policy_wins(make_pool):
    pool = make_pool()

    async def scenario():
        first = await pool.acquire.remote(key_json(multiplex=2), 2)
        second = await pool.acquire.remote(key_json(multiplex=64), 64)
        third = await pool.acquire.remote(key_json(multiplex=64), 64)
        assert first.renderer_id == second.renderer_id != third.renderer_id
        stats = await key_stats(pool, key_json())
        assert stats.multiplex == 2 and stats.loads == [2, 1]

    run(scenario())


def test_idle_renderers_beyond_one_are_retired(make_pool):
    pool = make_pool(idle_timeout_s=0.5)
    key = key_json()

    async def scenario():
        leases = await asyncio.gather(*(pool.acquire.remote(key, 2) for _ in range(6)))
        assert (await key_stats(pool, key)).loads == [2, 2, 2]
        await asyncio.gather(*(pool.release.remote(lease.slot_id) for lease in leases))
        deadline = time.monotonic() + 15
        while len((await key_stats(pool, key)).loads) > 1:
            assert time.monotonic() < deadline, "idle renderers were not retired"
            await asyncio.sleep(0.2)
        assert (await pool.stats.remote()).retired == 2

    run(scenario())


def test_slots_never_released_expire_at_their_timeout_oldest_first_and_later_ones_stay(make_pool):
    pool = make_pool(slot_timeout_s=2.0)
    key = key_json()

    async def scenario():
        first = await asyncio.gather(*(pool.acquire.remote(key, 8) for _ in range(3)))
        await asyncio.sleep(1.5)
        later = await asyncio.gather(*(pool.acquire.remote(key, 8) for _ in range(2)))
        assert await pool.release.remote(first[0].slot_id)  # released in time: it never expires
        stats = await eventually(
            lambda: _stats_once(pool, lambda s: s.expired_slots >= 2), timeout=10, interval=0.1
        )
        assert stats.expired_slots == 2 and stats.slots == 2  # the later ones are still held
        assert not await pool.release.remote(first[1].slot_id)  # an expired slot is no longer held
        stats = await eventually(
            lambda: _stats_once(pool, lambda s: s.expired_slots >= 4), timeout=10, interval=0.1
        )
        assert stats.expired_slots == 4 and stats.slots == 0
        assert not any([await pool.release.remote(slot.slot_id) for slot in later])

    run(scenario())


async def _stats_once(pool, holds):
    stats = await pool.stats.remote()
    return stats if holds(stats) else None


def test_session_runs_a_token_exact_multi_turn_trajectory(make_pool):
    pool = make_pool()
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]

    async def scenario():
        session = await RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(), timeout=30)
        try:
            prompt = await session.start([{"role": "user", "content": "find json"}], tools, timeout=10)
            completion = await encode(
                session, '<think>\nsearch\n</think>\n\n<tool_call>\n{"name": "search", '
            )
            completion += await encode(session, '"arguments": {"q": "js') + await encode(
                session, 'on"}}\n</tool_call>'
            )
            completion.append(IM_END)
            parsed = await session.parse(completion, tools, timeout=10)
            assert parsed.reasoning == "search" and parsed.tool_calls[0].arguments == {"q": "json"}
            assert parsed.message["tool_calls"][0]["function"]["arguments"] == '{"q": "json"}'
            step = await session.bridge(completion, "stop", [{"role": "tool", "content": "found"}], tools, 10)
            assert step.prompt_ids[: len(prompt) + len(completion)] == prompt + completion
            assert not step.forked and not step.synthetic_close and step.branch == 0
            with pytest.raises(RendererCallerError):
                await session.bridge([IM_END], "stop", [{"role": "assistant", "content": "x"}], tools, 10)
            cut = step.prompt_ids + [1, 2, 3]
            step2 = await session.bridge(
                [1, 2, 3], "length", [{"role": "tool", "content": "more"}], tools, 10
            )
            assert step2.prompt_ids[: len(cut)] == cut and step2.synthetic_close and not step2.forked
            assert step2.prompt_ids[len(cut)] == IM_END  # Qwen3's canonical close, appended as prompt
        finally:
            await session.close()
            await session.close()  # idempotent
        assert (await pool.stats.remote()).slots == 0

    run(scenario())


async def encode(session: RendererSession, text: str) -> list[int]:
    """Tokenise through the renderer (a user message's content span), as a sampler would."""
    rendered = await session._renderer.render.remote([{"role": "user", "content": text}], None, False)
    return rendered.ids[3:-2]  # drop "<|im_start|>user\n" and "<|im_end|>\n"


def test_rewriting_template_forks_through_the_session(make_pool):
    pool = make_pool()
    config = RendererConfig(family="qwen3", history="fork_on_rewrite")  # Qwen3's drops past reasoning

    async def scenario():
        session = await RendererSession.open(pool, BUNDLED_MODEL, config, timeout=30)
        try:
            prompt = await session.start([{"role": "user", "content": "2+2"}], None, timeout=10)
            completion = await encode(session, "<think>\nadd\n</think>\n\n4")
            step = await session.bridge(
                completion + [IM_END], "stop", [{"role": "user", "content": "3+3"}], None, 10
            )
            assert step.forked and step.branch == 1 and "<think>" in step.fork_reason
            assert step.prompt_ids[: len(prompt)] == prompt and completion[0] not in step.prompt_ids
            assert [m["role"] for m in session.messages] == ["user", "assistant", "user"]
        finally:
            await session.close()

    run(scenario())


def test_a_session_sends_the_history_up_front_once_a_bridge_of_that_kind_needed_it(make_pool):
    pool = make_pool()

    async def scenario():
        config = RendererConfig(family="qwen3")  # Qwen3's template, on the bundled tokenizer
        session = await RendererSession.open(pool, BUNDLED_MODEL, config, timeout=30)

        async def bridge(messages: list[dict]) -> tuple[BridgeStep, int]:
            """The step and how many calls the renderer served for it."""
            before = (await session._renderer.health.remote()).calls
            step = await session.bridge(completion, "stop", messages, None, 10)
            return step, (await session._renderer.health.remote()).calls - before

        try:
            prompt = await session.start([{"role": "user", "content": "hi"}], None, timeout=10)
            completion = await encode(session, "hello") + [IM_END]
            # Qwen3's template cannot be bridged at a new user turn: the first one asks for the history.
            step, calls = await bridge([{"role": "user", "content": "again"}])
            assert calls == 2 and not step.forked
            assert step.prompt_ids == prompt + completion + step.added_ids
            first = step.prompt_ids
            step2, calls = await bridge([{"role": "user", "content": "more"}])
            assert calls == 1 and not step2.forked  # sent with the history: one round trip
            assert step2.prompt_ids == first + completion + step2.added_ids
            assert step.prompt_ids == first  # an earlier step's prompt does not grow with the session's
            step3, calls = await bridge([{"role": "tool", "content": "found"}])
            assert calls == 1 and step3.prompt_ids == step2.prompt_ids + completion + step3.added_ids
        finally:
            await session.close()

    run(scenario())


def test_a_killed_renderer_is_a_lost_part_naming_its_call_and_a_new_session_gets_its_replacement(make_pool):
    """No retry hides in the session: the loss goes to the plane, which re-dispatches (or, the second
    time at the same point, answers poison); the pool has replaced the renderer for the next session."""
    pool = make_pool()

    async def scenario():
        session = await RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(multiplex=4), timeout=60)
        try:
            prompt = await session.start([{"role": "user", "content": "hi"}], None, timeout=10)
            completion = await encode(session, "hello") + [IM_END]
            dead = session.renderer_id
            await killed(session._renderer)
            with pytest.raises(PartLost) as lost:
                await session.bridge(completion, "stop", [{"role": "user", "content": "again"}], None, 40)
            assert lost.value.lost == Loss(part="renderer", how="died", call="bridge", step=0, name=dead)
            assert lost.value.failure.lost == lost.value.lost  # as data, for the plane
        finally:
            await session.close()
        again = await RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(multiplex=4), timeout=40)
        try:
            assert await again.start([{"role": "user", "content": "hi"}], None, timeout=30) == prompt
            assert again.renderer_id != dead
        finally:
            await again.close()
        stats = await pool.stats.remote()
        assert stats.replaced >= 1 and stats.slots == 0

    run(scenario(), 150)


def test_startup_failure_reaches_the_caller_within_seconds_with_the_renderer_traceback(make_pool):
    pool = make_pool()

    async def scenario():
        with pytest.raises(RendererLoadFailed) as failure:
            await RendererSession.open(pool, "/nonexistent/tokenizer", RendererConfig(), timeout=30)
        assert "/nonexistent/tokenizer" in str(failure.value)
        assert failure.value.kind == "infrastructure" and failure.value.failure.traceback
        assert (
            failure.value.failure.fault == "load" and failure.value.failure.lost is None
        )  # never re-dispatched
        # Within the hold, the next lease fails at once instead of spawning another doomed renderer.
        await asyncio.sleep(0.5)
        with pytest.raises(RendererLoadFailed, match="failed to start"):
            await RendererSession.open(pool, "/nonexistent/tokenizer", RendererConfig(), timeout=30)
        assert (await pool.stats.remote()).startup_failures == 1

    run(scenario())


@pytest.mark.slow
def test_a_renderer_that_fails_on_every_start_is_respawned_only_within_its_restart_budget(make_pool):
    pool = make_pool(failure_hold_s=0.0, restart={"max_restarts": 2, "window_s": 600})

    async def scenario():
        errors: list[str] = []
        for _ in range(10):  # a lease may land on a doomed renderer still warming: not one spawn per lease
            with pytest.raises((RendererLoadFailed, Unavailable)) as failure:
                await RendererSession.open(pool, "/nonexistent/tokenizer", RendererConfig(), timeout=30)
            errors.append(str(failure.value))
            if "restart budget spent" in errors[-1]:
                break
        assert "restart budget spent (2 restarts in 600 s)" in errors[-1], errors
        assert "/nonexistent/tokenizer" in errors[-1]  # and why the last one died
        with pytest.raises(Unavailable, match="restart budget spent"):
            await RendererSession.open(pool, "/nonexistent/tokenizer", RendererConfig(), timeout=30)
        stats = await pool.stats.remote()
        assert stats.spawned == 3, stats  # the first renderer, then two restarts: not one per lease
        assert stats.budget_denials >= 2

    run(scenario())


async def killed(handle, within_s: float = 30.0) -> None:
    """`ray.kill` the actor and wait until calls to it fail: a call sent right after the kill can still
    reach the living process (a loaded CI run saw one), and then no death is what the test goes on."""
    ray.kill(handle, no_restart=True)

    async def dead() -> bool:
        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), 5)
        except ray.exceptions.RayActorError:
            return True
        return False

    await eventually(dead, within_s, interval=0.05)


def test_a_killed_renderer_is_not_replaced_once_its_keys_restart_budget_is_spent(make_pool):
    pool = make_pool(restart={"max_restarts": 1, "window_s": 600})

    async def start_and_kill() -> None:
        session = await RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(multiplex=4), timeout=40)
        try:
            await session.start([{"role": "user", "content": "hi"}], None, timeout=30)
            await killed(session._renderer)
            with pytest.raises(PartLost):
                await session.start([{"role": "user", "content": "again"}], None, timeout=10)
        finally:
            await session.close()

    async def scenario():
        await start_and_kill()
        await start_and_kill()  # on the one restart the budget allows
        with pytest.raises(Unavailable, match="restart budget spent"):
            await RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(multiplex=4), timeout=40)
        stats = await pool.stats.remote()
        assert stats.spawned == 2 and stats.replaced == 1 and stats.budget_denials >= 1
        assert stats.keys[key_json()].restarts_left == 0

    run(scenario(), 120)


def test_a_renderer_killed_while_it_starts_is_replaced_not_held_as_a_startup_failure(make_pool):
    """A renderer whose process dies during its warm-up (killed, its node lost) is a death: replaced under
    the key's restart budget. Only a load that fails holds every lease off for `failure_hold_s`."""
    pool = make_pool(failure_hold_s=600.0)  # were it held, the next session would fail for ten minutes

    async def scenario():
        key = key_json()
        lease = await pool.acquire.remote(key)
        ray.kill(lease.renderer, no_restart=True)  # the tokenizer takes seconds to load: still warming
        await pool.release.remote(lease.slot_id)

        async def replaced():
            stats = await pool.stats.remote()
            return stats.replaced == 1

        deadline = time.monotonic() + 30
        while not await replaced():
            assert time.monotonic() < deadline, await pool.stats.remote()
            await asyncio.sleep(0.1)
        session = await RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(), timeout=40)
        try:
            prompt = await session.start([{"role": "user", "content": "hi"}], None, timeout=10)
        finally:
            await session.close()
        return prompt, await pool.stats.remote()

    prompt, stats = run(scenario())
    assert prompt
    assert stats.startup_failures == 0 and stats.replaced == 1


def test_a_renderer_that_dies_while_a_session_waits_for_its_load_is_no_evidence_against_the_request(
    make_pool,
):
    """A session waiting on `ready` sent the renderer nothing of its request: the renderer's death there
    (killed, its node lost) is a lost part the plane re-dispatches as collateral (`culprit` False), never
    poison however often it happens, and it spends none of the request's dispatches. Seen under chaos: two
    renderers killed while loading made 31 of 400 healthy rollouts poison, and spent a dispatch of most."""
    pool = make_pool()

    async def scenario():
        key = key_json()
        held = await pool.acquire.remote(key, 4)  # the key's first slot: its renderer starts loading
        opening = asyncio.ensure_future(
            RendererSession.open(pool, BUNDLED_MODEL, RendererConfig(multiplex=4), timeout=60)
        )

        async def waiting_on_the_load() -> bool:  # the session holds its slot on that renderer
            return (await key_stats(pool, key)).loads == [2]

        await eventually(waiting_on_the_load, 30, interval=0.02)
        assert not (await key_stats(pool, key)).renderers[0].ready, "loaded before the kill: no test"
        ray.kill(held.renderer, no_restart=True)
        with pytest.raises(PartLost) as lost:
            await opening
        dead = held.renderer_id
        assert lost.value.lost == Loss(
            part="renderer", how="died", call="ready", step=0, name=dead, culprit=False
        )
        assert lost.value.failure.lost == lost.value.lost  # as data, for the plane
        assert REDISPATCH.decide([lost.value.lost] * 2) == "redispatch"  # twice at that point: not poison
        assert REDISPATCH.decide([lost.value.lost] * REDISPATCH.max_dispatches) == "redispatch"  # not spent

    run(scenario(), 120)
