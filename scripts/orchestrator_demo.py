"""A prime-rl style asynchronous RL loop against the plane: the worked example to start an orchestrator from.

    python scripts/orchestrator_demo.py [--steps 6] [--group-size 4] [--groups-per-step 4] [--in-flight 8]
                                        [--max-off-policy 1] [--eval-every 2] [--servers 1]

What it does, as an orchestrator for asynchronous GRPO-style training would:

- keeps `--in-flight` groups of `--group-size` rollouts in flight on the `train` lane (one task per group,
  every member on one policy version, a straggler rule so one slow member cannot hold a step back);
- consumes complete groups as they complete (`plane.groups(lane="train")`) into steps of
  `--groups-per-step` groups, and tops the in-flight groups back up after each one;
- drops groups that are too far off policy: more than `--max-off-policy` versions behind when consumed
  (the plane also cancels rollouts in flight that fall that far behind, `max_off_policy_steps`);
- computes group advantages (reward minus the group mean) over the trainer samples of each group
  (`Group.samples()`: token ids, loss mask, logprobs, policy versions per token);
- "trains" (a stand-in: a new random LoRA adapter) and publishes it as the next policy version, without
  waiting for the servers: rollouts keep going while it loads;
- every `--eval-every` steps runs an evaluation round on the `eval` lane, concurrently, on held-out tasks.

It prints one line per step, starting with `step`: mean reward of the kept groups, the off-policy lag
of their rollouts (versions behind when delivered), groups kept and dropped, rollouts/s and sampled
tokens/s over the step, results by kind (failures included: the stand-in is told to corrupt a few
responses, `--fault-rate`), and the latest eval score. Runs on CPU against the bundled stand-in server;
point the same loop at vLLM by giving the plane real endpoints (or an `InferenceServerSet`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin.launch import StandinServer
from rollout_actors.plane import RolloutPlane
from rollout_actors.plane.config import PlaneConfig
from rollout_actors.plane.groups import Group, GroupHandle, Stragglers
from rollout_actors.policy.lora import LoraAdapter, lora_config
from rollout_actors.policy.publish import PublishHandle
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

ENV = Ref("env_actors.examples.calculator_env:CalculatorEnv", {"num_tasks": 300})
TRAIN_TASKS = range(0, 250)
EVAL_TASKS = range(250, 300)
RESULT_TIMEOUT_S = 300.0  # a step that sees no group this long is a bug, not a slow step
PUBLISH_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, metavar="N", help="training steps")
    parser.add_argument("--group-size", type=int, default=4, metavar="N", help="rollouts per group")
    parser.add_argument(
        "--groups-per-step", type=int, default=4, metavar="N", help="groups each step trains on"
    )
    parser.add_argument("--in-flight", type=int, default=8, metavar="N", help="groups kept in flight")
    parser.add_argument(
        "--max-off-policy", type=int, default=1, metavar="N", help="versions behind before a group drops"
    )
    parser.add_argument(
        "--straggler-s", type=float, default=60.0, metavar="SECONDS", help="then cut members past min_ok"
    )
    parser.add_argument(
        "--train-s",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="the trainer's time per step (simulated)",
    )
    parser.add_argument("--eval-every", type=int, default=2, metavar="N", help="steps between evaluations")
    parser.add_argument("--eval-tasks", type=int, default=8, metavar="N", help="tasks per evaluation")
    parser.add_argument("--servers", type=int, default=1, metavar="N", help="stand-in inference servers")
    parser.add_argument(
        "--latency", type=float, default=0.2, metavar="SECONDS", help="stand-in seconds per model call"
    )
    parser.add_argument(
        "--fault-rate", type=float, default=0.01, metavar="P", help="model calls the stand-in corrupts"
    )
    return parser.parse_args(argv)


def request(base: ClientConfig, task_index: int, seed: int, lane: str = "train") -> RolloutRequest:
    return RolloutRequest(
        env=ENV,
        task_index=task_index,
        client=base,
        sampling=SamplingConfig(temperature=1.0 if lane == "train" else 0.0, max_tokens=192, seed=seed),
        max_turns=4,
        lane=lane,
        metadata={"task": task_index},
    )


def random_adapter(version: int) -> LoraAdapter:
    """The stand-in for a trainer's step: a fresh rank-8 adapter (what a real trainer would export)."""
    rng = np.random.default_rng(version)
    tensors = {
        f"base_model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.weight": rng.standard_normal(
            (8, 64), dtype=np.float32
        )
        * 0.01
        for layer in range(2)
        for proj in ("q_proj", "v_proj")
        for ab in ("A", "B")
    }
    for name in list(tensors):
        if name.endswith("lora_B.weight"):
            tensors[name] = tensors[name].T.copy()
    return LoraAdapter(tensors, lora_config(8, 16, ["q_proj", "v_proj"], BUNDLED_MODEL))


def group_advantages(group: Group) -> list[float]:
    """GRPO's advantage per ok member: its reward minus the group's mean reward."""
    rewards = group.rewards
    mean = statistics.fmean(rewards) if rewards else 0.0
    return [reward - mean for reward in rewards]


@dataclass
class StepStats:
    kinds: Counter[str] = field(default_factory=Counter)
    kept: list[Group] = field(default_factory=list)
    dropped: int = 0
    sampled_tokens: int = 0


class Orchestrator:
    def __init__(self, plane: RolloutPlane, client: ClientConfig, args: argparse.Namespace) -> None:
        self.plane = plane
        self.client = client
        self.args = args
        self.tasks = itertools.cycle(TRAIN_TASKS)
        self.seeds = itertools.count(0, args.group_size)
        self.in_flight: dict[str, GroupHandle] = {}
        self.version = 0
        self.publication: PublishHandle | None = None
        self.eval_score: str = "-"
        self.evals: set[asyncio.Task[None]] = set()
        self.started = time.perf_counter()
        self.rollouts = 0
        self.sampled_tokens = 0

    async def top_up(self) -> None:
        """Keep `--in-flight` groups submitted. Members queue for the lane in the background."""
        while len(self.in_flight) < self.args.in_flight:
            handle = await self.plane.submit_group(
                request(self.client, next(self.tasks), next(self.seeds)),
                self.args.group_size,
                stragglers=Stragglers(after_s=self.args.straggler_s, min_ok=self.args.group_size - 1),
                one_policy=True,
            )
            self.in_flight[handle.group_id] = handle

    def too_stale(self, group: Group) -> bool:
        lag = [r.versions_behind for r in group.results if r.versions_behind is not None]
        stale = any(r.error is not None and r.error.type == "Stale" for r in group.results)
        return stale or not group.ok or max(lag, default=0) > self.args.max_off_policy

    async def publish(self, step: int) -> None:
        """Hand the new policy to the servers; rollouts keep going while they load it. One publication at a
        time: the previous one must have landed (or failed loudly) first."""
        if self.publication is not None:
            await self.publication.wait(timeout=PUBLISH_TIMEOUT_S)
        self.version = step
        self.publication = await self.plane.publish_policy(random_adapter(step), version=step)

    def start_eval(self, step: int) -> None:
        async def evaluate() -> None:
            tasks = list(EVAL_TASKS)[: self.args.eval_tasks]
            handles = [
                await self.plane.submit_group(request(self.client, t, 10_000 + t, lane="eval"), 1)
                for t in tasks
            ]
            groups = [await handle.wait(timeout=RESULT_TIMEOUT_S) for handle in handles]
            rewards = [r for g in groups for r in g.rewards]
            score = statistics.fmean(rewards) if rewards else float("nan")
            versions = sorted({v for g in groups for v in g.policy_versions})
            self.eval_score = f"{score:.2f} (v{versions[0]}..v{versions[-1]})" if versions else "-"

        task = asyncio.get_running_loop().create_task(evaluate())
        self.evals.add(task)
        task.add_done_callback(self.evals.discard)

    async def run(self) -> None:
        args = self.args
        await self.top_up()
        stats = StepStats()
        step = 0
        async for group in self.plane.groups(lane="train"):
            self.in_flight.pop(group.group_id, None)
            stats.kinds.update(r.kind for r in group.results)
            if self.too_stale(group):
                stats.dropped += 1
            else:
                stats.kept.append(group)
            stats.sampled_tokens += sum(len(t.completion_ids) for r in group.results for t in r.turns)
            if len(stats.kept) >= args.groups_per_step:
                step += 1
                self.train_step(step, stats)
                await asyncio.sleep(args.train_s)  # the trainer's step; rollouts keep running meanwhile
                await self.publish(step)
                if step % args.eval_every == 0:
                    self.start_eval(step)
                if step == args.steps:
                    break
                stats = StepStats()
            await self.top_up()
        for handle in self.in_flight.values():
            await handle.cancel()
            await handle.wait(timeout=RESULT_TIMEOUT_S)
        await asyncio.gather(*self.evals)
        if self.publication is not None:
            await self.publication.wait(timeout=PUBLISH_TIMEOUT_S)

    def train_step(self, step: int, stats: StepStats) -> None:
        """What a trainer would consume: samples and advantages. Here they are only measured."""
        samples = [s for g in stats.kept for s in g.samples()]
        advantages = [a for g in stats.kept for a in group_advantages(g)]
        rewards = [r for g in stats.kept for r in g.rewards]
        lag = [r.versions_behind or 0 for g in stats.kept for r in g.ok]
        versions = sorted({v for g in stats.kept for v in g.policy_versions})
        self.rollouts += sum(stats.kinds.values())
        self.sampled_tokens += stats.sampled_tokens
        elapsed = time.perf_counter() - self.started  # rates since the start: steps arrive in bursts
        failures = " ".join(f"{k}={v}" for k, v in sorted(stats.kinds.items()) if k != "ok") or "none"
        print(
            f"step {step:>3}  sampled on v{versions[0]}..v{versions[-1]}  publishes v{step}  "
            f"reward {statistics.fmean(rewards):.3f}  adv |max| {max(map(abs, advantages), default=0):.2f}  "
            f"off-policy lag mean {statistics.fmean(lag):.2f} max {max(lag)}  "
            f"groups kept {len(stats.kept)} dropped {stats.dropped}  "
            f"rollouts/s {self.rollouts / elapsed:.1f}  tokens/s {self.sampled_tokens / elapsed:.0f}  "
            f"trained tokens {sum(sum(s.loss_mask) for s in samples)}  ok {stats.kinds['ok']}  "
            f"failures {failures}  eval {self.eval_score}",
            flush=True,
        )


async def main(args: argparse.Namespace, endpoints: list[str], storage: str) -> None:
    config = PlaneConfig(
        lanes={"train": args.in_flight * args.group_size, "eval": args.eval_tasks},
        endpoints=endpoints,
        policy_storage_dir=storage,
        max_off_policy_steps=args.max_off_policy,
    )
    headers = {"X-Standin-Latency": str(args.latency)}
    if args.fault_rate > 0:
        headers |= {"X-Standin-Fault": "malformed", "X-Standin-Fault-Rate": str(args.fault_rate)}
    client = ClientConfig(model=BUNDLED_MODEL, headers=headers)  # the plane gives each rollout an endpoint
    async with RolloutPlane(config) as plane:
        started = time.perf_counter()
        await Orchestrator(plane, client, args).run()
        stats = plane.stats()
        print(
            f"done: {args.steps} steps in {time.perf_counter() - started:.1f} s; "
            f"off policy {stats.off_policy.model_dump()}; results {stats.counters}"
        )


if __name__ == "__main__":
    arguments = parse_args()
    with ExitStack() as stack:
        # Started as `ServerSpec` launches vLLM (LoRA routes and limits, parsers): as strict as production.
        spec = ServerSpec(kind="standin", model=BUNDLED_MODEL)
        servers = [
            stack.enter_context(StandinServer(standin_options(spec, seed=i)))
            for i in range(arguments.servers)
        ]
        storage = stack.enter_context(tempfile.TemporaryDirectory(prefix="demo-adapters-"))
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:  # a private local Ray, never another cluster that happens to run on this machine
            cpus = max(4, 2 * (os.cpu_count() or 2))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        try:
            asyncio.run(main(arguments, [s.base_url for s in servers], storage))
        finally:
            ray.shutdown()
