"""Small environments written for the adapter parity tests, one per framework, in each framework's own
API. They run in env servers whose pool ships this folder (`runtime_env.py_modules`) and whose
interpreter has the framework (`tests/framework_stacks.py`); no Hub, no network.

The tasks are the stand-in's scripted word problems ("Jade has 10 pencils. Jade sells 6. ..."), so the
stand-in answers them in `\\boxed{N}` and calls a `calculator` tool where one is offered.
"""

import re

PROBLEMS = [
    ("Jade has 10 pencils. Jade sells 6. How many pencils does Jade have now?", 4),
    ("Kofi has 7 apples. Kofi finds 7 more. How many apples does Kofi have now?", 14),
    ("Ava has 11 books. Ava gives away 7. Ava sells 3. How many books does Ava have now?", 1),
    ("Mia has 9 shells. Mia buys 4 more. Mia multiplies them by 2. How many shells does Mia have now?", 26),
]
"""(question, answer) pairs in the stand-in's scripted form."""

EXPRESSIONS = [("(17 * 23) + 45", 436), ("(9 + 6) * 4", 60), ("120 / 8 - 3", 12)]
"""(expression, value) pairs: the stand-in calls a `calculator` tool for them where one is offered."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "(3 + 4) * 5"
    """
    if not re.fullmatch(r"[\d\s()+\-*/.]+", expression):
        return "error: not arithmetic"
    value = eval(expression)  # the pattern above admits arithmetic only
    return str(int(value) if float(value).is_integer() else value)
