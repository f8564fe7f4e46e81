"""`CalculatorEnv`: multi-turn arithmetic with one tool, `calculator(expression: str)`.

    Ref("env_actors.examples.calculator_env:CalculatorEnv", {"seed": 0, "num_tasks": 300, "max_turns": 4})

The user asks to compute an expression such as `(17 * 23) + 45` using the calculator tool. An assistant
message with `tool_calls` is answered with one `{"role": "tool", "tool_call_id": ..., "content": "<value>"}`
message per call and the episode continues; an assistant message without tool calls is the final answer and
ends it (so does reaching `max_turns`). Reward is 1.0 iff the final answer's last `\\boxed{...}` equals the
value AND the calculator was used successfully at least once, so a good episode takes two model turns.
Components: `correct`, `used_tool`.
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from typing import Any

from env_actors.examples.answers import boxed_equals, content_text
from env_actors.interface import Environment, Message, Reset, ScoreOut, StepOut, check_index, tool_arguments
from rollout_actors.kernel import CallerError

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic; do not compute by hand."
TOOL_NAME = "calculator"
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 * 23) + 45"}},
            "required": ["expression"],
        },
    },
}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30
"""Bounds what one tool call may compute: `9**9**9` must be refused, not evaluated."""
MAX_EXPONENT = 64

_FORMS = (
    "({a} * {b}) + {c}",
    "({a} + {b}) * {c}",
    "{a} * {b} - {c}",
    "{a} * ({b} + {c})",
    "({a} - {b}) * {c}",
)


def evaluate(expression: str) -> int | float:
    """Safely evaluate arithmetic: numbers, + - * / // % **, unary +/-, parentheses. Nothing else parses.

    Raises `ValueError` with a reason fit to show the model.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return _eval(tree.body)


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large or not a real number")
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int):
            return int(value) if left % right == 0 else value
        return value
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def format_value(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


@dataclass
class _Episode:
    task: dict[str, Any]
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    final_text: str | None = None
    done: bool = False


class CalculatorEnv(Environment):
    """Compute an expression with the calculator tool, then answer in `\\boxed{}`."""

    def __init__(
        self, seed: int = 0, num_tasks: int = 300, max_turns: int = 4, system_prompt: str = SYSTEM_PROMPT
    ):
        if max_turns < 1 or num_tasks < 1:
            raise CallerError("CalculatorEnv needs num_tasks >= 1 and max_turns >= 1")
        self.seed, self.count, self.max_turns, self.system_prompt = seed, num_tasks, max_turns, system_prompt
        self._tasks: list[dict[str, Any]] = []

    async def load(self) -> None:
        rng = random.Random(self.seed)
        for i in range(self.count):
            form = rng.choice(_FORMS)
            a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 99)
            if form.startswith("({a} - {b})") and a < b:
                a, b = b, a
            expression = form.format(a=a, b=b, c=c)
            self._tasks.append(
                {"id": f"calc-{i:04d}", "expression": expression, "answer": evaluate(expression)}
            )

    def num_tasks(self) -> int:
        return len(self._tasks)

    def task(self, index: int) -> dict[str, Any]:
        return dict(self._tasks[check_index(index, len(self._tasks))])

    async def reset(self, task: dict[str, Any]) -> Reset:
        if not isinstance(task, dict) or not isinstance(task.get("expression"), str):
            raise CallerError("a CalculatorEnv task is a dict with an 'expression' string")
        try:
            answer = evaluate(task["expression"])
        except ValueError as exc:
            raise CallerError(f"task expression {task['expression']!r} does not evaluate: {exc}") from None
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append(
            {
                "role": "user",
                "content": f"Compute {task['expression']} using the calculator tool. "
                "Put your final answer in \\boxed{}.",
            }
        )
        return Reset(
            messages=messages, state=_Episode(task={**task, "answer": answer}), tools=[CALCULATOR_TOOL]
        )

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if state.done:
            raise CallerError("the episode is already over")
        state.turns += 1
        calls = assistant_message.get("tool_calls") or []
        if not calls:
            state.final_text = content_text(assistant_message)
            state.done = True
            return StepOut(messages=[], done=True)
        replies = [self._answer(state, call) for call in calls]
        state.done = state.turns >= self.max_turns
        return StepOut(messages=replies, done=state.done)

    def _answer(self, state: _Episode, call: dict[str, Any]) -> Message:
        name = (call.get("function") or {}).get("name")
        try:
            if name != TOOL_NAME:
                raise ValueError(f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}")
            expression = tool_arguments(call).get("expression")
            if not isinstance(expression, str):
                raise ValueError("missing string argument 'expression'")
            content = format_value(evaluate(expression))
            state.tool_calls += 1
        except ValueError as exc:
            state.tool_errors += 1
            content = f"error: {exc}"
        return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}

    async def score(self, state: _Episode) -> ScoreOut:
        correct, formatted = boxed_equals(state.final_text or "", state.task["answer"])
        used_tool = state.tool_calls > 0
        return ScoreOut(
            reward=1.0 if correct and used_tool else 0.0,
            components={"correct": float(correct), "used_tool": float(used_tool)},
            metrics={
                "turns": state.turns,
                "tool_calls": state.tool_calls,
                "tool_errors": state.tool_errors,
                "format": formatted,
            },
        )
