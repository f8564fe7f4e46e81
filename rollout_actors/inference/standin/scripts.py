"""What the stand-in policy says, as text: the scripted behaviours for the bundled environments.

- Math word problems ("Ava has 12 marbles. She buys 3 more. ... How many marbles does Ava have now?"):
  solved from the start quantity and the verb/number pairs in order, answered as `\\boxed{N}`.
- Calculator tool: a user message with an arithmetic expression and a `calculator` tool in the system
  prompt gets a tool call; the tool's response gets `The result is \\boxed{N}`.
- Anything else: free text from vocabulary words.

Answers are right with the probability the caller drew (`Script.correct`); a wrong answer is a nearby
number, never the right one. Parsing is tolerant: any text may sit between the sentences it looks for.
The policy turns the text into token ids; this module knows nothing of tokens.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

CALCULATOR = "calculator"
MAX_OPERAND = 10**12  # an expression past this is not a task, it is an attack on the evaluator

_START = re.compile(r"\b(?:has|had|have|owns|starts with)\s+(\d+)\b", re.IGNORECASE)
_STEP = re.compile(
    r"\b(?:buys?|finds?|receives?)\s+(?P<plus>\d+)\s+more\b"
    r"|\b(?:gives?\s+away|sells?|loses?)\s+(?P<minus>\d+)\b"
    r"|\bmultipl(?:ies|y)\s+(?:them|it|those|that)\s+by\s+(?P<times>\d+)\b",
    re.IGNORECASE,
)
_EXPRESSION = re.compile(r"[-(\d][\d\s()+\-*/]*[\d)]")
_HAS_OPERATOR = re.compile(r"[\d)]\s*[-+*/]\s*[-(\d]")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@dataclass
class PromptView:
    """The parts of a prompt the scripts look at."""

    latest_role: str
    latest: str
    """Body of the message right before the generation prompt."""
    thinking_closed: bool = False
    """The generation prompt already holds an empty think block (`enable_thinking=False`)."""
    system: str = ""
    """The system message (with the tool list when tools were rendered)."""
    last_user: str = ""
    """After a tool response: the user message that started the exchange."""

    @property
    def is_tool_response(self) -> bool:
        return self.latest_role == "user" and self.latest.lstrip().startswith("<tool_response>")

    def has_tool(self, name: str) -> bool:
        return re.search(r'"name":\s*' + re.escape(json.dumps(name)), self.system) is not None


@dataclass
class Script:
    """The random choices of one turn, drawn by the policy from the turn's seeded generator."""

    rng: random.Random
    words: Sequence[str]
    correct: bool
    think: bool


def scripted_turn(view: PromptView, script: Script) -> tuple[str, str]:
    """(behaviour name, assistant turn text without the close token)."""
    if view.is_tool_response:
        value = _tool_value(view.latest)
        if value is None:
            value = evaluate(find_expression(view.last_user) or "")
        if value is not None:
            return "tool_answer", _think(script, "The tool answered.") + _boxed(
                "The result is", value, script
            )
    elif view.latest_role == "user":
        expression = find_expression(view.latest) if view.has_tool(CALCULATOR) else None
        if expression is not None:
            call = {"name": CALCULATOR, "arguments": {"expression": expression}}
            thought = f"I should use the calculator tool to compute {expression}."
            return "tool_call", _think(script, thought) + f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        problem = WordProblem.parse(view.latest)
        if problem is not None:
            return "math", _think(script, problem.explain()) + _boxed(
                "The answer is", problem.solve(), script
            )
    return "free", _think(script, "Let me think.") + _sentences(script, 2, 5)


# ------------------------------------------------------------------------------------------ math


@dataclass(frozen=True)
class WordProblem:
    start: int
    steps: tuple[tuple[str, int], ...]
    """("plus" | "minus" | "times", number), in the order the problem states them."""

    @classmethod
    def parse(cls, text: str) -> WordProblem | None:
        start = _START.search(text)
        if start is None:
            return None
        steps = tuple(
            (kind, int(number))
            for match in _STEP.finditer(text, start.end())
            for kind, number in match.groupdict().items()
            if number is not None
        )
        return cls(int(start.group(1)), steps) if steps else None

    def solve(self) -> int:
        value = self.start
        for kind, number in self.steps:
            value = (
                value + number if kind == "plus" else value - number if kind == "minus" else value * number
            )
        return value

    def explain(self) -> str:
        value, parts = self.start, [f"Start with {self.start}."]
        for kind, number in self.steps:
            value = WordProblem(value, ((kind, number),)).solve()
            parts.append(f"After {kind} {number}: {value}.")
        return " ".join(parts)


# ------------------------------------------------------------------------------------ calculator


def find_expression(text: str) -> str | None:
    """The longest arithmetic expression (digits, + - * /, parentheses) in `text` that evaluates."""
    best: str | None = None
    for match in _EXPRESSION.finditer(text):
        candidate = _balance(match.group().strip())
        if _HAS_OPERATOR.search(candidate) and evaluate(candidate) is not None:
            if best is None or len(candidate) > len(best):
                best = candidate
    return best


def evaluate(expression: str) -> int | float | None:
    """Value of an arithmetic expression, or None when it is not one (no names, calls or powers)."""
    try:
        tree = ast.parse(expression, mode="eval")
        value = _eval(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if abs(node.value) > MAX_OPERAND:
            raise ValueError("operand too large")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")


def _balance(text: str) -> str:
    """Drop unmatched parentheses at the ends ("(3 + 4" -> "3 + 4")."""
    while text.startswith("(") and text.count("(") > text.count(")"):
        text = text[1:].lstrip()
    while text.endswith(")") and text.count(")") > text.count("("):
        text = text[:-1].rstrip()
    return text


def _tool_value(message: str) -> int | float | None:
    """The number in the last tool response; None for none or an error report ("error: ...")."""
    responses = _TOOL_RESPONSE.findall(message)
    if not responses or responses[-1].lower().startswith("error"):
        return None
    numbers = _NUMBER.findall(responses[-1])
    return evaluate(numbers[-1]) if numbers else None


# ------------------------------------------------------------------------------------------ text


def _boxed(lead: str, value: int | float, script: Script) -> str:
    if not script.correct:
        value = value + script.rng.choice((-3, -2, -1, 1, 2, 3, 10))
    shown = int(value) if isinstance(value, float) and value.is_integer() else value
    return f"{lead} \\boxed{{{shown}}}."


def _think(script: Script, lead: str) -> str:
    if not script.think:
        return ""
    return f"<think>\n{lead} {_sentences(script, 1, 3)}\n</think>\n\n"


def _sentences(script: Script, low: int, high: int) -> str:
    rng, words = script.rng, script.words
    sentences = []
    for _ in range(rng.randint(low, high)):
        chosen = [rng.choice(words) for _ in range(rng.randint(4, 12))]
        sentences.append(" ".join(chosen).capitalize() + ".")
    return " ".join(sentences)
