"""A skyrl-gym environment with turn-level rewards and a follow-up user turn: two tries at a word
problem; a wrong first answer is told so and gets the problem again."""

import re

from skyrl_gym import register
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from framework_envs import PROBLEMS

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


class RetryMath(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()
        extras = extras or {}
        self.question = extras["extra_info"]["question"]
        self.answer = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = int((env_config or {}).get("max_turns", 2))
        self.answers = []

    def step(self, action):
        self.turns += 1
        found = BOXED.findall(action)
        self.answers.append(found[-1] if found else None)
        correct = bool(found) and found[-1] == self.answer
        reward = 1.0 if correct else (0.1 if found else 0.0)  # a boxed wrong answer earns its format
        done = correct or self.turns >= self.max_turns
        follow_up = f"That is not right. {self.question} Answer in \\boxed{{}}."
        observations = [] if done else [{"role": "user", "content": follow_up}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={})

    def get_metrics(self):
        return {"tries": self.turns, "answered": sum(a is not None for a in self.answers)}


register(id="retry-math", entry_point="framework_envs.sky_math:RetryMath")


def rows():
    return [
        {
            "prompt": [
                {"role": "system", "content": "Solve the problem. Put the final answer in \\boxed{}."},
                {"role": "user", "content": question},
            ],
            "env_class": "retry-math",
            "reward_spec": {"method": "rule", "ground_truth": answer},
            "extra_info": {"question": question},
        }
        for question, answer in PROBLEMS
    ]
