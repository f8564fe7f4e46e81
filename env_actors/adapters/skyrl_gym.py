"""A skyrl-gym text environment served unchanged.

    Ref("env_actors.adapters.skyrl_gym:SkyRLGymEnv",
        {"package": "my_envs.register", "tasks": "my_envs.data:rows", "env_config": {...}})

- `package`: the user's module that registers its environments (`skyrl_gym.register(id=..., entry_point=...)`)
  when imported; checked against the pool's `env_packages` first. Environments skyrl-gym registers itself
  (gsm8k, aime, ...) need none.
- `tasks`: `"module:attr"` of the dataset rows (a list, or a function returning one), in an allowed
  package; or none, and each request carries its row as `task`. A row is skyrl-gym's own:
  `{"prompt": [messages], "env_class": id, "reward_spec": {"ground_truth": ...}, "extra_info": {...}}`.
- `env_class`: the registered id, when the rows do not say (`row["env_class"]` wins otherwise).

An episode is `make(env_class, env_config=..., extras=row)`, `init(row["prompt"])`, one `step(raw text)`
per turn (the completion as the model wrote it: skyrl-gym environments parse tags themselves), `close()`.
Each step's reward is the turn's `StepOut.reward`; the episode's reward is their sum (the return a
trainer with turn-level rewards and no discount sees), its metrics `get_metrics()`. skyrl-gym is
synchronous: every call here is a plain method, which the env server runs off its event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from env_actors.adapters import PackageGate, import_framework
from env_actors.interface import RAW_TEXT_KEY, Environment, Message, Reset, ScoreOut, StepOut, check_index
from rollout_actors.kernel import CallerError, check_json


@dataclass
class _Episode:
    env: Any
    rewards: list[float] = field(default_factory=list)


class SkyRLGymEnv(Environment):
    def __init__(
        self,
        package: str | None = None,
        tasks: str | None = None,
        env_class: str | None = None,
        env_config: dict[str, Any] | None = None,
    ) -> None:
        self._package = package
        self._tasks_ref = tasks
        self._env_class = env_class
        self._env_config = dict(env_config or {})
        self._gate = PackageGate()
        self._rows: list[dict[str, Any]] = []
        self._gym: Any = None

    def allow_packages(self, prefixes: tuple[str, ...]) -> None:
        self._gate.allow(prefixes)

    def load(self) -> None:
        self._gym = import_framework("skyrl_gym", "skyrl-gym")
        if self._package is not None:
            self._gate.load(self._package)
        if self._tasks_ref is not None:
            module, _, attr = self._tasks_ref.partition(":")
            source = getattr(self._gate.load(module), attr, None)
            if source is None:
                raise CallerError(f"tasks {self._tasks_ref!r}: {module} has no attribute {attr!r}")
            rows = source() if callable(source) else source
            self._rows = [dict(row) for row in rows]
            check_json(self._rows, "tasks")

    def num_tasks(self) -> int:
        return len(self._rows)

    def task(self, index: int) -> dict[str, Any]:
        return self._rows[check_index(index, len(self._rows))]

    def reset(self, task: dict[str, Any]) -> Reset:
        env_class = task.get("env_class") or self._env_class
        if not env_class:
            raise CallerError("the task names no env_class and the adapter config gives none")
        prompt = task.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list):
            raise CallerError("a skyrl-gym task's prompt is a list of chat messages (or a string)")
        try:
            env = self._gym.make(env_class, env_config=self._env_config, extras=task)
        except self._gym.error.Error as exc:  # an unregistered id, named by the request
            raise CallerError(f"skyrl-gym cannot make {env_class!r}: {exc}") from exc
        messages, _info = env.init(prompt)
        return Reset(messages=list(messages), state=_Episode(env))

    def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        action = assistant_message.get(RAW_TEXT_KEY)
        if action is None:  # a caller driving the adapter directly, with a plain message
            action = assistant_message.get("content") or ""
        out = state.env.step(action)
        reward = float(out.get("reward") or 0.0)
        state.rewards.append(reward)
        return StepOut(messages=list(out.get("observations") or []), done=bool(out["done"]), reward=reward)

    def score(self, state: _Episode) -> ScoreOut:
        return ScoreOut(reward=sum(state.rewards), metrics=dict(state.env.get_metrics() or {}))

    def close(self, state: _Episode) -> None:
        state.env.close()
