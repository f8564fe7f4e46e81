"""verifiers classic environments (`verifiers.legacy`, 0.3.x), written as a user would.

`load_environment(kind=...)`:
- `tools`: a ToolEnv with a `calculator` tool; reward: the boxed answer is right (weight 1.0), a boxed
  answer at all (weight 0.2), and a metric (weight 0): whether the calculator was used.
- `follow_up`: a MultiTurnEnv that tells a wrong answer so, with the problem again (a follow-up user
  turn), for up to two tries.
- `group`: a rubric with a group reward function (refused at load by the adapter).
- `raises`: a reward function that raises (a score failure, never a silent 0.0).
- `reasoning`: a reward that reads the model's reasoning (weight 0.5): whether it reasoned at all.
"""

import re

import verifiers.legacy as vf
from datasets import Dataset

from framework_envs import EXPRESSIONS, PROBLEMS, calculator

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


def text_of(message):
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def last_boxed(completion):
    answers = [m for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    found = BOXED.findall(text_of(answers[-1])) if answers else []
    return found[-1] if found else None


def correct(completion, answer) -> float:
    return 1.0 if last_boxed(completion) == str(answer) else 0.0


def boxed(completion) -> float:
    return 1.0 if last_boxed(completion) is not None else 0.0


def used_calculator(completion) -> float:
    return float(any((getattr(m, "tool_calls", None) or []) for m in completion))


class FollowUpMath(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        if last_boxed(messages) == str(state["answer"]):
            state["final_env_response"] = [{"role": "user", "content": "Correct."}]
            return []
        return [
            {
                "role": "user",
                "content": f"That is not right. {state['info']['question']} Answer in \\boxed{{}}.",
            }
        ]


def group_diversity(completions) -> list[float]:
    answers = [last_boxed(c) for c in completions]
    return [1.0 / answers.count(a) for a in answers]


def reasoned(completion) -> float:
    """Whether the model reasoned before answering: verifiers hands the reasoning over as `reasoning_content`."""
    for message in completion:
        get = message.get if isinstance(message, dict) else lambda key, m=message: getattr(m, key, None)
        if get("role") == "assistant" and get("reasoning_content"):
            return 1.0
    return 0.0


def explodes(completion) -> float:
    raise ZeroDivisionError("the grader divided by zero")


def load_environment(kind: str = "tools"):
    if kind == "tools":
        rows = [
            {
                "question": f"Compute {expr} using the calculator tool. Answer in \\boxed{{}}.",
                "answer": str(value),
            }
            for expr, value in EXPRESSIONS
        ]
        rubric = vf.Rubric(funcs=[correct, boxed, used_calculator], weights=[1.0, 0.2, 0.0])
        return vf.ToolEnv(
            dataset=Dataset.from_list(rows),
            tools=[calculator],
            system_prompt="Use the calculator tool for arithmetic.",
            rubric=rubric,
            max_turns=4,
        )
    rows = [
        {"question": q + " Answer in \\boxed{}.", "answer": str(a), "info": {"question": q}}
        for q, a in PROBLEMS
    ]
    if kind == "follow_up":
        rubric = vf.Rubric(funcs=[correct, boxed], weights=[1.0, 0.2])
        return FollowUpMath(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=2)
    funcs = {
        "group": [correct, group_diversity],
        "raises": [correct, explodes],
        "reasoning": [correct, reasoned],
    }[kind]
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=funcs, weights=[1.0, 0.5])
    )
