"""Agent mode: an environment's agent program owns the model loop; the rollout serves it an endpoint.

- `endpoint.py`: the interception endpoint, one per worker process, a route and key per rollout.
- `history.py`: how an intercepted call's conversation continues the rollout's trajectory (or forks it).
- `calls.py`: one rollout's side of the calls: each is a token-mode turn, answered in OpenAI's shape.
- `episode.py`: the agent-mode episode the rollout loop runs (`rollout.py`): register, run, score, revoke.

The environment side (what an agent environment implements, subprocess agents) is `env_actors.agent`.
"""
