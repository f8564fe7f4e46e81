"""End to end: real Ray, real stand-in server process, real env and renderer actors. No mocks."""

from __future__ import annotations

import asyncio
import glob
import os

import openai
import pytest
from planes import lent, plane_factory, plane_on_own_loop
from waiting import runner

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.kernel.collector import YOUNG_THRESHOLD
from rollout_actors.plane import RolloutPlane
from rollout_actors.samples import turn_prompts
from rollout_actors.wire import ClientConfig, Ref, RendererConfig, Result, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
CALC = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")
DEADLINE_S = 90  # every test here answers well inside this, or fails instead of hanging


run = runner(DEADLINE_S)


small_plane = plane_factory(lanes={"train": 32, "eval": 8}, worker_num_cpus=0.5)


@pytest.fixture(scope="module")
def shared(ray_session):
    """(run, plane): one plane for the tests that only submit and read their own results (a plane start is
    seconds here); tests that set the plane's config, kill its parts or read its counters start their own."""
    with plane_on_own_loop({"train": 32, "eval": 8}, DEADLINE_S, worker_num_cpus=0.5) as started:
        yield started


def request(standin, env=CALC, **overrides) -> RolloutRequest:
    fields = dict(
        env=env,
        task_index=0,
        client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
        sampling=SamplingConfig(max_tokens=200, seed=7),
    )
    fields.update(overrides)
    return RolloutRequest(**fields)


async def collect(plane: RolloutPlane, n: int) -> list[Result]:
    return [await plane.next_result(timeout=DEADLINE_S) for _ in range(n)]


def test_single_and_multi_turn_token_rollouts_return_exact_sampled_ids(shared, standin):
    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            await plane.submit(request(standin, env=MATH, task_index=3))
            await plane.submit(request(standin, env=CALC, task_index=5))
            return {r.request_id: r for r in await collect(plane, 2)}

    results = list(on_plane(scenario()).values())
    by_env = {len(r.turns) > 1: r for r in results}
    for result in results:
        assert result.kind == "ok", result.error
        assert result.reward is not None and 0.0 <= result.reward <= 1.0
        for turn in result.turns:
            assert turn.new_prompt_ids and turn.completion_ids
            assert len(turn.logprobs) == len(turn.completion_ids)
    multi = by_env[True]
    first, second = turn_prompts(multi)[:2]
    assert second[: len(first) + len(multi.turns[0].completion_ids)] == first + multi.turns[0].completion_ids

    # The completion ids are exactly what the server samples for that (derived) prompt and seed.
    async def resample(prompt):
        client = openai.AsyncOpenAI(base_url=standin.base_url, api_key="EMPTY", max_retries=0)
        try:
            response = await client.completions.create(
                model=BUNDLED_MODEL,
                prompt=prompt,
                max_tokens=200,
                seed=7,
                logprobs=1,
                extra_body={"return_token_ids": True},
            )
        finally:
            await client.close()
        return response.choices[0].model_extra["token_ids"]

    for result in results:
        for turn, prompt in zip(result.turns, turn_prompts(result), strict=True):
            assert run(resample(prompt)) == turn.completion_ids


def test_chat_mode_relays_and_records_token_ids(shared, standin):
    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            await plane.submit(request(standin, env=CALC, task_index=2, mode="chat", return_messages=True))
            return await collect(plane, 1)

    (result,) = on_plane(scenario())
    assert result.kind == "ok", result.error
    assert len(result.turns) >= 2
    assert all(t.completion_ids and t.new_prompt_ids for t in result.turns)
    # The stand-in calls the calculator, reads its answer, then answers without a tool call: the episode
    # is exactly that, and the messages say so in order.
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call, answer = result.messages[2], result.messages[4]
    assert [c["function"]["name"] for c in call["tool_calls"]] == ["calculator"]
    assert result.messages[3]["tool_call_id"] == call["tool_calls"][0]["id"]
    assert not answer.get("tool_calls") and "\\boxed{" in answer["content"]
    assert len(result.turns) == 2


def test_bad_refs_and_malformed_tasks_come_back_as_caller_results(shared, standin):
    bad = [
        request(standin, env=Ref(target="env_actors.no_such_module:Env")),
        request(standin, env=Ref(target="os:system", config={"command": "true"})),
        request(standin, env=CALC, task_index=10**9),
    ]
    malformed = request(standin).model_dump(mode="json")
    malformed["sampling"]["temprature"] = 0.5  # typo: refused, not ignored

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            for item in bad:
                await plane.submit(item)
            await plane.submit(malformed)
            return await collect(plane, 4)

    results = on_plane(scenario())
    assert [r.kind for r in results] == ["caller"] * 4, [(r.kind, r.error) for r in results]
    messages = " | ".join(r.error.message for r in results)
    assert "no_such_module" in messages
    assert "allowlist" in messages
    assert "temprature" in messages


def test_a_request_cannot_widen_the_allowlist_or_run_a_command_in_an_env_server(
    ray_session, standin, tmp_path
):
    """The reported bypass, on a real EnvServer, with the plane's allowlist widened as far as an operator
    might (so only the server's own checks stand in the way): nothing runs, the result is `caller`."""
    planted = tmp_path / "ran"
    inner = {"target": "os:system", "config": {"command": f"touch {planted}"}, "not_a_ref": 1}
    exploits = [
        Ref(target="rollout_actors.kernel:RefResolver", config={"allowed_prefixes": ["os"], "ref": inner}),
        Ref(target="os:system", config={"command": f"touch {planted}"}),
        Ref(
            target="env_actors.examples.math_env:MathEnv",
            config={"path": Ref("os:system", {"command": "id"})},
        ),
    ]

    async def scenario():
        wide = ("env_actors.", "rollout_actors.", "os")
        async with small_plane(allowed_ref_prefixes=wide) as plane:
            for env in exploits:
                await plane.submit(request(standin, env=env))
            return await collect(plane, len(exploits))

    results = run(scenario())
    assert [r.kind for r in results] == ["caller"] * len(exploits), [r.error for r in results]
    assert all("not meant to be named" in r.error.message for r in results), [r.error for r in results]
    assert not planted.exists()


@pytest.mark.parametrize(
    ("fault", "expect"),
    [("500", "500"), ("timeout", "timed out")],
)
def test_server_faults_come_back_as_model_results(shared, standin, fault, expect):
    client = ClientConfig(
        base_url=standin.base_url,
        model=BUNDLED_MODEL,
        headers={"X-Standin-Fault": fault},
        read_timeout_s=1.0,
        max_retries=0,
    )

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            await plane.submit(request(standin, client=client))
            return await collect(plane, 1)

    (result,) = on_plane(scenario())
    assert result.kind == "model"
    text = f"{result.error.type} {result.error.message} {result.error.status_code}".lower()
    assert expect in text, text
    assert result.error.traceback


def test_api_key_secret_never_appears_in_results_or_logs(shared, standin, tmp_path):
    secret = os.environ["RAY_ROLLOUTS_TEST_SECRET"]
    client = ClientConfig(
        base_url=standin.base_url, model=BUNDLED_MODEL, api_key_var="RAY_ROLLOUTS_TEST_SECRET"
    )
    missing = ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, api_key_var="NOT_SET_ANYWHERE_XYZ")

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            await plane.submit(request(standin, env=MATH, client=client))
            await plane.submit(request(standin, env=MATH, client=missing, task_index=1))
            return await collect(plane, 2)

    results = on_plane(scenario())
    kinds = sorted(r.kind for r in results)
    assert kinds == ["caller", "ok"], [(r.kind, r.error) for r in results]
    dumped = "\n".join(r.model_dump_json() for r in results)
    assert secret not in dumped
    import ray

    log_dir = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    for path in glob.glob(os.path.join(log_dir, "*")) + [standin.log_path]:
        if os.path.isfile(path):
            with open(path, errors="replace") as handle:
                assert secret not in handle.read(), path


def test_no_client_or_connection_left_open_after_ok_failed_and_cancelled(ray_session, standin):
    hang = ClientConfig(
        base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Fault": "timeout"}
    )
    fail = ClientConfig(
        base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Fault": "500"}, max_retries=0
    )

    async def scenario():
        async with small_plane(batch_window_s=0.02) as plane:
            for i in range(6):
                await plane.submit(request(standin, env=MATH, task_index=i))
            for i in range(3):
                await plane.submit(request(standin, env=MATH, task_index=i, client=fail))
            hung = [
                await plane.submit(request(standin, env=MATH, task_index=i, client=hang)) for i in range(3)
            ]
            results = await collect(plane, 9)
            for request_id in hung:
                assert await plane.cancel(request_id)
            results += await collect(plane, 3)
            worker = plane._workers.live()[0].handle
            held = await worker.debug_resources.remote(port=standin.port)
            return results, held

    results, held = run(scenario())
    kinds = sorted(r.kind for r in results)
    assert kinds.count("ok") == 6 and kinds.count("model") == 3 and kinds.count("cancelled") == 3, kinds
    assert held["open_clients"] == 0, held
    assert held["connections"] == 0, held
    # The plane's batch window reached its worker, whose renderer and env calls went out batched.
    assert held["batch_window_s"] == 0.02
    calls, items = held["batches"]["batching._send_calls"]
    assert 0 < calls <= items
    # The worker settled its collector (`kernel.collector`): what it loaded is frozen out of collections.
    assert held["collector"]["frozen"] > 0 and held["collector"]["thresholds"][0] == YOUNG_THRESHOLD


def test_env_worker_killed_mid_rollout_is_redispatched_and_others_finish(ray_session, standin):
    import ray

    from rollout_actors.plane.naming import PoolNames

    slow = ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": "3.0"})

    async def scenario():
        async with small_plane(env_pool={"num_cpus": 0.25, "min_servers": 2}) as plane:
            for i in range(4):
                await plane.submit(request(standin, env=CALC, task_index=i, client=slow))
            await plane._pools.ensure_env_pool(CALC)  # started by the first dispatch; wait for it
            pool = ray.get_actor(PoolNames(plane.names.prefix).env_pool(CALC))
            deadline = asyncio.get_running_loop().time() + 60
            # Every session open at once (all wait on the pool, then a model call takes 3 s); placement may
            # pick one server.
            while True:
                stats = await pool.stats.remote()
                busy = [w for w in stats.servers if w.sessions > 0]
                if stats.sessions == 4 and busy:
                    break
                assert asyncio.get_running_loop().time() < deadline, stats
                await asyncio.sleep(0.1)
            victim = busy[0]
            ray.kill(ray.get_actor(victim.name), no_restart=True)
            return victim.sessions, await collect(plane, 4)

    killed_sessions, results = run(scenario())
    assert [r.kind for r in results] == ["ok"] * 4, [(r.kind, r.error) for r in results]
    assert sorted(r.attempts for r in results) == [1] * (4 - killed_sessions) + [2] * killed_sessions


def test_invalid_group_comes_back_as_one_caller_result_per_member(shared, standin):
    malformed = request(standin).model_dump(mode="json")
    malformed["sampling"]["temprature"] = 0.5

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            handle = await plane.submit_group(malformed, n=3)
            return handle.request_ids, (await handle.wait(timeout=DEADLINE_S)).results

    ids, results = on_plane(scenario())
    assert len(set(ids)) == 3 and sorted(r.request_id for r in results) == sorted(ids)
    assert [r.kind for r in results] == ["caller"] * 3
    assert len({r.group_id for r in results}) == 1 and results[0].group_id is not None


ECHO = Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 4, "turns": 3})


def test_a_trainer_sample_is_the_last_prompt_plus_its_completion_with_synthetic_closes_masked(
    shared, standin
):
    """Every completion is cut by `length`, so every bridge appends a close token nobody sampled: it is
    marked on the turn that holds it and masked out of the loss, and the sample is exactly what the
    server was sent last plus what it sampled."""
    from renderer_actors.tokenizer import load_tokenizer
    from rollout_actors.samples import trainer_samples

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            # Keep past reasoning: a cut think block must be bridged (closed synthetically), not dropped
            # by a re-render at the next user turn as the template's own retention would.
            renderer = RendererConfig(thinking_retention="all")
            sampling = SamplingConfig(max_tokens=4, seed=3)
            await plane.submit(request(standin, env=ECHO, sampling=sampling, renderer=renderer))
            return await collect(plane, 1)

    (result,) = on_plane(scenario())
    assert result.kind == "ok", result.error
    assert not result.forked
    assert [t.finish_reason for t in result.turns] == ["length"] * 3
    # A cut answer closes with <|im_end|>; a cut think block with </think> ... <|im_end|>.
    assert [t.synthetic_ids > 0 for t in result.turns] == [False, True, True]
    (sample,) = trainer_samples(result)
    last = result.turns[-1]
    assert sample.token_ids == turn_prompts(result)[-1] + last.completion_ids
    assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in result.turns) == 12
    im_end = load_tokenizer().convert_tokens_to_ids("<|im_end|>")
    closes = [sample.token_ids[i] for i in sample.synthetic]
    assert closes.count(im_end) == 2 and len(closes) == sum(t.synthetic_ids for t in result.turns)
    assert all(sample.loss_mask[i] == 0 for i in sample.synthetic)
    assert [x for x, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m] == [
        x for t in result.turns for x in t.logprobs
    ]


def test_a_cancelled_rollout_keeps_the_turns_it_sampled_and_its_start_version(shared, standin):
    slow = ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": "1.0"})

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as plane:
            request_id = await plane.submit(request(standin, env=ECHO, client=slow, task_index=1))
            deadline = asyncio.get_running_loop().time() + 30
            while standin.session_counts().get(request_id, 0) < 2:  # the second turn is being sampled
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.1)
            assert await plane.cancel(request_id)
            return await collect(plane, 1)

    (result,) = on_plane(scenario())
    assert result.kind == "cancelled"
    assert len(result.turns) == 1 and result.turns[0].completion_ids
    assert result.policy_version_start == 0
    assert (result.lane, result.task_index, result.seed, result.model) == ("train", 1, 7, BUNDLED_MODEL)
