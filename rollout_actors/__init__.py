"""ray-rollouts: a Ray-native execution plane for LLM reinforcement-learning rollouts.

Folders by part: `plane/` (the public facade, the dispatcher, lanes, groups, the supervised workers and
pools), `rollout/` (what runs on a rollout worker, agent mode in `rollout/agent/`), `policy/` (publication
and weights), `inference/` (inference servers and the stand-in), `job/` (the CLI's run config and report),
`kernel/` (what every package may import). `wire` holds the request and result models.

Kept import-light on purpose: `renderer_actors` and `env_actors` import `rollout_actors.kernel` and
nothing else of this package (docs/design.md, "Dependency direction").
"""

from rollout_actors.kernel.renamed import MovedModules

# Modules that moved into the folders above still import from their old paths, with a warning.
MovedModules(
    __name__,
    {
        "config": "plane.config",
        "dispatcher": "plane.dispatcher",
        "inflight": "plane.inflight",
        "submission": "plane.submission",
        "redispatch": "plane.redispatch",
        "lanes": "plane.lanes",
        "concurrency": "plane.concurrency",
        "placement": "plane.placement",
        "plane_stats": "plane.stats",
        "shared_pools": "plane.shared_pools",
        "pool_supervisor": "plane.pool_supervisor",
        "worker_set": "plane.worker_set",
        "naming": "plane.naming",
        "groups": "plane.groups",
        "streams": "plane.streams",
        "sync": "plane.sync",
        "worker": "rollout.worker",
        "turns": "rollout.turns",
        "model_call": "rollout.model_call",
        "client": "rollout.client",
        "failures": "rollout.failures",
        "metrics": "rollout.metrics",
        "pool_lookup": "rollout.pool_lookup",
        "publish": "policy.publish",
        "lora": "policy.lora",
        "staleness": "policy.staleness",
        "inference.weights": "policy.weights",
        "run_config": "job.run_config",
        "report": "job.report",
        "report_png": "job.report_png",
        "timeline": "job.timeline",
        "loop_watch": "kernel.loop_watch",
    },
).install()
