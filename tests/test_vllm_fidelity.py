"""Meet the real vLLM: each row of what vLLM 0.33.0 does (read from its source) holds for the command line
the project builds, for the plane's calls, and for the stand-in, which is at least as strict wherever the
plane depends on it. Servers here are real stand-in processes started with the flags under test."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import served_like_vllm
from env_pools import TEST_REF_PREFIXES
from safetensors.numpy import save_file
from waiting import runner

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import (
    InferenceServer,
    ServerSpec,
    server_actor_options,
    vllm_command,
    vllm_env,
)
from rollout_actors.inference.standin import StandinOptions, StandinServer, StandinStartupError
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.policy.lora import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter, lora_config
from rollout_actors.policy.publish import PolicyPublisher, PublishFailure
from rollout_actors.rollout.client import build_client
from rollout_actors.rollout.failures import classify
from rollout_actors.rollout.model_call import complete_tokens
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

KEY_VAR = "RAY_ROLLOUTS_TEST_SECRET"
DEADLINE_S = 90
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALC_MESSAGES = [
    {"role": "system", "content": "Use the calculator tool for arithmetic."},
    {"role": "user", "content": "Compute (17 * 23) + 45 using the calculator tool."},
]


run = runner(DEADLINE_S)


@pytest.fixture(scope="module")
def bare():
    """A stand-in started like `vllm serve MODEL` with no optional flags, and an API key."""
    with StandinServer(StandinOptions(admin=True), env={"VLLM_API_KEY": os.environ[KEY_VAR]}) as server:
        yield server


FRESH_SERVERS = 4  # the tests below that take `fresh()`: one each


@pytest.fixture(scope="module")
def fresh():
    """`fresh()`: a ready stand-in started as `ServerSpec` starts vLLM that no other test has touched (a
    pause or the weight-transfer state stays with its server). The first call launches all of them, so they
    load side by side rather than one per test; each is closed at the module's end."""
    launched: list[StandinServer] = []
    untouched: list[StandinServer] = []

    def take() -> StandinServer:
        if not launched:
            launched.extend(StandinServer(served_like_vllm()).start(wait=False) for _ in range(FRESH_SERVERS))
            untouched.extend(server.wait_ready() for server in launched)
        assert untouched, f"no fresh stand-in left: one failed to start, or over {FRESH_SERVERS} were taken"
        return untouched.pop(0)

    try:
        yield take
    finally:
        for server in launched:
            server.close()


def keyed(server: StandinServer, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=os.environ[KEY_VAR], max_retries=0, **kwargs)


async def chat(client: openai.AsyncOpenAI, **kwargs):
    async with client:
        return await client.chat.completions.create(model=BUNDLED_MODEL, max_tokens=256, seed=1, **kwargs)


# ---------------------------------------------------------------------- tools and reasoning need flags


def test_tools_without_the_tool_parser_flags_are_vllms_400(bare):
    with pytest.raises(openai.BadRequestError) as info:
        run(chat(keyed(bare), messages=CALC_MESSAGES, tools=[CALC_TOOL]))
    assert info.value.body["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    with pytest.raises(openai.BadRequestError) as info:
        run(chat(keyed(bare), messages=CALC_MESSAGES, tools=[CALC_TOOL], tool_choice="required"))
    assert "requires --tool-call-parser" in info.value.body["message"]


def test_the_launched_command_carries_tool_and_reasoning_parsers_for_qwen3():
    command = vllm_command(ServerSpec(model="Qwen/Qwen3-8B"), "10.0.0.5", 8000)
    flags = " ".join(command)
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in flags
    assert "--reasoning-parser qwen3" in flags
    coder = " ".join(vllm_command(ServerSpec(model="Qwen/Qwen3-Coder-30B-A3B-Instruct"), "h", 1))
    assert "--tool-call-parser qwen3_coder" in coder and "--reasoning-parser" not in coder
    off = vllm_command(ServerSpec(model="m", tool_call_parser=None, reasoning_parser=None), "h", 1)
    assert "--tool-call-parser" not in off and "--enable-auto-tool-choice" not in off


@pytest.mark.slow
def test_a_chat_rollout_with_environment_tools_runs_on_a_server_started_as_spec_builds_it(
    standin, ray_session
):
    """The shared stand-in runs with `ServerSpec`'s flags (conftest): the calculator's chat turns parse."""

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 2, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        async with RolloutPlane(config) as plane:
            await plane.submit(
                RolloutRequest(
                    env=Ref(target="env_actors.examples.calculator_env:CalculatorEnv"),
                    task_index=1,
                    mode="chat",
                    client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
                    sampling=SamplingConfig(max_tokens=200, seed=3),
                )
            )
            return await plane.next_result(timeout=60)

    result = run(scenario(), deadline=120)
    assert result.kind == "ok", result.error
    assert result.turns[0].tool_calls and result.turns[0].tool_calls[0].name == "calculator"


def test_reasoning_is_split_only_with_a_reasoning_parser_and_returned_as_reasoning(bare, standin):
    headers = {"X-Standin-Think-Rate": "1"}
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    plain = run(chat(keyed(bare), messages=messages, extra_headers=headers)).choices[0].message
    assert plain.model_extra.get("reasoning") is None and "<think>" in plain.content
    client = openai.AsyncOpenAI(base_url=standin.base_url, api_key="EMPTY", max_retries=0)
    parsed = run(chat(client, messages=messages, extra_headers=headers)).choices[0].message
    assert parsed.model_extra["reasoning"] and "<think>" not in (parsed.content or "")
    assert "reasoning_content" not in parsed.model_extra  # vLLM 0.33 sends `reasoning` only


# ---------------------------------------------------------------------------------------- LoRA limits


def test_max_lora_rank_must_be_one_vllm_accepts():
    with pytest.raises(ValueError, match="max_lora_rank"):
        ServerSpec(model="m", max_lora_rank=48)
    with pytest.raises(StandinStartupError) as info:
        StandinServer(StandinOptions(enable_lora=True, max_lora_rank=48), ready_timeout_s=30).start()
    assert "--max-lora-rank" in info.value.log_tail


def test_max_loras_is_sized_for_retention_plus_adapters_in_use():
    spec = ServerSpec(model="Qwen/Qwen3-8B")
    flags = vllm_command(spec, "h", 1)
    max_loras = int(flags[flags.index("--max-loras") + 1])
    assert max_loras == spec.lora_retain + spec.lora_in_use >= 4 + 1  # vLLM's default is 1
    assert int(flags[flags.index("--max-cpu-loras") + 1]) >= max_loras
    with pytest.raises(ValueError, match="max_cpu_loras"):
        ServerSpec(model="Qwen/Qwen3-8B", max_loras=4, max_cpu_loras=2)


def adapter_dir(path: Path, rank: int = 8, names: tuple[str, ...] = (), **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    names = names or tuple(
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight" for ab in "AB"
    )
    save_file({n: np.zeros((rank, rank), np.float32) for n in names}, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(lora_config(rank, 2 * rank, ["q_proj"], **config)))
    return str(path)


def test_a_request_for_an_adapter_that_cannot_join_the_batch_waits(tmp_path):
    """max_loras=1: while adapter a runs, a request for b waits (counted at /metrics) and runs after it;
    a base-model request is never held back by max_loras."""
    options = served_like_vllm(max_loras=1, max_cpu_loras=2)

    async def scenario(server: StandinServer):
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as http:
            for name in ("a", "b"):
                body = {"lora_name": name, "lora_path": adapter_dir(tmp_path / name)}
                assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 200
            finished: list[str] = []

            async def call(model: str, latency: float) -> None:
                body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}
                headers = {"X-Standin-Latency": str(latency)}
                assert (await http.post("/v1/completions", json=body, headers=headers)).status_code == 200
                finished.append(model)

            first = asyncio.create_task(call("a", 2.0))
            await _until(http, lambda m: m["running"] == 1)
            # b samples for 0.5 s once it may run: its answer cannot overtake a's on the client side
            second = asyncio.create_task(call("b", 0.5))
            waiting = await _until(http, lambda m: m["waiting"] == 1)
            await call(BUNDLED_MODEL, 0.0)  # the base model passes while b waits
            await asyncio.gather(first, second)
            return finished, waiting

    with StandinServer(options) as server:
        finished, waiting = run(scenario(server))
    assert waiting["waiting"] == 1
    assert finished == [BUNDLED_MODEL, "a", "b"]


async def _until(http, predicate, timeout: float = 20.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        figures = parse_metrics((await http.get("/metrics")).text)
        if predicate(figures):
            return figures
        assert asyncio.get_running_loop().time() < deadline, figures
        await asyncio.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    found = {}
    for name, key in (
        ("vllm:num_requests_running", "running"),
        ("vllm:num_requests_waiting", "waiting"),
        ("vllm:kv_cache_usage_perc", "kv"),
    ):
        match = re.search(rf'^{re.escape(name)}\{{model_name="[^"]+",engine="0"\}} (\S+)$', text, re.M)
        assert match, f"{name} missing from /metrics"
        found[key] = float(match.group(1))
    return found


BAD_ADAPTERS = [
    ({"rank": 128}, "max_lora_rank"),
    ({"bias": "all"}, "bias"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"names": ("base_model.model.model.layers.0.self_attn.q_proj.weight",)}, "q_proj.weight"),
    ({"names": ("base_model.model.model.layers.0.mlp.router.lora_A.weight",)}, "'router'"),
]


@pytest.mark.parametrize(("change", "named"), BAD_ADAPTERS)
def test_publish_refuses_an_adapter_vllm_would_refuse_before_writing_anything(tmp_path, change, named):
    rank = change.get("rank", 8)
    names = change.get("names") or tuple(
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight" for ab in "AB"
    )
    config = {k: v for k, v in change.items() if k not in ("rank", "names")}
    lora = LoraAdapter(
        {n: np.zeros((rank, rank), np.float32) for n in names},
        lora_config(rank, 2 * rank, ["q_proj"], **config),
    )
    storage = tmp_path / "published"

    async def scenario():
        publisher = PolicyPublisher(["http://127.0.0.1:9/v1"], storage, load_timeout_s=1, retries=0)
        try:
            with pytest.raises(ValueError, match=re.escape(named)):
                await publisher.publish(lora, version=1)
        finally:
            await publisher.aclose()

    run(scenario())
    assert not storage.exists() or not any(storage.iterdir())


@pytest.mark.parametrize(("change", "named"), BAD_ADAPTERS)
def test_the_stand_in_refuses_at_load_what_vllm_refuses(standin, tmp_path, change, named):
    rank = change.get("rank", 8)
    config = {k: v for k, v in change.items() if k not in ("rank", "names")}
    path = adapter_dir(tmp_path / "bad", rank=rank, names=change.get("names", ()), **config)
    with httpx.Client(timeout=10, trust_env=False) as http:
        response = http.post(
            f"{standin.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}
        )
    assert response.status_code == 500 and response.json()["error"]["type"] == "InternalServerError"
    assert named in response.json()["error"]["message"]


# --------------------------------------------------------------------------------------------- API key


def test_a_server_with_an_api_key_refuses_every_v1_route_without_it(bare):
    with httpx.Client(base_url=bare.url, timeout=10, trust_env=False) as http:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/load_lora_adapter"),
        ):
            response = http.request(method, path, json={})
            assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}, path
        assert http.get("/health").status_code == 200  # outside /v1, as on vLLM
        key = {"Authorization": f"Bearer {os.environ[KEY_VAR]}"}
        assert http.get("/v1/models", headers=key).status_code == 200


@pytest.mark.slow
def test_readiness_and_publication_send_the_key_which_never_reaches_a_command_line(ray_session, tmp_path):
    spec = ServerSpec(
        kind="standin",
        model=BUNDLED_MODEL,
        host="127.0.0.1",
        ready_timeout_s=60,
        num_cpus=0,
        api_key_var=KEY_VAR,
    )
    secret = os.environ[KEY_VAR]
    assert secret not in " ".join(vllm_command(spec.model_copy(update={"kind": "vllm"}), "h", 1))
    assert "VLLM_API_KEY" not in vllm_env(spec)  # read on the server's node, not baked into the spec

    async def scenario():
        actor = InferenceServer.options(**server_actor_options(spec)).remote(spec)
        try:
            status = await actor.start.remote()  # ready only if /v1/models answered 200: the key was sent
            assert status.state == "ready", status
            with open(f"/proc/{status.pid}/cmdline", "rb") as handle:
                cmdline = handle.read()
            lora = LoraAdapter(
                {
                    f"base_model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": np.zeros(
                        (8, 8), np.float32
                    )
                    for ab in "AB"
                },
                lora_config(8, 16, ["q_proj"]),
            )
            keyless = PolicyPublisher([status.url], tmp_path / "a", load_timeout_s=5, retries=0)
            keyed_publisher = PolicyPublisher(
                [status.url], tmp_path / "b", load_timeout_s=5, retries=0, api_key_var=KEY_VAR
            )
            try:
                with pytest.raises(PublishFailure) as refused:
                    await (await keyless.publish(lora, 1)).wait(timeout=30)
                loaded = await (await keyed_publisher.publish(lora, 1)).wait(timeout=30)
            finally:
                await keyless.aclose()
                await keyed_publisher.aclose()
            final = await actor.close.remote()
            return cmdline, refused.value, loaded, final
        finally:
            import ray

            ray.kill(actor)

    cmdline, refused, loaded, final = run(scenario())
    assert secret.encode() not in cmdline
    assert refused.failure.status_code == 401
    assert loaded.version == 1
    assert secret not in final.model_dump_json()


# ------------------------------------------------------------------------------------ protocol fields


def test_validation_errors_come_in_vllms_shape(standin):
    with httpx.Client(timeout=10, trust_env=False) as http:
        response = http.post(f"{standin.base_url}/completions", json={"prompt": [1, 2], "max_tokens": "x"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == 400
    assert error["type"] == "Bad Request" and error["param"] == "body.max_tokens"
    assert error["message"].startswith("1 validation error:\n")


def test_an_abort_the_plane_did_not_ask_for_is_a_model_failure_not_a_finished_turn(standin):
    """`finish_reason` "abort" (here: someone else paused the server in abort mode mid-call)."""

    async def scenario():
        config = ClientConfig(
            base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": "5"}
        )
        client = build_client(config)
        async with httpx.AsyncClient(base_url=standin.url, timeout=10, trust_env=False) as http:
            call = asyncio.create_task(
                complete_tokens(client, BUNDLED_MODEL, [1, 2, 3], SamplingConfig(max_tokens=8), timeout_s=30)
            )
            await _until(http, lambda m: m["running"] >= 1)
            assert (await http.post("/pause", params={"mode": "abort"})).status_code == 200
            try:
                with pytest.raises(Exception) as caught:
                    await call
            finally:
                await http.post("/resume")
                await client.close()
        return classify(caught.value)

    kind, failure = run(scenario())
    assert kind == "model" and failure.type == "TurnAborted" and "abort" in failure.message


@pytest.mark.slow
def test_metrics_report_kv_usage_and_a_real_waiting_count_from_a_finite_budget():
    options = served_like_vllm(kv_cache_tokens=400)

    async def scenario(server: StandinServer):
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as http:
            # Four different prompts: the same one four times would share its blocks in the prefix cache.
            bodies = [
                {"model": BUNDLED_MODEL, "prompt": list(range(i, 149 + i)), "max_tokens": 16, "seed": 1}
                for i in range(1, 5)
            ]
            headers = {"X-Standin-Latency": "1.5"}
            calls = [
                asyncio.create_task(http.post("/v1/completions", json=body, headers=headers))
                for body in bodies
            ]
            loaded = await _until(http, lambda m: m["running"] >= 2 and m["waiting"] >= 1)
            await asyncio.gather(*calls)
            idle = parse_metrics((await http.get("/metrics")).text)
            return loaded, idle

    with StandinServer(options) as server:
        loaded, idle = run(scenario(server))
    assert loaded["running"] == 2 and loaded["waiting"] == 2  # 2 x ~160 tokens fit in 400, 4 do not
    assert 0.5 < loaded["kv"] <= 1.0
    assert idle == {"running": 0, "waiting": 0, "kv": 0.0}


def test_the_load_reader_reads_vllms_series_with_the_key(bare):
    from rollout_actors.inference.load import LoadReader, MetricsMissing, parse_load

    async def scenario():
        reader = LoadReader(api_key_var=KEY_VAR)
        try:
            return await reader.read(bare.base_url)
        finally:
            await reader.aclose()

    load = run(scenario())
    assert load.running == 0 and load.waiting == 0 and load.kv_cache_usage == 0.0
    two_engines = (
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
        'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.75\n'
        'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 4\n'
        'vllm:num_requests_waiting{model_name="m",engine="0"} 1\n'
        'vllm:num_requests_waiting{model_name="m",engine="1"} 0\n'
    )
    assert parse_load(two_engines).model_dump() == {
        "kv_cache_usage": 0.75,
        "running": 7,
        "waiting": 1,
        "preemptions": 0,  # a server without the counter reads as one that never preempted
    }
    with pytest.raises(MetricsMissing):
        parse_load("standin_requests_in_flight 0\n")


# ------------------------------------------------------------------ vLLM 0.33 rows (issue 23), stand-in side

NCCL_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
NCCL_UPDATE = {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[8, 8]]}


def test_unseeded_requests_sample_at_random_as_vllm_does(standin):
    """Row 13: without a seed vLLM samples at random; n unseeded copies of a prompt are not n clones."""
    body = {"model": BUNDLED_MODEL, "prompt": [1, 2, 3], "max_tokens": 12, "return_token_ids": True}
    with httpx.Client(base_url=standin.url, timeout=30, trust_env=False) as http:
        unseeded = [
            tuple(http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]) for _ in range(4)
        ]
        seeded = [
            tuple(http.post("/v1/completions", json=body | {"seed": 7}).json()["choices"][0]["token_ids"])
            for _ in range(2)
        ]
    assert len(set(unseeded)) > 1
    assert seeded[0] == seeded[1]  # a seed still reproduces


def test_a_pause_queues_new_requests_in_keep_mode_and_refuses_them_in_abort_mode_with_vllms_503(fresh):
    """Row 10, read against 0.33.0 (`EngineCoreProc.pause_generation`: `reject_new_requests = mode !=
    "keep"`): keep queues a new request until resume; abort and wait answer it 503 with vLLM's message."""

    async def scenario(server: StandinServer):
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as http:
            body = {"model": BUNDLED_MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            queued = asyncio.create_task(http.post("/v1/completions", json=body))
            waiting = await _until(http, lambda m: m["waiting"] == 1)
            assert not queued.done()
            assert (await http.post("/resume")).status_code == 200
            answered = await queued
            assert (await http.post("/pause", params={"mode": "abort"})).status_code == 200
            refused = await http.post("/v1/completions", json=body)
            await http.post("/resume")
            return waiting, answered, refused

    waiting, answered, refused = run(scenario(fresh()))
    assert waiting["waiting"] == 1 and answered.status_code == 200
    assert refused.status_code == 503
    assert refused.json()["error"] == {
        "message": "Generation is paused. Please retry after it resumes.",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }


def test_the_stand_in_takes_weight_updates_only_as_vllms_nccl_engine_does(fresh):
    """Row 2 and 3 on the server side: no update before `/init_weight_transfer_engine`, `update_info`
    checked per backend, a second start refused while one is open, a refused update ends the session."""
    server = fresh()
    with httpx.Client(base_url=server.url, timeout=10, trust_env=False) as http:
        assert http.post("/start_weight_update").status_code == 200
        uninitialised = http.post("/update_weights", json={"update_info": NCCL_UPDATE})
        assert (
            uninitialised.status_code == 500 and "not initialized" in uninitialised.json()["error"]["message"]
        )
        assert (
            http.post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}}).status_code
            == 400
        )
        assert http.post("/init_weight_transfer_engine", json={"init_info": NCCL_INIT}).status_code == 200
        assert http.post("/start_weight_update").status_code == 200  # the refusal above ended the session
        second = http.post("/start_weight_update")
        assert second.status_code == 500 and "already active" in second.json()["error"]["message"]
        assert http.post("/update_weights", json={"update_info": {"names": ["x"]}}).status_code == 400
        assert http.post("/finish_weight_update", json={}).status_code == 500  # the session ended with it
        assert http.post("/start_weight_update").status_code == 200
        assert http.post("/update_weights", json={"update_info": NCCL_UPDATE}).status_code == 200
        assert http.post("/finish_weight_update", json={"weight_version": "1"}).status_code == 200
        assert http.get("/weight_info").json() == {"weight_version": "1"}


def test_a_failed_weight_update_leaves_the_servers_paused_until_a_retry_succeeds(fresh):
    """Row 3: once the update started, a failure must not resume servers that may hold half the new
    weights under the old label. The session is closed, so a retry can start one and resumes on success."""
    from rollout_actors.policy.weights import WeightUpdateFailure, WeightUpdater

    async def broken_transfer() -> None:
        raise ConnectionError("trainer's NCCL broadcast died")

    async def scenario(server: StandinServer):
        updater = WeightUpdater(timeout_s=10)
        try:
            with pytest.raises(WeightUpdateFailure) as uninitialised:
                await updater.update([server.base_url], NCCL_UPDATE, version=1)
            with pytest.raises(ValueError, match="dtype_names"):
                await updater.update([server.base_url], {"names": ["x"]}, version=1)
            async with httpx.AsyncClient(base_url=server.url, timeout=10, trust_env=False) as http:
                untouched = (await http.get("/is_paused")).json()["is_paused"]
                await updater.init_transfer([server.base_url], NCCL_INIT)
                with pytest.raises(ConnectionError):
                    await updater.update(
                        [server.base_url], NCCL_UPDATE, version=1, transfer=broken_transfer()
                    )
                after_failure = (await http.get("/is_paused")).json()["is_paused"]
                label = (await http.get("/weight_info")).json()["weight_version"]
                report = await updater.update([server.base_url], NCCL_UPDATE, version=1)
                after_retry = (await http.get("/is_paused")).json()["is_paused"]
                relabelled = (await http.get("/weight_info")).json()["weight_version"]
        finally:
            await updater.aclose()
        return uninitialised.value, untouched, after_failure, label, report, after_retry, relabelled

    uninitialised, untouched, after_failure, label, report, after_retry, relabelled = run(scenario(fresh()))
    assert uninitialised.stage == "init_weight_transfer_engine" and untouched is False
    assert after_failure is True and label == "default"
    assert report.version == 1 and after_retry is False and relabelled == "1"


@pytest.mark.slow
def test_a_replacement_server_joins_the_weight_transfer_before_it_takes_a_full_update(ray_session):
    """vLLM's NCCL engine refuses every update on a server that never had `/init_weight_transfer_engine`
    (the stand-in as strictly): a replacement the server set starts after `init_weight_transfer` gets its
    own init through `join` before it takes traffic, then takes the next full update like the others."""
    from waiting import wait_until

    from rollout_actors.inference.server_set import InferenceServerSet
    from rollout_actors.kernel.supervision import RestartIntensity
    from rollout_actors.policy.weights import TransferJoin

    spec = ServerSpec(kind="standin", model=BUNDLED_MODEL, host="127.0.0.1", ready_timeout_s=180, num_cpus=0)
    refused_before_join: dict[str, str] = {}

    async def join(url: str) -> TransferJoin:
        # The trainer's side: here, first show that the fresh server refuses an update without init.
        async with httpx.AsyncClient(base_url=url.removesuffix("/v1"), timeout=10, trust_env=False) as http:
            assert (await http.post("/start_weight_update")).status_code == 200
            refused = await http.post("/update_weights", json={"update_info": NCCL_UPDATE})
            refused_before_join[url] = f"{refused.status_code} {refused.json()['error']['message']}"
        return TransferJoin({**NCCL_INIT, "master_port": 29501})

    async def scenario():
        servers = InferenceServerSet(spec, replicas=1, restart=RestartIntensity(max_restarts=2, window_s=60))
        config = PlaneConfig(
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        plane = RolloutPlane(config, servers=servers)
        try:
            await servers.start()
            await plane.start()
            await plane.init_weight_transfer(NCCL_INIT, join=join)
            victim = servers.status()[0].pid
            os.kill(victim, signal.SIGKILL)
            await wait_until(
                lambda: servers.endpoints() and servers.status()[0].pid != victim, timeout=200
            )  # the replacement may reuse the address: it is told apart by its process
            (replacement,) = servers.endpoints()
            report = await plane.update_weights(NCCL_UPDATE, version=1)
            async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
                label = (await http.get(f"{replacement.removesuffix('/v1')}/weight_info")).json()
        finally:
            await plane.close()
            await servers.aclose()
        return replacement, report, label

    replacement, report, label = run(scenario(), deadline=500)
    assert refused_before_join == {
        replacement: "500 NCCL weight transfer not initialized. Call init_transfer_engine() first."
    }
    assert report.servers == [replacement.removesuffix("/v1")] and label == {"weight_version": "1"}


def test_without_join_a_server_that_joins_after_init_is_kept_out_and_a_reused_address_is_not_trusted(fresh):
    """Weight updater alone, on one stand-in: after `init_transfer`, a joining server (here the same address,
    as a replacement may reuse it) is refused without `join`, and is not counted as initialised."""
    from rollout_actors.policy.weights import WeightUpdateFailure, WeightUpdater

    async def scenario(server: StandinServer):
        updater = WeightUpdater(timeout_s=10)
        try:
            await updater.init_transfer([server.base_url], NCCL_INIT)
            with pytest.raises(RuntimeError, match="pass `join`"):
                await updater.join_server(server.base_url)
            with pytest.raises(WeightUpdateFailure) as refused:
                await updater.update([server.base_url], NCCL_UPDATE, version=1)
        finally:
            await updater.aclose()
        return refused.value

    refused = run(scenario(fresh()))
    assert refused.stage == "init_weight_transfer_engine" and not refused.paused


def test_a_500_from_load_lora_adapter_is_not_retried(standin, tmp_path):
    """vLLM 0.33.0 answers 500 when its loader raised on the files (`openai/models/serving.py`): the same
    files fail the same way, so the publisher gives up after one attempt (here an adapter past the server's
    max rank, which a publisher told looser limits lets through)."""
    from rollout_actors.policy.lora import AdapterLimits

    path = adapter_dir(tmp_path / "too-wide", rank=128)

    async def scenario():
        publisher = PolicyPublisher(
            [standin.base_url], tmp_path / "published", load_timeout_s=10, retries=2,
            limits=AdapterLimits(max_lora_rank=128),
        )  # fmt: skip
        loads: list[str] = []

        async def count(request) -> None:
            if request.url.path.endswith("/load_lora_adapter"):
                loads.append(str(request.url))

        publisher._http.event_hooks["request"].append(count)
        try:
            with pytest.raises(PublishFailure) as caught:
                await (await publisher.publish(path, version=1)).wait(timeout=30)
        finally:
            await publisher.aclose()
        return caught.value, loads

    failure, loads = run(scenario())
    assert failure.stage == "load" and failure.failure.status_code == 500
    assert "max_lora_rank" in failure.failure.message
    assert len(loads) == 1
