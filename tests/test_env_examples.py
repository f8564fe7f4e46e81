"""The bundled environments, in-process (no Ray): phrasing contracts, rewards, tools, caller errors."""

from __future__ import annotations

import json
import re

import pytest
from waiting import runner

from env_actors.examples import generate_math
from env_actors.examples.answers import last_boxed, parse_number
from env_actors.examples.calculator_env import CALCULATOR_TOOL, CalculatorEnv, evaluate
from env_actors.examples.math_env import MathEnv
from env_actors.examples.sandbox_env import SandboxEnv
from env_actors.interface import tool_arguments
from rollout_actors.wire import CallerError

OPERATION = re.compile(
    r"(?P<who>\w+) (?:(?P<plus>buys|finds|receives) (?P<a>\d+) more|(?P<minus>gives away|sells|loses) (?P<b>\d+)"
    r"|multiplies them by (?P<c>\d+))\."
)


run = runner(10)


async def loaded(env):
    await env.load()
    return env


def assistant(content=None, tool_calls=None):
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def calculator_call(expression, call_id="call-1", as_dict=False):
    arguments = {"expression": expression} if as_dict else json.dumps({"expression": expression})
    return {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}


# ------------------------------------------------------------------------------------------- MathEnv


def test_math_problems_follow_the_published_phrasing_and_their_answers_are_exact():
    env = run(loaded(MathEnv()))
    assert env.num_tasks() >= 200
    for index in range(env.num_tasks()):
        task = env.task(index)
        sentences = task["question"].split(". ")
        start = re.fullmatch(r"(\w+) has (\d+) (\w+)", sentences[0])
        assert start, task
        name, quantity, noun = start.group(1), int(start.group(2)), start.group(3)
        body = task["question"][len(sentences[0]) + 2 :]
        ops = list(OPERATION.finditer(body))
        assert 1 <= len(ops) <= 3, task
        for op in ops:
            assert op.group("who") == name
            if op.group("plus"):
                quantity += int(op.group("a"))
            elif op.group("minus"):
                quantity -= int(op.group("b"))
            else:
                quantity *= int(op.group("c"))
            assert quantity >= 0
        assert body[ops[-1].end() :] == f" How many {noun} does {name} have now?"
        assert quantity == task["answer"]


def test_bundled_math_file_is_what_the_generator_writes():
    assert generate_math.main(["--check"]) == 0
    assert generate_math.generate() == generate_math.generate()


def test_math_reward_is_one_only_for_the_exact_last_boxed_answer():
    env = run(loaded(MathEnv()))

    def score(content):
        async def episode():
            start = await env.reset(env.task(0))
            out = await env.step(start.state, assistant(content))
            assert out.done and out.messages == []
            return await env.score(start.state)

        return run(episode())

    answer = env.task(0)["answer"]
    right = score(f"Work... so \\boxed{{{answer}}}")
    assert right.reward == 1.0 and right.components == {"correct": 1.0, "format": 1.0}
    assert score(f"\\boxed{{{answer}}} no wait \\boxed{{{answer + 1}}}").reward == 0.0
    unboxed = score(f"The answer is {answer}.")
    assert unboxed.reward == 0.0 and unboxed.components["format"] == 0.0


def test_math_opening_messages_ask_for_a_boxed_answer():
    env = run(loaded(MathEnv()))
    start = run(env.reset(env.task(3)))
    assert [m["role"] for m in start.messages] == ["system", "user"]
    assert start.messages[-1]["content"].endswith("Put your final answer in \\boxed{}.")
    assert start.tools is None


def test_math_caller_mistakes_raise_caller_error():
    env = run(loaded(MathEnv()))
    with pytest.raises(CallerError):
        env.task(env.num_tasks())
    with pytest.raises(CallerError):
        run(env.reset({"question": "no answer"}))
    start = run(env.reset(env.task(0)))
    run(env.step(start.state, assistant("\\boxed{1}")))
    with pytest.raises(CallerError):
        run(env.step(start.state, assistant("again")))


def test_boxed_answers_nest_and_numbers_parse_exactly():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{7} and an unclosed \\boxed{8") == "7"
    assert last_boxed("nothing") is None
    assert parse_number(" 1,024 ") == 1024 and parse_number("$42$") == 42
    assert parse_number("42 marbles") is None


# ------------------------------------------------------------------------------------- CalculatorEnv


def test_calculator_episode_with_a_tool_call_then_a_boxed_answer_scores_one():
    async def episode():
        env = await loaded(CalculatorEnv(seed=1, max_turns=4))
        task = env.task(0)
        start = await env.reset(task)
        assert start.tools == [CALCULATOR_TOOL]
        assert start.messages[-1]["content"].startswith(
            f"Compute {task['expression']} using the calculator tool"
        )
        first = await env.step(start.state, assistant(None, [calculator_call(task["expression"], "c7")]))
        assert not first.done
        assert first.messages == [{"role": "tool", "tool_call_id": "c7", "content": str(task["answer"])}]
        final = await env.step(start.state, assistant(f"\\boxed{{{task['answer']}}}"))
        assert final.done and final.messages == []
        return await env.score(start.state)

    score = run(episode())
    assert score.reward == 1.0 and score.components == {"correct": 1.0, "used_tool": 1.0}


def test_calculator_answer_without_the_tool_scores_zero_even_when_right():
    async def episode():
        env = await loaded(CalculatorEnv())
        task = env.task(5)
        start = await env.reset(task)
        await env.step(start.state, assistant(f"\\boxed{{{task['answer']}}}"))
        return await env.score(start.state)

    score = run(episode())
    assert score.reward == 0.0 and score.components == {"correct": 1.0, "used_tool": 0.0}


def test_calculator_tool_errors_are_answers_and_max_turns_ends_the_episode():
    async def episode():
        env = await loaded(CalculatorEnv(max_turns=2))
        start = await env.reset(env.task(0))
        bad = {"id": "x", "type": "function", "function": {"name": "shell", "arguments": "{}"}}
        out = await env.step(start.state, assistant(None, [bad, calculator_call("__import__('os')", "y")]))
        assert [m["content"].startswith("error:") for m in out.messages] == [True, True]
        assert not out.done
        out = await env.step(start.state, assistant(None, [calculator_call("2 + 2", "z", as_dict=True)]))
        assert out.messages[0]["content"] == "4" and out.done
        with pytest.raises(CallerError):
            await env.step(start.state, assistant("late"))
        return await env.score(start.state)

    score = run(episode())
    assert score.reward == 0.0 and score.metrics["tool_errors"] == 2


def test_calculator_tasks_are_deterministic_per_seed():
    a, b, c = (run(loaded(CalculatorEnv(seed=s, num_tasks=50))) for s in (3, 3, 4))
    assert [a.task(i) for i in range(50)] == [b.task(i) for i in range(50)]
    assert [a.task(i) for i in range(50)] != [c.task(i) for i in range(50)]
    assert all(evaluate(a.task(i)["expression"]) == a.task(i)["answer"] for i in range(50))


@pytest.mark.parametrize(
    "expression", ["__import__('os').system('true')", "x + 1", "9 ** 9 ** 9", "1 / 0", "(1).real", "[1] * 9"]
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_calculator_arithmetic():
    assert evaluate("(17 * 23) + 45") == 436
    assert evaluate("7 / 2") == 3.5 and evaluate("8 / 2") == 4 and evaluate("-(2 ** 3) % 5") == 2


def test_tool_arguments_accept_json_strings_and_dicts():
    assert tool_arguments({"function": {"arguments": '{"expression": "1+1"}'}}) == {"expression": "1+1"}
    assert tool_arguments({"function": {"arguments": {"expression": "1"}}}) == {"expression": "1"}
    with pytest.raises(ValueError):
        tool_arguments({"function": {"arguments": "{not json"}})


def test_sandbox_episode_takes_exactly_its_turns_each_step_waiting_on_the_sandbox():
    async def episode():
        env = await loaded(SandboxEnv(num_tasks=4, turns=3, step_wait_s=0.01))
        reset = await env.reset(env.task(2))
        assert "Task 2" in reset.messages[0]["content"]
        outs = [await env.step(reset.state, assistant("ls")) for _ in range(3)]
        with pytest.raises(CallerError):
            await env.step(reset.state, assistant("ls"))
        return outs, await env.score(reset.state)

    outs, score = run(episode())
    assert [out.done for out in outs] == [False, False, True]
    assert [len(out.messages) for out in outs] == [1, 1, 0]
    assert outs[0].messages[0]["role"] == "user"
    assert score.reward == 1.0


def test_sandbox_refuses_a_wait_or_turn_count_out_of_bounds():
    for config in ({"turns": 0}, {"step_wait_s": -1.0}, {"step_wait_s": 3600.0}):
        with pytest.raises(CallerError):
            SandboxEnv(**config)
