"""Environment code stuck in a thread past its deadline wedges its server (docs/design.md contract 3: `env`
"wedged its own server"): a step that blocks its thread with `time.sleep`, on an adapter's framework loop
(verifiers) or in the server's thread pool (skyrl-gym), once or 8 times at once. The stuck rollouts end
`env`; the server, which keeps answering probes while serving nothing, is retired as wedged with a
culprit named (replaced outside the restart budget); the pool's next rollout ends `ok`. Real env servers
blocked by real sleeping environment code; the model is the stand-in."""

from __future__ import annotations

import pytest
import ray
from planes import plane_factory
from test_poison import request  # a short rollout of one task (the poison tests' own)
from waiting import eventually, runner

from rollout_actors.wire import Ref

pytestmark = pytest.mark.slow

DEADLINE_S = 240
STEP_TIMEOUT_S = 3.0
HANG_TIMEOUT_S = 2.0
REPLACED_WITHIN_S = 90  # deadline + hang_timeout_s + a spawn, on a loaded machine; on 6adb045: never
HEALTHY_TASK = 15

run = runner(DEADLINE_S)
plane = plane_factory(
    lanes={"train": 16, "eval": 1},
    env_pool={
        "num_cpus": 0.1,
        "min_servers": 1,
        "max_servers": 1,  # the next rollout has this server or its replacement, nothing else
        "step_timeout_s": STEP_TIMEOUT_S,
        "reset_timeout_s": 30.0,
        "score_timeout_s": STEP_TIMEOUT_S,  # a scored step gets step + score: the deadline stays short
        "hang_timeout_s": HANG_TIMEOUT_S,
        "probe_interval_s": 0.2,
        "probe_timeout_s": 1.0,
    },
)


@pytest.mark.parametrize("hung", [1, 8])
@pytest.mark.parametrize("where", ["BlocksFrameworkLoopEnv", "BlocksThreadEnv"])
def test_a_server_whose_env_code_is_stuck_in_a_thread_is_replaced_and_the_next_rollout_is_ok(
    ray_session, standin, where, hung
):
    env = Ref(target=f"env_actors.faults.envs:{where}", config={"blocking_tasks": hung, "num_tasks": 16})

    async def scenario():
        async with plane() as p:
            await p._pools.ensure_env_pool(env)
            pool = ray.get_actor(p.names.env_pool(env))
            before = await pool.stats.remote()
            for index in range(hung):
                await p.submit(request(standin, env, index))
            stuck = [await p.next_result(timeout=DEADLINE_S) for _ in range(hung)]

            async def replaced():
                stats = await pool.stats.remote()
                return stats if stats.culprit_replacements >= 1 and stats.ready == 1 else None

            after = await eventually(replaced, REPLACED_WITHIN_S)
            await p.submit(request(standin, env, HEALTHY_TASK))
            return stuck, await p.next_result(timeout=DEADLINE_S), before, after

    stuck, following, before, after = run(scenario())
    assert [(r.kind, r.error.type) for r in stuck] == [("env", "EnvDeadline")] * hung, [
        r.error for r in stuck
    ]
    assert after.deaths >= 1 and after.restarts_left == before.restarts_left, (
        after
    )  # named: outside the budget
    assert following.kind == "ok", following.error
    print(f"{where}, {hung} hung: next rollout {following.kind}; retired {after.retired}")
