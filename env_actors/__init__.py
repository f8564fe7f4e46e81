"""Environments and the supervised env-server actors that run them.

- `interface`: the `Environment` base class (tasks, reset, step, score, close) and its wire models.
- `examples`: `math_env:MathEnv` (single turn) and `calculator_env:CalculatorEnv` (multi-turn, one tool).
- `server`: the `EnvServer` actor (one loaded environment, many sessions; probes on their own loop).
- `supervisor`, `budget`: readiness, liveness, replacement and scaling under a restart budget.
- `pool`: the `EnvPool` actor and `start_env_pool` / `get_env_pool` / `close_env_pool`.
- `session`: `EnvSession`, the client a rollout uses; failures raise `EnvCallFailed`.
- `faults`: environments that fail on purpose, for the fault table and the fault tests.
"""
