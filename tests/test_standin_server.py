"""The stand-in inference server as a real process, spoken to with the real `openai` SDK.

Behaviour per request comes from `X-Standin-*` headers on the one session-wide server (`standin` fixture).
Every async scenario runs under its own deadline, so a server that hangs fails the test instead of the
suite.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from waiting import runner

from renderer_actors.tokenizer import BUNDLED_MODEL, load_tokenizer
from rollout_actors.inference.standin import StandinOptions, StandinServer, StandinStartupError
from rollout_actors.inference.standin.policy import RFIND_CHUNK, PolicyConfig, ScriptedPolicy, _rfind

DEADLINE_S = 20
IM_END = 151645
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
MATH_QUESTION = (
    "Ava has 12 marbles. Later that day, Ava buys 3 more. Ava gives away 5. Ava multiplies them by 2. "
    "How many marbles does Ava have now? Put your final answer in \\boxed{}."
)
MATH_ANSWER = 20
CALC_SYSTEM = {"role": "system", "content": "Use the calculator tool for arithmetic."}
CALC_USER = {"role": "user", "content": "Compute (17 * 23) + 45 using the calculator tool."}
CALC_ANSWER = 17 * 23 + 45


run = runner(DEADLINE_S)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL)


def render(tokenizer, messages, tools=None, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_bundled_tokenizer_loads_as_the_generic_hugging_face_loader_gives_it(tokenizer):
    """`load_tokenizer` builds the bundled tokenizer straight from its files (a faster start for every
    stand-in): the same class, vocabulary, special tokens, template and settings as `AutoTokenizer`."""
    from transformers import AutoTokenizer

    from renderer_actors.tokenizer import bundled_tokenizer_dir

    generic = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    messages = [CALC_SYSTEM, CALC_USER, {"role": "assistant", "content": "<think>x</think>ok"}]
    text = "Hello 123 <|im_start|> wörld </tool_call>\n"
    for loaded in (tokenizer, generic):
        assert type(loaded) is type(generic)
    assert tokenizer.get_vocab() == generic.get_vocab() and len(tokenizer) == len(generic)
    assert tokenizer.added_tokens_decoder == generic.added_tokens_decoder
    assert tokenizer.all_special_ids == generic.all_special_ids
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (generic.eos_token_id, generic.pad_token_id)
    assert (tokenizer.model_max_length, tokenizer.clean_up_tokenization_spaces) == (
        generic.model_max_length,
        generic.clean_up_tokenization_spaces,
    )
    assert tokenizer.encode(text) == generic.encode(text)
    ids = list(range(151640, 151669))
    assert tokenizer.decode(ids) == generic.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == generic.decode(ids, skip_special_tokens=True)
    assert render(tokenizer, messages, [CALCULATOR_TOOL]) == render(generic, messages, [CALCULATOR_TOOL])


def client(server: StandinServer, timeout: float = 10.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=timeout)


async def complete(server, prompt_ids, headers=None, **kwargs):
    async with client(server) as c:
        kwargs.setdefault("max_tokens", 256)
        return await c.completions.create(
            model=BUNDLED_MODEL,
            prompt=prompt_ids,
            extra_body={"return_token_ids": True},
            extra_headers=headers or {},
            **kwargs,
        )


def boxed(text: str) -> int:
    return int(re.findall(r"\\boxed\{(-?\d+)\}", text)[-1])


def get(server: StandinServer, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=5) as response:
        return response.read().decode()


# ------------------------------------------------------------------------------------- token mode


def test_token_completion_returns_sampled_ids_with_aligned_logprobs(standin, tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Tell me about rivers."}])
    response = run(complete(standin, prompt, logprobs=1, seed=3))
    choice = response.choices[0]
    extra = choice.model_extra
    ids = extra["token_ids"]
    assert extra["prompt_token_ids"] == prompt
    assert choice.finish_reason == "stop" and ids[-1] == IM_END  # vLLM keeps the EOS id in token_ids
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) == len(ids)
    assert all(lp < 0 for lp in choice.logprobs.token_logprobs)
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == len(ids)


def test_max_tokens_cut_ends_with_length_and_no_close_token(standin, tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Tell me about rivers."}])
    choice = run(complete(standin, prompt, max_tokens=4, logprobs=0, seed=3)).choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.model_extra["token_ids"]) == 4 and IM_END not in choice.model_extra["token_ids"]
    assert len(choice.logprobs.token_logprobs) == 4


def test_stop_string_ends_the_turn_where_vllm_would(standin, tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": MATH_QUESTION}])
    headers = {"X-Standin-Think-Rate": "0"}
    choice = run(complete(standin, prompt, stop=["boxed"], seed=1, headers=headers)).choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "boxed"
    assert choice.text.endswith("\\") and "boxed" not in choice.text


def test_same_seed_same_completion_and_another_seed_differs(standin, tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Write a poem."}])

    async def three():
        return await asyncio.gather(*(complete(standin, prompt, seed=s, logprobs=1) for s in (5, 5, 6)))

    first, again, other = (r.choices[0] for r in run(three()))
    assert first.model_extra["token_ids"] == again.model_extra["token_ids"]
    assert first.logprobs.token_logprobs == again.logprobs.token_logprobs
    assert first.model_extra["token_ids"] != other.model_extra["token_ids"]


def test_math_problem_is_solved_at_correct_rate_one_and_missed_at_zero(standin, tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": MATH_QUESTION}])

    async def both():
        right = complete(standin, prompt, seed=9, headers={"X-Standin-Correct-Rate": "1"})
        wrong = complete(standin, prompt, seed=9, headers={"X-Standin-Correct-Rate": "0"})
        return await asyncio.gather(right, wrong)

    right, wrong = (r.choices[0].text for r in run(both()))
    assert boxed(right) == MATH_ANSWER
    assert boxed(wrong) != MATH_ANSWER


def test_calculator_in_token_mode_calls_the_tool_then_answers(standin, tokenizer):
    messages = [CALC_SYSTEM, CALC_USER]
    first = run(complete(standin, render(tokenizer, messages, tools=[CALCULATOR_TOOL]), seed=2)).choices[0]
    call = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", first.text).group(1))
    assert call == {"name": "calculator", "arguments": {"expression": "(17 * 23) + 45"}}

    assistant = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    tool = {"role": "tool", "content": str(CALC_ANSWER)}
    prompt = render(tokenizer, [*messages, assistant, tool], tools=[CALCULATOR_TOOL])
    right = run(complete(standin, prompt, seed=2, headers={"X-Standin-Correct-Rate": "1"})).choices[0]
    wrong = run(complete(standin, prompt, seed=2, headers={"X-Standin-Correct-Rate": "0"})).choices[0]
    assert boxed(right.text) == CALC_ANSWER and "<tool_call>" not in right.text
    assert boxed(wrong.text) != CALC_ANSWER


def test_last_user_request_is_found_behind_long_tool_responses(tokenizer):
    # An agentic trajectory: one question, then many long tool responses (each rendered as a user message
    # starting with <tool_response>). The policy must still find the question, judging each message on the
    # way back by its head: decoding every tool response on every call grew with the whole context.
    policy = ScriptedPolicy(tokenizer, PolicyConfig(seed=0))
    question = {"role": "user", "content": "What is (17 * 23) + 45?"}
    messages = [CALC_SYSTEM, question]
    for turn in range(6):
        call = {"name": "calculator", "arguments": {"expression": f"{turn} + 1"}}
        messages.append(
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
        )
        messages.append({"role": "tool", "content": " ".join(["output"] * (RFIND_CHUNK + 100))})
    prompt = render(tokenizer, messages, tools=[CALCULATOR_TOOL])
    assert len(prompt) > 6 * RFIND_CHUNK
    assert policy.read_prompt(prompt).last_user == question["content"]


def test_rfind_searches_backwards_across_chunks():
    ids = [7] + [1] * (3 * RFIND_CHUNK) + [7] + [2] * 5
    assert _rfind(ids, 7, len(ids)) == 3 * RFIND_CHUNK + 1
    assert _rfind(ids, 7, 3 * RFIND_CHUNK + 1) == 0
    assert _rfind(ids, 7, 0) == -1 and _rfind(ids, 9, len(ids)) == -1
    assert _rfind(ids, 2, len(ids) - 2) == len(ids) - 3


def test_noncanonical_emission_differs_from_re_encoding_the_text(standin, tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Describe json."}])
    choice = run(complete(standin, prompt, seed=4, headers={"X-Standin-Noncanonical-Rate": "1"})).choices[0]
    ids = choice.model_extra["token_ids"]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) != ids
    canonical = run(complete(standin, prompt, seed=4)).choices[0]
    assert canonical.text == choice.text  # same words, spelled with other ids


# -------------------------------------------------------------------------------------- chat mode


def test_chat_returns_tool_calls_reasoning_and_token_ids_in_vllm_fields(standin, tokenizer):
    async def call():
        async with client(standin) as c:
            return await c.chat.completions.create(
                model=BUNDLED_MODEL,
                messages=[CALC_SYSTEM, CALC_USER],
                tools=[CALCULATOR_TOOL],
                logprobs=True,
                max_tokens=256,
                seed=1,
                extra_body={"return_token_ids": True},
                extra_headers={"X-Standin-Think-Rate": "1"},
            )

    response = run(call())
    choice, message = response.choices[0], response.choices[0].message
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = message.tool_calls
    assert tool_call.function.name == "calculator"
    assert json.loads(tool_call.function.arguments) == {"expression": "(17 * 23) + 45"}
    # vLLM 0.33 keeps the newlines around the reasoning (only the tags go)
    assert message.model_extra["reasoning"].strip("\n").startswith("I should use the calculator")
    assert "reasoning_content" not in message.model_extra
    ids = choice.model_extra["token_ids"]
    prompt = response.model_extra["prompt_token_ids"]
    assert prompt == render(tokenizer, [CALC_SYSTEM, CALC_USER], tools=[CALCULATOR_TOOL])
    assert len(choice.logprobs.content) == len(ids) and ids[-1] == IM_END
    assert "".join(item.token for item in choice.logprobs.content[:-1]) == tokenizer.decode(ids[:-1])


def test_chat_answer_after_tool_response_follows_correct_rate(standin):
    call = {"id": "call-1", "type": "function"}
    call["function"] = {"name": "calculator", "arguments": '{"expression": "(17 * 23) + 45"}'}
    messages = [
        CALC_SYSTEM,
        CALC_USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": str(CALC_ANSWER)},
    ]

    async def answer(rate: str):
        async with client(standin) as c:
            return await c.chat.completions.create(
                model=BUNDLED_MODEL,
                messages=messages,
                tools=[CALCULATOR_TOOL],
                seed=1,
                extra_headers={"X-Standin-Correct-Rate": rate},
            )

    right, wrong = run(answer("1")).choices[0], run(answer("0")).choices[0]
    assert right.finish_reason == "stop" and not right.message.tool_calls
    assert boxed(right.message.content) == CALC_ANSWER
    assert boxed(wrong.message.content) != CALC_ANSWER


def test_chat_with_thinking_disabled_has_no_reasoning(standin):
    async def call():
        async with client(standin) as c:
            return await c.chat.completions.create(
                model=BUNDLED_MODEL,
                messages=[{"role": "user", "content": MATH_QUESTION}],
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                extra_headers={"X-Standin-Think-Rate": "1", "X-Standin-Correct-Rate": "1"},
            )

    message = run(call()).choices[0].message
    assert message.model_extra["reasoning"] is None and "<think>" not in message.content
    assert boxed(message.content) == MATH_ANSWER


# ------------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("500", openai.InternalServerError),
        ("timeout", openai.APITimeoutError),
        ("drop", openai.APIConnectionError),
    ],
)
def test_each_fault_reaches_the_openai_client_as_its_error(standin, fault, expected):
    async def call():
        async with client(standin, timeout=1.0) as c:
            await c.completions.create(
                model=BUNDLED_MODEL, prompt=[1, 2, 3], extra_headers={"X-Standin-Fault": fault}
            )

    with pytest.raises(expected) as info:
        run(call())
    if fault == "500":
        assert info.value.status_code == 500 and info.value.body["type"] == "InternalServerError"


def test_bad_steering_header_is_a_400_in_vllm_error_shape(standin):
    with pytest.raises(openai.BadRequestError) as info:
        run(complete(standin, [1, 2, 3], headers={"X-Standin-Fault": "explode"}))
    assert info.value.body["type"] == "BadRequestError" and "X-Standin-Fault" in info.value.body["message"]


def test_malformed_fault_is_a_200_without_the_schema(standin):
    async def call():
        async with client(standin) as c:
            return await c.completions.create(
                model=BUNDLED_MODEL, prompt=[1, 2, 3], extra_headers={"X-Standin-Fault": "malformed"}
            )

    response = run(call())
    assert getattr(response, "choices", None) is None  # what the caller's validation must notice


def test_server_wide_faults_set_live_and_counted_in_metrics(standin):
    def set_faults(body: dict) -> dict:
        request = urllib.request.Request(
            standin.url + "/admin/faults", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def injected_500() -> int:
        return int(
            re.search(r'standin_faults_injected_total\{kind="500"\} (\d+)', get(standin, "/metrics")).group(1)
        )

    before = injected_500()
    assert set_faults({"fault_rate": 1.0, "fault": "500"}) == {"fault_rate": 1.0, "fault": "500"}
    try:
        with pytest.raises(openai.InternalServerError):
            run(complete(standin, [1, 2, 3], max_tokens=2))
        ok = run(complete(standin, [1, 2, 3], max_tokens=2, headers={"X-Standin-Fault": "none"}))
        assert ok.choices[0].model_extra["token_ids"]
    finally:
        set_faults({"fault_rate": 0.0, "fault": "500"})
    assert injected_500() == before + 1
    run(complete(standin, [1, 2, 3], max_tokens=2))


# ---------------------------------------------------------------------------- models, LoRA, health


def write_adapter_dir(path, rank: int = 8, modules=("q_proj",), **config) -> str:
    """A PEFT adapter directory vLLM's loader accepts (unless `config` or the arguments say otherwise)."""
    import numpy as np
    from safetensors.numpy import save_file

    from rollout_actors.policy.lora import lora_config

    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": np.zeros((rank, rank), np.float32)
        for m in modules
        for ab in "AB"
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(lora_config(rank, 2 * rank, list(modules), **config))
    )
    return str(path)


def test_lora_adapter_load_serve_unload(standin, tmp_path):
    adapter = tmp_path / "adapter"
    write_adapter_dir(adapter)

    async def scenario():
        async with client(standin) as c:
            load = {"lora_name": "policy-v1", "lora_path": str(adapter)}
            missing = {"lora_name": "nope", "lora_path": str(tmp_path / "missing")}
            await c.post("/load_lora_adapter", body=load, cast_to=str)
            with pytest.raises(openai.NotFoundError):
                await c.post("/load_lora_adapter", body=missing, cast_to=str)
            served = [m.id async for m in c.models.list()]
            answer = await c.completions.create(model="policy-v1", prompt=[1, 2, 3], max_tokens=2)
            await c.post("/unload_lora_adapter", body={"lora_name": "policy-v1"}, cast_to=str)
            with pytest.raises(openai.NotFoundError) as gone:
                await c.completions.create(model="policy-v1", prompt=[1, 2, 3], max_tokens=2)
            return served, answer, gone.value

    served, answer, gone = run(scenario())
    assert served == [BUNDLED_MODEL, "policy-v1"]
    assert answer.model == "policy-v1"
    assert gone.status_code == 404 and gone.body["type"] == "NotFoundError"


def test_sessions_are_counted_per_x_session_id(standin):
    run(complete(standin, [1, 2, 3], max_tokens=1, headers={"X-Session-ID": "rollout-a"}))
    run(complete(standin, [1, 2, 3], max_tokens=1, headers={"X-Session-ID": "rollout-a"}))
    assert standin.session_counts()["rollout-a"] == 2
    assert re.search(r"^standin_sessions [1-9]", get(standin, "/metrics"), re.MULTILINE)


def test_admin_routes_are_off_unless_asked_for():
    with StandinServer() as server:
        for path in ("/admin/faults", "/admin/sessions"):
            with pytest.raises(urllib.error.HTTPError) as info:
                get(server, path)
            assert info.value.code == 404


def test_health_answers_200_only_once_loaded(tmp_path):
    port_file = tmp_path / "port"
    command = [sys.executable, "-m", "rollout_actors.inference.standin", "--port", "0"]
    command += ["--port-file", str(port_file), "--startup-delay-s", "0.5"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not port_file.exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        statuses = []
        while not statuses or statuses[-1] != 200:
            assert time.monotonic() < deadline, statuses
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    statuses.append(response.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
            except (urllib.error.URLError, TimeoutError):
                pass  # not listening yet, or the loop is busy loading on a loaded machine
            time.sleep(0.05)
        assert statuses[0] == 503 and set(statuses) == {503, 200}
    finally:
        process.terminate()
        process.wait(10)


def test_startup_failure_raises_with_exit_code_and_log_tail():
    server = StandinServer(StandinOptions(model="/nonexistent/tokenizer-dir"), ready_timeout_s=DEADLINE_S)
    with pytest.raises(StandinStartupError) as info:
        server.start()
    assert info.value.exit_code == 1
    assert "nonexistent" in info.value.log_tail
    assert server.pid is None  # stopped, nothing left behind
