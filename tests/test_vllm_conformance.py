"""vLLM 0.33's own code is the judge. Everything in front of vLLM's engine runs on CPU: its request and
response models, its `vllm serve` parser and validators, its tool and reasoning parsers, its LoRA checks and
its real HTTP app. Here they judge what the plane sends (captured from real rollouts), what the stand-in
answers, how `ServerSpec` launches vLLM, and what the README says about it.

vLLM is part of the `test` extra: without it this module fails to collect (it never skips). Its imports
are slow (the chat protocol alone ~10 s, a minute on a loaded 2-core machine), so each is paid once, in a
module-scoped fixture.
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
import sys
import tomllib
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM cannot infer a device on a GPU-less machine

if importlib.util.find_spec("vllm") is None:
    raise ImportError("vLLM 0.33 is required by the conformance tests: pip install -e '.[test]'")

import pytest
from conftest import served_like_vllm
from env_pools import TEST_REF_PREFIXES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import runner

from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL, bundled_tokenizer_dir
from rollout_actors.inference.server_actor import MODEL_FAMILIES, ServerSpec, vllm_command
from rollout_actors.inference.standin import StandinServer
from rollout_actors.inference.standin.answers import parse_turn
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.policy.lora import VLLM_LORA_RANKS, AdapterLimits, adapter_problems
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY_VAR = "RAY_ROLLOUTS_TEST_SECRET"
DEADLINE_S = 240
CALC = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")
ECHO = Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 4, "turns": 2})

# Every SamplingConfig option, across three rollouts; `max_tokens` tells their captured bodies apart.
TOKEN_FULL = SamplingConfig(
    temperature=0.7,
    top_p=0.9,
    max_tokens=24,
    seed=5,
    logprobs=True,
    stop=["\n\n\n"],
    extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05},
)
TOKEN_BARE = SamplingConfig(max_tokens=23, logprobs=False)
CHAT = SamplingConfig(temperature=0.6, top_p=0.95, max_tokens=200, seed=3, extra_body={"top_k": 40})
SAMPLINGS = {s.max_tokens: s for s in (TOKEN_FULL, TOKEN_BARE, CHAT)}


run = runner(DEADLINE_S)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM's judges, imported once for the module."""
    from vllm.config.lora import LoRAConfig
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.entrypoints.common.cli_args import (
        make_arg_parser,
        validate_api_server_args,
        validate_parsed_serve_args,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return SimpleNamespace(
        version=importlib.metadata.version("vllm"),
        parser=make_arg_parser(FlexibleArgumentParser()),
        validate_serve=validate_parsed_serve_args,
        validate_api=validate_api_server_args,
        LoRAConfig=LoRAConfig,
        PEFTHelper=PEFTHelper,
        CompletionRequest=CompletionRequest,
        CompletionResponse=CompletionResponse,
        ChatCompletionRequest=ChatCompletionRequest,
        ChatCompletionResponse=ChatCompletionResponse,
        create_error_response=create_error_response,
        tool_parsers=ToolParserManager,
        reasoning_parsers=ReasoningParserManager,
        NCCLInit=NCCLWeightTransferInitInfo,
        NCCLUpdate=NCCLWeightTransferUpdateInfo,
    )


@pytest.fixture(scope="module")
def real_app(vllm):
    """vLLM's own HTTP app with no engine, served as `ServerSpec` launches it (dev mode, runtime LoRA, an
    API key), behind Starlette's test client. Routes that need the engine answer 500; validation, the key
    check and the route table are vLLM's."""
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app

    command = vllm_command(ServerSpec(model="Qwen/Qwen3-8B"), "127.0.0.1", 8000)
    args = vllm.parser.parse_args([*command[4:], "--api-key", os.environ[KEY_VAR]])
    args.model = args.model_tag
    saved = {k: os.environ.get(k) for k in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")}
    os.environ.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        app = build_app(args, ("generate",), None)
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: it would start an engine
    return SimpleNamespace(app=app, client=client, paths=app.openapi()["paths"])


@pytest.fixture(scope="module")
def keyed_standin():
    """A stand-in started as `ServerSpec` starts vLLM, with an API key and the test routes."""
    with StandinServer(served_like_vllm(), env={"VLLM_API_KEY": os.environ[KEY_VAR]}) as server:
        yield server


def key_header() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ[KEY_VAR]}"}


@pytest.fixture(scope="module")
def sent(ray_session, keyed_standin) -> list[dict[str, Any]]:
    """The request bodies the plane sent in real rollouts: token mode with every sampling option and with
    none, chat mode with environment tools and reasoning (a second turn sends the first one back)."""
    url = keyed_standin.base_url

    def client(**headers: str) -> ClientConfig:
        return ClientConfig(base_url=url, model=BUNDLED_MODEL, api_key_var=KEY_VAR, headers=headers)

    requests = [
        RolloutRequest(env=ECHO, task_index=0, client=client(), sampling=TOKEN_FULL),
        RolloutRequest(env=ECHO, task_index=1, client=client(), sampling=TOKEN_BARE),
        RolloutRequest(
            env=CALC,
            task_index=1,
            mode="chat",
            client=client(**{"X-Standin-Think-Rate": "1", "X-Standin-Correct-Rate": "1"}),
            sampling=CHAT,
        ),
    ]

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 4, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        async with RolloutPlane(config) as plane:
            for request in requests:
                await plane.submit(request)
            return [await plane.next_result(timeout=120) for _ in requests]

    results = run(scenario())
    assert all(r.kind == "ok" for r in results), [r.error for r in results]
    with httpx.Client(base_url=keyed_standin.url, timeout=10, trust_env=False) as http:
        bodies = http.get("/admin/bodies").json()["bodies"]
    # Other tests of this module call the same stand-in directly; the plane's calls are told by `max_tokens`.
    return [item for item in bodies if item["body"].get("max_tokens") in SAMPLINGS]


# --------------------------------------------------------------------------- row 1: what is installed


def test_the_test_extra_pins_vllm_033_and_the_vllm_extra_starts_at_the_tested_release(vllm):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "vllm==0.33.*" in extras["test"]
    assert extras["vllm"] == ["vllm>=0.33"]  # the oldest release these tests pass against
    assert vllm.version.startswith("0.33.")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith("vllm") for d in dependencies)  # a GPU server's package, not the plane's


# ------------------------------------------------------------------------ the launch: vLLM's parser


def parse_serve(vllm, command: list[str]):
    """`vllm serve`'s own parsing and validation of a command `vllm_command` built."""
    assert command[:4] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    args = vllm.parser.parse_args(command[4:])
    args.model = args.model_tag  # as `vllm serve` does
    vllm.validate_serve(args)
    vllm.validate_api(args)
    return args


LAUNCHES = [
    ServerSpec(
        model=f"org/{family}-x",
        enable_lora=lora,
        weight_updates=updates,
        tensor_parallel_size=tp,
        **({"max_lora_rank": 16, "lora_retain": 2, "lora_in_use": 0} if tp > 1 else {}),
    )
    for family, lora, updates, tp in itertools.product(MODEL_FAMILIES, (True, False), (True, False), (1, 2))
] + [
    ServerSpec(model="my/model", tool_call_parser="hermes", reasoning_parser=None, api_key_var=KEY_VAR),
    ServerSpec(
        model="my/model", tool_call_parser=None, reasoning_parser="qwen3", weight_transfer_backend="ipc"
    ),
    ServerSpec(
        model="Qwen/Qwen3-8B", logprobs_mode="raw_logprobs", generation_config="auto", max_lora_rank=512
    ),
]


def test_every_launch_parses_with_vllms_own_serve_parser_and_validators(vllm):
    tools, reasonings = vllm.tool_parsers.list_registered(), vllm.reasoning_parsers.list_registered()
    for spec in LAUNCHES:
        args = parse_serve(vllm, vllm_command(spec, "10.0.0.5", 8000))
        tool, reasoning = spec.parsers
        assert args.model == spec.model and args.tensor_parallel_size == spec.tensor_parallel_size
        assert (args.tool_call_parser, args.enable_auto_tool_choice) == (tool, tool is not None), spec
        assert (args.reasoning_parser or None) == reasoning, spec  # vLLM: "" for none
        assert tool is None or tool in tools
        assert reasoning is None or reasoning in reasonings
        assert args.generation_config == spec.generation_config  # row 5: "vllm" unless chosen otherwise
        assert args.logprobs_mode == spec.logprobs_mode  # row 6
        if spec.weight_updates:
            assert args.weight_transfer_config.backend == spec.weight_transfer_backend
        if spec.enable_lora:
            assert args.enable_lora and args.max_lora_rank == spec.max_lora_rank
            # vLLM refuses `--max-loras` and `--max-cpu-loras` combinations only here, not in the parser.
            vllm.LoRAConfig(
                max_lora_rank=args.max_lora_rank, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras
            )
        else:
            assert not args.enable_lora


def test_the_default_launch_decides_generation_defaults_and_logprob_kind(vllm):
    """Rows 5 and 6: without `--generation-config vllm` Qwen3's generation_config.json would set top_k=20
    on every request the plane sends without it; without `--logprobs-mode processed_logprobs` the logprobs
    recorded would be the raw model's, not the distribution sampled from."""
    args = parse_serve(vllm, vllm_command(ServerSpec(model="Qwen/Qwen3-8B"), "h", 1))
    assert args.generation_config == "vllm"
    assert args.logprobs_mode == "processed_logprobs"
    bare = vllm.parser.parse_args(["Qwen/Qwen3-8B"])
    assert bare.generation_config == "auto" and bare.logprobs_mode == "raw_logprobs"  # vLLM's defaults


def test_the_judge_refuses_what_vllm_would_not_start_with(vllm):
    """The parser is a real judge: the flags ServerSpec refuses, vLLM refuses too."""
    command = vllm_command(ServerSpec(model="Qwen/Qwen3-8B"), "h", 1)
    rank = command.index("--max-lora-rank") + 1
    with pytest.raises(SystemExit):
        parse_serve(vllm, [*command[:rank], "48", *command[rank + 1 :]])
    with pytest.raises((KeyError, SystemExit)):
        parse_serve(vllm, [*command, "--tool-call-parser", "no_such_parser"])
    # an unknown --reasoning-parser passes both validators (vLLM fails only at engine start): hence the
    # registry checks above
    assert "no_such_parser" not in vllm.reasoning_parsers.list_registered()
    with pytest.raises(ValueError):
        vllm.LoRAConfig(max_lora_rank=64, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        ServerSpec(model="Qwen/Qwen3-8B", max_loras=4, max_cpu_loras=2)


def test_an_unknown_model_has_no_parsers_until_chosen(vllm):
    """Row 9: vLLM's qwen3 reasoning parser refuses a tokenizer without think tokens; an unknown model
    must not silently get Qwen3's parsers."""
    with pytest.raises(ValueError, match="no parser family"):
        ServerSpec(model="mistralai/Mistral-7B-Instruct-v0.3")
    spec = ServerSpec(
        model="mistralai/Mistral-7B-Instruct-v0.3", tool_call_parser="mistral", reasoning_parser=None
    )
    args = parse_serve(vllm, vllm_command(spec, "h", 1))
    assert args.tool_call_parser == "mistral" and not args.reasoning_parser


# ------------------------------------------------------------------------------- routes of the real app


PLANE_CALLS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
]
"""Every route the plane calls (`model_call`, `inference.load`, `publish`, `inference.weights`,
`server_actor` readiness)."""


def test_every_route_the_plane_calls_and_the_stand_in_serves_exists_in_the_real_app(real_app):
    paths = real_app.paths
    for method, path in PLANE_CALLS:
        assert method.lower() in paths.get(path, {}), (method, path)
    pause = [p["name"] for p in paths["/pause"]["post"].get("parameters", [])]
    assert "mode" in pause  # the plane's only query parameter (`mode=keep|abort`)
    from rollout_actors.inference.standin.server import StandinState, build_app

    standin = build_app(StandinState(served_like_vllm())).app
    for route in standin.routes:
        if route.path.startswith("/admin"):
            continue  # test-only routes
        for method in route.methods - {"HEAD"}:
            assert method.lower() in paths.get(route.path, {}), (method, route.path)


def test_the_key_guards_only_v1_on_both_and_dev_routes_are_open(real_app, keyed_standin):
    """Row 8: vLLM's key guards `/v1` (and `/v2`, `/inference`, `/cohere`); `/pause`, `/resume` and the
    weight routes answer anyone who reaches the port (here: vLLM 500s for the missing engine, not 401)."""
    with httpx.Client(base_url=keyed_standin.url, timeout=10, trust_env=False) as http:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/load_lora_adapter"),
        ):
            ours, theirs = http.request(method, path, json={}), real_app.client.request(method, path, json={})
            assert ours.status_code == theirs.status_code == 401
            assert ours.json() == theirs.json() == {"error": "Unauthorized"}
        for path in ("/is_paused", "/weight_info"):
            assert real_app.client.get(path).status_code != 401
            assert http.get(path).status_code == 200
    cluster = (ROOT / "docs" / "cluster.md").read_text()
    assert "guards only `/v1`" in cluster and "open to anyone who can reach the port" in cluster


# ------------------------------------------------------------------------- error bodies, side by side


BODY_ERRORS = [
    ("/v1/completions", {"model": BUNDLED_MODEL, "prompt": [1, 2], "max_tokens": "x"}),
    ("/v1/completions", {"model": BUNDLED_MODEL, "prompt": [1, 2], "temperature": "hot"}),
    ("/v1/completions", {"model": BUNDLED_MODEL, "prompt": [1, 2], "seed": 2**64}),
    (
        "/v1/chat/completions",
        {"model": BUNDLED_MODEL, "messages": [{"role": "user", "content": "hi"}], "n": "x"},
    ),
]


@pytest.mark.parametrize(("path", "body"), BODY_ERRORS, ids=lambda v: v if isinstance(v, str) else None)
def test_a_body_vllm_refuses_gets_the_same_status_and_error_from_the_stand_in(
    real_app, keyed_standin, path, body
):
    theirs = real_app.client.post(path, json=body, headers=key_header())
    with httpx.Client(timeout=10, trust_env=False) as http:
        ours = http.post(f"{keyed_standin.url}{path}", json=body, headers=key_header())
    assert theirs.status_code == 400
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())


CHAT_HI = {"model": BUNDLED_MODEL, "messages": [{"role": "user", "content": "hi"}]}
TOKENS = {"model": BUNDLED_MODEL, "prompt": [1, 2, 3]}
APP_ERRORS = [
    ("/v1/chat/completions", {**CHAT_HI, "top_logprobs": 3}),  # needs `logprobs: true`
    ("/v1/chat/completions", {**CHAT_HI, "top_logprobs": -1}),
    ("/v1/chat/completions", {**CHAT_HI, "top_logprobs": -3, "logprobs": True}),
    ("/v1/chat/completions", {**CHAT_HI, "top_logprobs": "x", "logprobs": True}),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": "auto"}),  # tool_choice without tools
    ("/v1/completions", {**TOKENS, "logprobs": -3}),
    ("/v1/completions", {**TOKENS, "logprobs": "x"}),
    ("/v1/completions", {"model": BUNDLED_MODEL}),  # no prompt
    ("/v1/completions", {"model": BUNDLED_MODEL, "prompt": ""}),
    ("/v1/load_lora_adapter", {"lora_name": "a"}),
    ("/v1/unload_lora_adapter", {}),
    ("/finish_weight_update", {"weight_version": 3}),
    ("/pause?mode=bogus", None),
    ("/pause?mode=keep&clear_cache=maybe", None),
]
"""Every error path of the stand-in that vLLM's engine-free app answers itself (its validators, its query
parsing): each is judged by that app's body, field by field. The paths that need vLLM's engine are judged
by vLLM's own code below (`ENGINE_ERRORS`); what only the stand-in refuses is listed in `STANDIN_ONLY`."""


@pytest.mark.parametrize(("path", "body"), APP_ERRORS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_error_vllms_app_answers_itself_has_the_same_body_from_the_stand_in(
    real_app, keyed_standin, path, body
):
    theirs = real_app.client.post(path, json=body, headers=key_header())
    with httpx.Client(timeout=10, trust_env=False) as http:
        ours = http.post(f"{keyed_standin.url}{path}", json=body, headers=key_header())
        http.post(f"{keyed_standin.url}/resume")
    assert theirs.status_code == 400, theirs.text
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())


def _over_max_logprobs(vllm, body: dict, model: type) -> Any:
    """vLLM's refusal of more logprobs than `--max-logprobs` (default 20): its `SamplingParams` check, run
    against the served model's figures (the engine-free app never builds sampling params)."""
    from vllm.exceptions import VLLMValidationError

    params = model.model_validate(body).to_sampling_params(max_tokens=8, default_sampling_params={})
    config = SimpleNamespace(max_logprobs=20, get_vocab_size=lambda: 151_669)
    with pytest.raises(VLLMValidationError) as refused:
        params._validate_logprobs(config)
    return refused.value


def _salt(value: str) -> Any:
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as refused:
        validate_cache_salt(value)
    return refused.value


MAX_MODEL_LEN = served_like_vllm().max_model_len
VOCAB_SIZE = 151_669  # the bundled (Qwen3) tokenizer's, as vLLM's model config would give it


def _refused(call: Any) -> Any:
    """What vLLM's own check raises (a `VLLMValidationError`)."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as refused:
        call()
    return refused.value


def _out_of_vocabulary(ids: list[int]) -> Any:
    """`BaseRenderer.validate_token_ids` (vllm/renderers/base.py), as the engine's input processor calls it."""
    from vllm.renderers.base import BaseRenderer

    renderer = SimpleNamespace(
        tokenizer=None, model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB_SIZE)
    )
    return _refused(lambda: BaseRenderer.validate_token_ids(renderer, ids))


def _no_prompt() -> Any:
    """`BaseRenderer.render_prompts` of what `prompt_to_seq` makes of `"prompt": []`: no prompt at all."""
    from vllm.renderers.base import BaseRenderer
    from vllm.renderers.inputs.preprocess import prompt_to_seq

    return _refused(lambda: BaseRenderer.render_prompts(SimpleNamespace(), prompt_to_seq([])))


def _prompt_length(length: int) -> Any:
    """`InputProcessor._validate_prompt_len` (vllm/v1/engine/input_processor.py) for a text-only model."""
    from vllm.v1.engine.input_processor import InputProcessor

    processor = SimpleNamespace(
        skip_prompt_length_check=False,
        supports_mm_inputs=False,
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN, runner_type="generate"),
    )
    return _refused(lambda: InputProcessor._validate_prompt_len(processor, length, "decoder"))


def _tokenize_params(model: type, body: dict, ids: list[int] | None = None) -> Any:
    """The request's `TokenizeParams` (built, then its token length check): vLLM's context checks."""
    config = SimpleNamespace(max_model_len=MAX_MODEL_LEN)

    def check() -> None:
        params = model.model_validate(body).build_tok_params(config)
        if ids is not None:
            params._token_len_check(None, ids)

    return _refused(check)


FILLS_CONTEXT = {**TOKENS, "prompt": [1] * MAX_MODEL_LEN}
OVER_CONTEXT = {**TOKENS, "prompt": [1] * (MAX_MODEL_LEN + 1)}
ENGINE_ERRORS = [
    ("/v1/completions", {**TOKENS, "prompt": [1, 10**6]}, lambda v: _out_of_vocabulary([1, 10**6])),
    ("/v1/completions", {**TOKENS, "prompt": [-1, 2]}, lambda v: _out_of_vocabulary([-1, 2])),
    ("/v1/completions", {**TOKENS, "prompt": []}, lambda v: _no_prompt()),
    ("/v1/completions", {**TOKENS, "prompt": [[]]}, lambda v: _prompt_length(0)),
    ("/v1/completions", FILLS_CONTEXT, lambda v: _prompt_length(MAX_MODEL_LEN)),
    (
        "/v1/completions",
        OVER_CONTEXT,
        lambda v: _tokenize_params(v.CompletionRequest, OVER_CONTEXT, OVER_CONTEXT["prompt"]),
    ),
    (
        "/v1/completions",
        {**TOKENS, "max_tokens": MAX_MODEL_LEN + 1},
        lambda v: _tokenize_params(v.CompletionRequest, {**TOKENS, "max_tokens": MAX_MODEL_LEN + 1}),
    ),
    (
        "/v1/chat/completions",
        {**CHAT_HI, "max_completion_tokens": MAX_MODEL_LEN + 1},
        lambda v: _tokenize_params(
            v.ChatCompletionRequest, {**CHAT_HI, "max_completion_tokens": MAX_MODEL_LEN + 1}
        ),
    ),
    (
        "/v1/completions",
        {**TOKENS, "logprobs": 30},
        lambda v: _over_max_logprobs(v, {**TOKENS, "logprobs": 30}, v.CompletionRequest),
    ),
    (
        "/v1/chat/completions",
        {**CHAT_HI, "logprobs": True, "top_logprobs": 21},
        lambda v: _over_max_logprobs(
            v, {**CHAT_HI, "logprobs": True, "top_logprobs": 21}, v.ChatCompletionRequest
        ),
    ),
    ("/v1/completions", {**TOKENS, "cache_salt": ""}, lambda v: _salt("")),
    ("/v1/chat/completions", {**CHAT_HI, "cache_salt": "a/b"}, lambda v: _salt("a/b")),
    (
        "/v1/completions",
        {**TOKENS, "model": "no-such-model"},
        # `OpenAIServing._check_model` (serve/engine/serving.py): the served names are the valid aliases
        lambda v: v.create_error_response(
            f"The model `no-such-model` does not exist. Valid aliases: {BUNDLED_MODEL}.",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        ),
    ),
]
"""Error paths vLLM reaches only with an engine: the expected body is vLLM's `create_error_response` of
what its own code raises (or, for an unknown model, builds)."""

STANDIN_ONLY = {
    "n > 1, stream": "the stand-in samples one non-streamed choice: a limit of the stand-in, named as such",
    "X-Standin-* headers, /admin": "test controls vLLM has not",
    "injected faults (500, 429, echo_headers)": "imitate a misbehaving server or proxy, not vLLM",
    "503 while loading": "vLLM binds its port only once loaded; readiness polls /health either way",
}
"""The stand-in's error paths with no vLLM counterpart to compare with, and why."""


@pytest.mark.parametrize(
    ("path", "body", "judge"), ENGINE_ERRORS, ids=lambda v: v if isinstance(v, str) else None
)
def test_every_error_vllms_engine_would_answer_has_the_same_body_from_the_stand_in(
    vllm, keyed_standin, path, body, judge
):
    expected = judge(vllm)
    if isinstance(expected, Exception):
        expected = vllm.create_error_response(expected)
    expected = expected.model_dump()
    with httpx.Client(timeout=10, trust_env=False) as http:
        ours = http.post(f"{keyed_standin.url}{path}", json=body, headers=key_header())
    assert (ours.status_code, ours.json()) == (expected["error"]["code"], expected)


def test_more_tokens_than_the_room_after_the_prompt_are_clamped_as_vllm_clamps_them(vllm, keyed_standin):
    """vLLM 0.33 refuses a request for more than the context (above), and clamps one for more than the
    room the prompt leaves (`get_max_tokens`): answered, never past the context."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    prompt = [1] * (MAX_MODEL_LEN - 3)
    room = get_max_tokens(MAX_MODEL_LEN, 100, len(prompt), {})
    body = {**TOKENS, "prompt": prompt, "max_tokens": 100, "ignore_eos": True}
    with httpx.Client(timeout=30, trust_env=False) as http:
        ours = http.post(f"{keyed_standin.url}/v1/completions", json=body, headers=key_header())
    assert ours.status_code == 200, ours.text
    assert room == 3 and ours.json()["usage"]["completion_tokens"] == room


SAMPLING_ERRORS = [
    ("/v1/completions", {"temperature": 3}),  # row 7
    ("/v1/completions", {"temperature": -0.5}),
    ("/v1/completions", {"top_p": 0}),
    ("/v1/completions", {"max_tokens": 0}),  # row 7
    ("/v1/completions", {"max_tokens": -1}),
    ("/v1/chat/completions", {"temperature": 2.5}),
    ("/v1/chat/completions", {"max_tokens": 0}),
]


@pytest.mark.parametrize(
    ("path", "change"), SAMPLING_ERRORS, ids=lambda v: v if isinstance(v, str) else str(v)
)
def test_sampling_vllm_refuses_is_the_same_400_on_the_stand_in(vllm, keyed_standin, path, change):
    """What vLLM refuses only once it builds `SamplingParams` (the engine-free app cannot get there): the
    expected body is vLLM's own `create_error_response` of the error its `to_sampling_params` raises."""
    if path == "/v1/completions":
        body, model = (
            {"model": BUNDLED_MODEL, "prompt": [1, 2, 3], "max_tokens": 8, **change},
            vllm.CompletionRequest,
        )
    else:
        messages = [{"role": "user", "content": "hi"}]
        body, model = (
            {"model": BUNDLED_MODEL, "messages": messages, "max_tokens": 8, **change},
            vllm.ChatCompletionRequest,
        )
    from vllm.exceptions import VLLMValidationError

    request = model.model_validate(body)
    with pytest.raises(VLLMValidationError) as refused:
        request.to_sampling_params(max_tokens=body["max_tokens"], default_sampling_params={})
    expected = vllm.create_error_response(refused.value).model_dump()
    with httpx.Client(timeout=10, trust_env=False) as http:
        ours = http.post(f"{keyed_standin.url}{path}", json=body, headers=key_header())
    assert (ours.status_code, ours.json()) == (400, expected)


def test_the_plane_refuses_what_vllm_refuses_before_anything_is_sent(vllm):
    """Row 7 and 12, on the caller's side: out-of-range sampling and prompt-changing extra_body fields are
    `caller` errors, not a server's 400 (or a silently different prompt) later."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=2.5)
    SamplingConfig(temperature=2.0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingConfig(extra_body={"truncate_prompt_tokens": 100})
    with pytest.raises(ValueError, match="prompt_embeds"):
        SamplingConfig(extra_body={"prompt_embeds": "AAAA"})
    # both are real vLLM fields, so they would have been honoured, not ignored:
    fields = vllm.CompletionRequest.model_fields
    assert "truncate_prompt_tokens" in fields and "prompt_embeds" in fields


# ---------------------------------------------------------------------- what the plane sends, judged


def test_every_body_the_plane_sent_is_a_vllm_request_with_nothing_left_over(vllm, sent):
    kinds = {body["path"] for body in sent}
    assert kinds == {"/v1/completions", "/v1/chat/completions"}
    for item in sent:
        model = vllm.CompletionRequest if item["path"] == "/v1/completions" else vllm.ChatCompletionRequest
        request = model.model_validate(item["body"])
        assert request.model_extra == {}, (item["path"], request.model_extra)


def test_the_sampling_vllm_derives_from_each_body_is_the_sampling_asked_for(vllm, sent):
    renderer = Renderer.load(RendererKey.from_config(BUNDLED_MODEL, RendererConfig()))
    renderer_stops = set(renderer.stop_ids)
    assert renderer.tokenizer.convert_tokens_to_ids("<|endoftext|>") in renderer_stops  # not the eos
    seen = set()
    for item in sent:
        body = item["body"]
        sampling = SAMPLINGS[body["max_tokens"]]
        seen.add(sampling.max_tokens)
        chat = item["path"] == "/v1/chat/completions"
        model = vllm.ChatCompletionRequest if chat else vllm.CompletionRequest
        params = model.model_validate(body).to_sampling_params(
            max_tokens=body["max_tokens"], default_sampling_params={}
        )
        assert params.temperature == pytest.approx(sampling.temperature)
        assert params.top_p == pytest.approx(sampling.top_p)
        assert params.top_k == sampling.extra_body.get("top_k", 0)
        assert params.min_p == pytest.approx(sampling.extra_body.get("min_p", 0.0))
        assert params.repetition_penalty == pytest.approx(sampling.extra_body.get("repetition_penalty", 1.0))
        assert params.seed == sampling.seed
        assert list(params.stop or []) == list(sampling.stop or [])
        assert params.max_tokens == sampling.max_tokens
        if chat:
            assert (params.logprobs is not None) == sampling.logprobs
            assert not params.stop_token_ids  # the server's template, and vLLM's own eos ids
        else:  # token mode asks for 0 top alternatives just to read the sampled ids
            assert params.logprobs == (1 if sampling.logprobs else 0)
            # every stop id of the renderer that rendered the prompt, so vLLM stops where it would close
            assert set(params.stop_token_ids) == renderer_stops
        assert "truncate_prompt_tokens" not in body and "prompt_embeds" not in body
    assert seen == set(SAMPLINGS)


def test_chat_mode_sends_tools_and_the_reasoning_back_as_the_field_vllm_reads(vllm, sent):
    """Row 4: vLLM 0.33 reads an assistant message's `reasoning` (and hands the template both names)."""
    chats = [item["body"] for item in sent if item["path"] == "/v1/chat/completions"]
    assert all(body.get("tools") for body in chats)
    assistants = [m for body in chats for m in body["messages"] if m["role"] == "assistant"]
    assert assistants, "the chat rollout must have sent its first turn back"
    assert all("reasoning_content" not in m for m in assistants)
    assert any(m.get("reasoning") for m in assistants)
    request = vllm.ChatCompletionRequest.model_validate(chats[-1])
    sent_back = [m for m in request.messages if m["role"] == "assistant"]
    assert any(m.get("reasoning") for m in sent_back)


def test_every_stand_in_answer_to_those_bodies_is_a_vllm_response(vllm, sent, keyed_standin):
    with httpx.Client(base_url=keyed_standin.url, timeout=30, trust_env=False, headers=key_header()) as http:
        for item in sent:
            answer = http.post(item["path"], json=item["body"])
            assert answer.status_code == 200, answer.text
            chat = item["path"] == "/v1/chat/completions"
            model = vllm.ChatCompletionResponse if chat else vllm.CompletionResponse
            response = model.model_validate(answer.json())
            assert response.model_extra == {}
            for choice in response.choices:
                assert choice.model_extra == {}, choice.model_extra
                if chat:
                    assert choice.message.model_extra == {}, choice.message.model_extra


# ---------------------------------------------------------------------------------------- adapters


PEFT_CONFIGS = st.fixed_dictionaries(
    {
        "r": st.integers(-1, 600),
        "lora_alpha": st.integers(1, 64),
        "target_modules": st.sampled_from([["q_proj"], ["q_proj", "v_proj"], "all-linear"]),
    },
    optional={
        "bias": st.sampled_from(["none", "all", "lora_only"]),
        "modules_to_save": st.one_of(
            st.none(),
            st.lists(st.sampled_from(["classifier", "score", "lm_head", "embed_tokens"]), max_size=2),
        ),
        "use_dora": st.booleans(),
        "lora_bias": st.booleans(),
        "use_rslora": st.booleans(),
        "use_qalora": st.booleans(),
        "init_lora_weights": st.one_of(
            st.booleans(),
            st.sampled_from(
                ["gaussian", "EVA", "orthogonal", "mica", "lora_ga", "pissa", "olora", "loftq", "corda"]
            ),
        ),
        "alora_invocation_tokens": st.one_of(st.none(), st.lists(st.integers(0, 99), max_size=2)),
        "layer_replication": st.one_of(st.none(), st.just([[0, 2]])),
        "use_bdlora": st.one_of(st.none(), st.just({}), st.just({"blocks": 2})),
        "rank_pattern": st.dictionaries(
            st.sampled_from(["q_proj", "v_proj"]), st.integers(-1, 600), max_size=2
        ),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    config=PEFT_CONFIGS,
    max_rank=st.sampled_from(VLLM_LORA_RANKS),
    drop=st.sampled_from([None, "r", "lora_alpha"]),
)
def test_an_adapter_config_publish_accepts_is_exactly_one_vllms_peft_helper_accepts(
    vllm, config, max_rank, drop
):
    if drop is not None:
        config = {k: v for k, v in config.items() if k != drop}
    ours = adapter_problems(config, None, AdapterLimits(max_lora_rank=max_rank))
    try:
        vllm.PEFTHelper.from_dict(dict(config)).validate_legal(vllm.LoRAConfig(max_lora_rank=max_rank))
        theirs = None
    except ValueError as exc:
        theirs = str(exc)
    assert (ours == []) == (theirs is None), (config, ours, theirs)


def test_a_refused_and_a_missing_adapter_get_vllm_0_33s_statuses(keyed_standin, tmp_path):
    """Row 11, read against 0.33.0 (`openai/models/serving.py`): whatever the loader raises is a 500
    `InternalServerError` with its message, except a missing adapter, a 404 `NotFoundError` with
    `LoRAAdapterNotFoundError`'s message (a 400 is only for the request's own checks)."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "use_dora": True})
    )
    (bad / "adapter_model.bin").write_bytes(b"")
    with httpx.Client(base_url=keyed_standin.url, timeout=10, trust_env=False, headers=key_header()) as http:
        missing = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "gone")}
        )
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
        incomplete = http.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": str(bad)})
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": str(LoRAAdapterNotFoundError("gone", str(tmp_path / "gone"))),
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    assert refused.status_code == 500 and refused.json()["error"]["type"] == "InternalServerError"
    assert "DoRA" in refused.json()["error"]["message"]
    assert incomplete.status_code == 400 and incomplete.json()["error"]["type"] == "InvalidUserInput"


# ------------------------------------------------------------------------------------ weight updates


NCCL_INFOS = [
    {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]},
    {"names": [], "dtype_names": [], "shapes": []},
    {},
    {"names": ["a"]},
    {"names": ["a", "b"], "dtype_names": ["bfloat16"], "shapes": [[2], [3]]},
    {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]], "packed": True},
]
NCCL_INITS = [
    {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2},
    {"nccl_unique_id_b64": base64.b64encode(bytes(128)).decode(), "rank_offset": 1, "world_size": 2},
    {"nccl_unique_id_b64": "not base64!", "rank_offset": 1, "world_size": 2},
    {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 2},
    {"master_address": "10.0.0.1", "rank_offset": 1, "world_size": 2},
    {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "extra": 1},
]


def _accepts(factory: Any, payload: dict) -> bool:
    try:
        factory(**payload)
    except (TypeError, ValueError):
        return False
    return True


def test_nccl_payloads_are_checked_exactly_as_vllms_transfer_engine_checks_them(vllm):
    """Row 2: what `update_info_problems` / `init_info_problems` (the plane before pausing, the stand-in at
    its routes) accept is what vLLM 0.33's NCCL dataclasses accept."""
    from rollout_actors.policy.weights import init_info_problems, update_info_problems

    for info in NCCL_INFOS:
        assert (update_info_problems("nccl", info) == []) == _accepts(vllm.NCCLUpdate, info), info
    for init in NCCL_INITS:
        assert (init_info_problems("nccl", init) == []) == _accepts(vllm.NCCLInit, init), init


# ------------------------------------------------------------------------------------------- parsers


CANNED_TURNS = [
    "<think>\nLet me compute 17 * 23.\n</think>\n\nThe answer is 436.",
    "<think>\nUse the tool.\n</think>\n\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>',
    "No thinking at all.",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>',
    'Let me check. <tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>',
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3"}}\n</tool_call>',
    "<think>\nunclosed reasoning that never ends",
    "<think>\n\n</think>\n\nEmpty thoughts.",
    # hermes' regex also takes an unclosed final call running to the end of the text
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +',
    '<think>\nCall it.\n</think>\n\nSure. <tool_call>\n{"name": "calculator", "arguments": {"expression": "4"}}',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3"}}',
    '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call> and then <tool_call>',
    '<tool_call>\n{"name": "calculator"}\n</tool_call>',
    '<tool_call>\n["calculator", {}]\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": "not an object"}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"s": "\\u00e9t\\u00e9 \\ud83d\\ude00"}}\n</tool_call>',
]
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def qwen3_parsers(vllm):
    """vLLM's hermes tool parser and qwen3 reasoning parser over the bundled Qwen3 tokenizer."""
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(bundled_tokenizer_dir()))
    request = vllm.ChatCompletionRequest.model_validate(
        {"model": BUNDLED_MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [CALC_TOOL]}
    )
    reasoning = vllm.reasoning_parsers.get_reasoning_parser("qwen3")(tokenizer)
    tools = vllm.tool_parsers.get_tool_parser("hermes")(tokenizer, request.tools)
    return reasoning, tools, request


@pytest.mark.parametrize("text", CANNED_TURNS)
def test_the_stand_in_parses_a_turn_as_vllms_qwen3_and_hermes_parsers_do(qwen3_parsers, text):
    """The family the stand-in serves (the bundled tokenizer is Qwen3's; `ServerSpec` gives it hermes +
    qwen3, and the stand-in refuses other parsers): its parse equals vLLM's on the same text."""
    reasoning_parser, tool_parser, request = qwen3_parsers
    reasoning, content = reasoning_parser.extract_reasoning(text, request)
    calls: list[tuple[str, Any]] = []
    if content is not None:
        extracted = tool_parser.extract_tool_calls(content, request)
        if extracted.tools_called:
            calls = [(c.function.name, c.function.arguments) for c in extracted.tool_calls]
            content = extracted.content
    ours = parse_turn(text, parse_tools=True, parse_reasoning=True)
    our_calls = [(c.function.name, c.function.arguments) for c in ours.tool_calls]  # the text, byte for byte
    assert (ours.reasoning, ours.content or None, our_calls) == (reasoning, content or None, calls)


def test_every_parser_the_family_table_names_is_registered_in_vllm(vllm):
    tools, reasonings = vllm.tool_parsers.list_registered(), vllm.reasoning_parsers.list_registered()
    for key, family in MODEL_FAMILIES.items():
        assert family.tool_call_parser is None or family.tool_call_parser in tools, key
        assert family.reasoning_parser is None or family.reasoning_parser in reasonings, key


# ------------------------------------------------------------------------------------------ README


def _vllm_sections() -> str:
    """docs/cluster.md from its inference servers on, and docs/orchestrator.md's policy publication."""
    cluster = (ROOT / "docs" / "cluster.md").read_text()
    orchestrator = (ROOT / "docs" / "orchestrator.md").read_text()
    return (
        cluster[cluster.index("## Inference servers as supervised actors") :]
        + orchestrator[orchestrator.index("## Publishing a new policy (LoRA)") :]
    )


def test_every_flag_and_route_the_readme_names_for_vllm_is_vllms(vllm, real_app):
    """Item 4: the docs' vLLM sections state only what these tests check."""
    section = _vllm_sections()
    options = set(vllm.parser._option_string_actions)
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", section))
    assert flags and flags <= options, flags - options
    routes = {m.group(1) for m in re.finditer(r"`(?:POST |GET )?(/[a-z0-9_/]+)", section)}
    routes -= {"/shared/adapters"}  # a storage path in an example, not a route
    routes -= {"/v1", "/v2", "/inference", "/cohere"}  # the prefixes the key guards (checked above)
    missing = {r for r in routes if r not in real_app.paths}
    assert routes and not missing, missing
    assert "vllm>=0.33" in section and "0.33" in section
