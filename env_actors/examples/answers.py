"""Reading a model's final answer: the text of a message and the last `\\boxed{...}` in it."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


def content_text(message: dict[str, Any]) -> str:
    """The text of a message's `content`: a string, a list of OpenAI content parts, or None."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def last_boxed(text: str) -> str | None:
    """The contents of the last complete `\\boxed{...}` in `text` (braces nest), or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def parse_number(text: str) -> Fraction | None:
    """A plain decimal number (`42`, `-3`, `1,024`, `2.50`, `$7$`) as an exact Fraction, else None.

    Exact on purpose: a reward compares answers, and `0.1 + 0.2` style rounding must not leak into it.
    """
    cleaned = text.strip().strip("$").strip().replace(",", "").replace(" ", "")
    if not _NUMBER.fullmatch(cleaned):
        return None
    return Fraction(cleaned)


def boxed_equals(text: str, expected: int | float) -> tuple[bool, bool]:
    """(correct, formatted): whether the last boxed answer equals `expected`, and whether one exists."""
    boxed = last_boxed(text)
    if boxed is None:
        return False, False
    value = parse_number(boxed)
    return value is not None and value == Fraction(expected), True
