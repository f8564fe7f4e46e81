"""ray-rollouts: a Ray-native execution plane for LLM reinforcement-learning rollouts.

Kept import-light on purpose: `renderer_actors` and `env_actors` import `rollout_actors.wire` and
nothing else of this package (DESIGN.md, "Dependency direction").
"""
