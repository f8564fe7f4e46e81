"""A misbehaving inference server ends a model call in one classified failure, inside the call's budget.

Each stand-in fault switch is driven per request (`X-Standin-Fault`) against the shared stand-in server;
the call goes through the same client and model-call code a rollout uses, and is classified as a rollout
would classify it.
"""

from __future__ import annotations

import glob
import os
import re
import time

import pytest
from env_pools import TEST_REF_PREFIXES
from planes import plane_on_own_loop
from waiting import runner

from renderer_actors.tokenizer import BUNDLED_MODEL, load_tokenizer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.rollout.client import build_client
from rollout_actors.rollout.failures import classify
from rollout_actors.rollout.model_call import complete_chat, complete_tokens
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

SECRET_VAR = "RAY_ROLLOUTS_TEST_SECRET"
CALL_TIMEOUT_S = 3.0  # the documented total budget of one call in these tests
SLACK_S = 5.0  # scheduling noise on a loaded 2-core machine; far below what an unbounded call would take
DEADLINE_S = 60


run = runner(DEADLINE_S)
PLANE_DEADLINE_S = 120


@pytest.fixture(scope="module")
def shared(ray_session):
    """(run, plane): one small plane for the tests that send one rollout through it and read only its result
    (a plane's start, its env pool's and its renderer's are seconds each here)."""
    with plane_on_own_loop({"train": 4, "eval": 1}, PLANE_DEADLINE_S) as started:
        yield started


def client_config(standin, fault: str, **headers: str) -> ClientConfig:
    return ClientConfig(
        base_url=standin.base_url,
        model=BUNDLED_MODEL,
        read_timeout_s=2.0,
        connect_timeout_s=1.0,
        max_retries=1,
        call_timeout_s=CALL_TIMEOUT_S,
        headers={"X-Standin-Fault": fault, **headers},
    )


async def one_call(config: ClientConfig, mode: str = "token", vocab_size: int | None = None):
    """(kind, failure, seconds) of one model call, classified where a rollout classifies it."""
    client = build_client(config)
    started = time.monotonic()
    sampling = SamplingConfig(max_tokens=16, seed=1)
    try:
        if mode == "token":
            await complete_tokens(
                client,
                config.model,
                [1, 2, 3],
                sampling,
                timeout_s=config.total_call_timeout_s,
                vocab_size=vocab_size,
            )
        else:
            messages = [{"role": "user", "content": "hi"}]
            await complete_chat(
                client, config.model, messages, None, sampling, timeout_s=config.total_call_timeout_s
            )
        return "ok", None, time.monotonic() - started
    except Exception as exc:
        kind, failure = classify(exc)
        return kind, failure, time.monotonic() - started
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["token", "chat"])
def test_a_slow_drip_cannot_stretch_a_call_past_its_total_deadline(standin, mode):
    kind, failure, seconds = run(one_call(client_config(standin, "drip"), mode))
    assert kind == "model" and failure.type == "CallDeadlineExceeded", failure
    assert CALL_TIMEOUT_S - 0.5 <= seconds < CALL_TIMEOUT_S + SLACK_S


def rate_limited(standin) -> int:
    """429s the stand-in has sent for `retry_after` faults so far: the attempts that reached it."""
    text = httpx.get(f"{standin.url}/metrics", timeout=10, trust_env=False).text
    return int(float(re.search(r'standin_faults_injected_total\{kind="retry_after"\} (\S+)', text).group(1)))


@pytest.mark.parametrize("mode", ["token", "chat"])
def test_a_retry_after_past_the_call_deadline_is_not_waited_for_and_the_429_is_the_answer(standin, mode):
    """The SDK would sleep the 30 s (it honours up to two minutes); the call's deadline is 3 s, so no retry
    can happen: the server's 429 is the answer, after one attempt, in both modes (a wait until the
    deadline would have answered `CallDeadlineExceeded`)."""
    config = client_config(standin, "retry_after", **{"X-Standin-Retry-After": "30"})
    before = rate_limited(standin)
    kind, failure, _ = run(one_call(config, mode))
    assert kind == "model" and failure.type == "RateLimitError" and failure.status_code == 429, failure
    assert rate_limited(standin) - before == 1


@pytest.mark.parametrize("mode", ["token", "chat"])
def test_a_short_retry_after_is_honoured_once_and_the_429_reported(standin, mode):
    config = client_config(standin, "retry_after", **{"X-Standin-Retry-After": "0.2"})
    before = rate_limited(standin)
    kind, failure, _ = run(one_call(config, mode))
    assert kind == "model" and failure.status_code == 429, failure
    assert rate_limited(standin) - before == 2  # the first attempt and the one SDK retry (contract 6)


@pytest.mark.parametrize("mode", ["token", "chat"])
def test_a_json_content_type_with_a_body_that_is_not_json_is_a_model_failure(standin, mode):
    kind, failure, _ = run(one_call(client_config(standin, "not_json"), mode))
    assert kind == "model" and failure.type == "MalformedResponse", failure
    assert "not JSON" in failure.message


@pytest.mark.parametrize("oov_id", ["-1", str(2**40), None])
def test_token_ids_outside_the_vocabulary_are_a_model_failure(standin, oov_id):
    vocab_size = len(load_tokenizer(BUNDLED_MODEL))
    headers = {"X-Standin-Oov-Id": oov_id} if oov_id else {}  # None: exactly the vocabulary size
    kind, failure, _ = run(one_call(client_config(standin, "oov", **headers), vocab_size=vocab_size))
    assert kind == "model" and failure.type == "MalformedResponse", failure
    assert "outside the vocabulary" in failure.message


def test_out_of_vocabulary_ids_in_chat_mode_are_a_model_failure(standin):
    kind, failure, _ = run(one_call(client_config(standin, "oov", **{"X-Standin-Oov-Id": "-7"}), "chat"))
    assert kind == "model" and "outside the vocabulary" in failure.message


def test_an_error_body_that_echoes_the_key_never_carries_it(standin, monkeypatch):
    secret = os.environ[SECRET_VAR]
    config = client_config(standin, "echo_headers").model_copy(update={"api_key_var": SECRET_VAR})
    kind, failure, _ = run(one_call(config))
    assert kind == "model" and failure.status_code == 400
    assert "authorization" in failure.message.lower()  # the echo happened...
    assert secret not in failure.model_dump_json()  # ...and the key did not survive it


@pytest.mark.slow
def test_an_echoed_key_reaches_no_result_log_line_or_file_through_the_plane(ray_session, standin, tmp_path):
    """End to end: the planted key is sent as the API key, the server echoes it in a 400, and it appears
    in no Result, no JSON line, no Ray log file and no stand-in log."""
    secret = os.environ[SECRET_VAR]
    client = ClientConfig(
        base_url=standin.base_url,
        model=BUNDLED_MODEL,
        api_key_var=SECRET_VAR,
        headers={"X-Standin-Fault": "echo_headers"},
    )
    request = RolloutRequest(
        env=Ref(target="env_actors.examples.math_env:MathEnv"), task_index=0, client=client
    )

    async def scenario():  # a plane of its own, closed (its processes' logs written) before they are read
        config = PlaneConfig(
            lanes={"train": 4, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        async with RolloutPlane(config) as plane:
            await plane.submit(request)
            return await plane.next_result(timeout=DEADLINE_S)

    result = run(scenario(), deadline=120)
    assert result.kind == "model" and result.error.status_code == 400
    assert "[redacted]" in result.error.message
    lines = tmp_path / "results.jsonl"
    lines.write_text(result.model_dump_json() + "\n")
    assert secret not in lines.read_text()
    import ray

    log_dir = ray._private.worker.global_worker.node.get_logs_dir_path()
    leaked = [
        path
        for path in _files(log_dir) + _files(os.path.dirname(str(standin.log_path)))
        if _holds(path, secret)
    ]
    assert leaked == []


def _files(root: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True) if os.path.isfile(p)]


def _holds(path: str, secret: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return secret.encode() in handle.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token", "chat"])
def test_a_rollout_whose_server_samples_an_id_past_the_vocabulary_ends_model_without_recording_it(
    shared, standin, mode
):
    """Both modes: the bound is the model's vocabulary (ids 0..vocab_size-1: the renderer's in token mode,
    the tokenizer's local files in chat mode); the server sent exactly `vocab_size`, which no tokenizer of
    this model can decode."""
    client = ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Fault": "oov"})
    request = RolloutRequest(
        env=Ref(target="env_actors.examples.math_env:MathEnv"), task_index=0, client=client, mode=mode
    )
    vocab_size = len(load_tokenizer(BUNDLED_MODEL))

    on_plane, plane = shared

    async def scenario():
        await plane.submit(request)
        return await plane.next_result(timeout=DEADLINE_S)

    result = on_plane(scenario())
    assert result.kind == "model" and result.error.type == "MalformedResponse", result.error
    assert str(vocab_size) in result.error.message
    assert all(vocab_size not in turn.completion_ids for turn in result.turns)
