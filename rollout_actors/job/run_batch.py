"""`rollouts run`'s body: start what the configuration needs, run the groups, write and report the results.

    config = run_flags.resolve(args)      # checked before anything starts
    sys.exit(run(config))

Order of the cold start, each step named on the status line while it lasts: the stand-in (when no
endpoint is given) loads its tokenizer while Ray starts; the environment's pool starts and says how many
tasks it has (a run asking for more is refused before anything is submitted); then the groups go in.
Per-rollout failure log lines are counted, not printed: the run ends with the report's summary
(`rollouts report` on the same file prints the same numbers), failures by type with a count and one
example each. The exit status is 1 when more than `run.max_failed_fraction` of the rollouts failed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rollout_actors.inference.standin import StandinStartupError
from rollout_actors.job.local_ray import init_ray
from rollout_actors.job.run_config import RunConfig, StandinSettings
from rollout_actors.job.run_flags import FlagError
from rollout_actors.kernel.faults import Fault
from rollout_actors.rollout.failures import FAILED_ROLLOUT_RECORD
from rollout_actors.wire import Ref, Result, RolloutRequest

NUM_TASKS_TIMEOUT_S = 30.0  # one call to a ready pool, answered from what it learned at readiness
NOT_FAILED = ("ok", "cancelled")


def standin_server(settings: StandinSettings, seed: int, *, host: str = "127.0.0.1", port: int = 0) -> Any:
    """The bundled stand-in, not started, with the flags a production vLLM gets (parsers, LoRA, weight
    updates): what `rollouts run` starts without an endpoint and `rollouts serve-standin` serves."""
    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.server_actor import ServerSpec, standin_options
    from rollout_actors.inference.standin import StandinServer

    options = standin_options(
        ServerSpec(kind="standin", model=BUNDLED_MODEL),
        latency_s=settings.latency_s,
        per_token_latency_s=settings.per_token_latency_s,
        correct_rate=settings.correct_rate,
        seed=seed,
    )
    return StandinServer(options, host=host, port=port)


def failed_fraction(kinds: Counter[str]) -> float:
    """Failed rollouts over all of them; `cancelled` (asked for) is no failure."""
    total = sum(kinds.values())
    return sum(n for kind, n in kinds.items() if kind not in NOT_FAILED) / total if total else 0.0


class PoolDidNotStart(RuntimeError):
    """The environment's pool failed to start: the run ends before submitting, in one line, exit 1."""


class CountedFailures(logging.Filter):
    """Drops the plane's per-rollout failure lines (`log_failure`) from the console and counts them: the
    run's end reports them grouped, once per type."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if hasattr(record, FAILED_ROLLOUT_RECORD):
            self.dropped += 1
            return False
        return True


def run(config: RunConfig) -> int:
    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.job.progress import RunStatus

    job, servers = config.run, config.servers
    output = Path(job.output or f"rollouts-{time.strftime('%Y%m%d-%H%M%S')}.jsonl").resolve()
    for handler in logging.getLogger().handlers:
        handler.addFilter(CountedFailures())
    status = RunStatus(job.tasks * job.group_size, live=job.progress)
    with ExitStack() as stack:
        stack.enter_context(status)
        endpoints, model = list(servers.endpoints), servers.model
        server = None
        if not endpoints:
            # Launched now, waited for once Ray is up: its tokenizer loads while Ray starts (seconds each).
            server = standin_server(servers.standin, job.seed).start(wait=False)
            stack.callback(server.close)
            model = model or BUNDLED_MODEL
        assert model is not None  # run_flags.check: --model is required with --base-url
        status.stage("starting Ray")
        init_ray(job.ray_address)
        try:
            if server is not None:
                status.stage("starting the stand-in (tokenizer)")
                endpoints = [server.wait_ready().base_url]
                print(f"stand-in inference server at {server.base_url}", file=sys.stderr)
            return asyncio.run(_run_plane(config, endpoints, model, output, status))
        except (FlagError, PoolDidNotStart, StandinStartupError) as exc:
            stack.close()
            print(f"rollouts run: {exc}", file=sys.stderr)  # a stand-in's failure adds its log's tail
            return 2 if isinstance(exc, FlagError) else 1
        finally:
            import ray

            ray.shutdown()


async def _run_plane(config: RunConfig, endpoints: list[str], model: str, output: Path, status: Any) -> int:
    from rollout_actors.plane.facade import RolloutPlane

    job = config.run
    plane_config = config.plane
    if len(endpoints) > 1:
        plane_config = plane_config.model_copy(update={"endpoints": endpoints})
    env = Ref(job.env, job.env_config)
    template = RolloutRequest(
        env=env,
        client=config.client_config(endpoints[0], model),
        sampling=config.sampling,
        mode=job.mode,
        renderer=config.renderer,
        max_turns=job.max_turns,
        timeout_s=job.timeout_s,
        return_messages=job.messages,
    )
    results: list[Result] = []
    status.stage("starting the plane")
    async with RolloutPlane(plane_config) as plane:
        status.stage("starting the env pool")
        try:
            available = await plane.num_tasks(env, NUM_TASKS_TIMEOUT_S)
        except Fault as exc:  # what every rollout would have met: said once, here
            failure = exc.failure
            first = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
            raise PoolDidNotStart(
                f"--env {job.env}: its pool did not start ({exc.kind}): {failure.type}: {first}"
            ) from None
        if job.tasks > available:
            raise FlagError(
                f"--tasks {job.tasks}", f"{job.env} has {available} tasks (indices 0..{available - 1})"
            )

        async def feed() -> None:
            for index in range(job.tasks):
                seed = job.seed + index * job.group_size
                request = template.model_copy(
                    update={
                        "task_index": index,
                        "sampling": config.sampling.model_copy(update={"seed": seed}),
                    }
                )
                handle = await plane.submit_group(request, job.group_size)
                status.submitted()
                await handle.admitted()  # back-pressure: the next group waits while the lane is full

        status.stage("first turns (renderer: tokenizer)" if job.mode != "chat" else "first turns")
        feeder = asyncio.create_task(feed())
        failed: Counter[str] = Counter()
        with output.open("w") as sink:
            for _ in range(job.tasks):
                # The plane answers every request within its deadline plus grace; past that, fail loudly.
                group = await plane.next_group(timeout=job.timeout_s + plane_config.answer_grace_s + 60)
                for result in group.results:
                    results.append(result)
                    failed.update([result.kind] if result.kind != "ok" else [])
                    # Defaults left out: each line reads back whole with `Result.model_dump_json`.
                    sink.write(result.model_dump_json(exclude_defaults=True) + "\n")
                in_flight = sum(lane.in_flight for lane in plane.lanes.snapshot().values())
                status.update(len(results), in_flight, failed)
        await feeder
    status.__exit__(None, None, None)  # the bar is finished before the summary prints under it
    return _report(config, output, Counter(r.kind for r in results))


def _report(config: RunConfig, output: Path, kinds: Counter[str]) -> int:
    from rollout_actors.job.report import format_summary, read_results, summarize
    from rollout_actors.job.report_png import write_png

    lines = read_results(output)
    print(format_summary(summarize(lines)))  # one definition of wall time and rate: the report's
    print(f"results: {output}")
    if config.run.report_png:
        print(f"plots: {write_png(lines, config.run.report_png)}")
    share, allowed = failed_fraction(kinds), config.run.max_failed_fraction
    if share > allowed:
        print(
            f"rollouts run: {share:.1%} of the rollouts failed, more than --max-failed-fraction {allowed:g}",
            file=sys.stderr,
        )
        return 1
    return 0
