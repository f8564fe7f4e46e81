"""`ClientConfig` and `SamplingConfig` refuse unknown fields and absurd values, naming the field, and the
plane answers such a request `caller` instead of sending it."""

from __future__ import annotations

import asyncio

import pytest
from env_pools import TEST_REF_PREFIXES
from pydantic import ValidationError

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, SamplingConfig

BASE = {"base_url": "http://127.0.0.1:8000/v1", "model": BUNDLED_MODEL}

BAD_CLIENT = [
    ({"deadline": 5}, "deadline"),
    ({"read_timeout_s": -1.0}, "read_timeout_s"),
    ({"connect_timeout_s": float("nan")}, "connect_timeout_s"),
    ({"write_timeout_s": float("inf")}, "write_timeout_s"),
    ({"call_timeout_s": 0}, "call_timeout_s"),
    ({"headers": {"X-Trace": "a\r\nInjected: 1"}}, "headers"),
    ({"headers": {"Bad Name": "x"}}, "headers"),
    ({"headers": {"Authorization": "Bearer sk-elsewhere"}}, "headers"),
    ({"base_url": "not a url"}, "base_url"),
    ({"base_url": "file:///etc/passwd"}, "base_url"),
    ({"max_connections": 0}, "max_connections"),
    ({"api_key_var": "KEY; rm -rf /"}, "api_key_var"),
]
BAD_SAMPLING = [
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"seed": 2**100}, "seed"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temprature": 0.5}, "temprature"),
    ({"extra_body": {"prompt": [1, 2, 3]}}, "extra_body"),
    ({"extra_body": {"return_token_ids": False}}, "extra_body"),
    ({"extra_body": {"temperature": 0.0}}, "extra_body"),
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_CLIENT)
def test_client_config_refuses_absurd_values_naming_the_field(fields, name):
    with pytest.raises(ValidationError) as info:
        ClientConfig(**{**BASE, **fields})
    assert name in str(info.value)


@pytest.mark.parametrize(("fields", "name"), BAD_SAMPLING)
def test_sampling_config_refuses_absurd_values_naming_the_field(fields, name):
    with pytest.raises(ValidationError) as info:
        SamplingConfig(**fields)
    assert name in str(info.value)


def test_the_total_call_timeout_defaults_to_the_per_attempt_budget():
    config = ClientConfig(**BASE, read_timeout_s=10, connect_timeout_s=2, max_retries=1)
    assert config.total_call_timeout_s == 24.0
    assert ClientConfig(**BASE, call_timeout_s=5).total_call_timeout_s == 5.0


@pytest.mark.slow
def test_the_plane_answers_each_absurd_config_with_one_caller_result_naming_the_field(ray_session):
    cases = [("client", fields, name) for fields, name in BAD_CLIENT]
    cases += [("sampling", fields, name) for fields, name in BAD_SAMPLING]

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 8, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        async with RolloutPlane(config) as plane:
            ids = {}
            for part, fields, name in cases:
                request = {
                    "env": Ref(target="env_actors.examples.math_env:MathEnv").model_dump(),
                    "task_index": 0,
                    "client": dict(BASE),
                }
                if part == "client":
                    request["client"].update(fields)
                else:
                    request["sampling"] = fields
                ids[await plane.submit(request)] = name
            results = [await plane.next_result(timeout=30) for _ in ids]
            return ids, results

    ids, results = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert len(results) == len(cases)
    for result in results:
        assert result.kind == "caller", result
        assert ids[result.request_id] in result.error.message
