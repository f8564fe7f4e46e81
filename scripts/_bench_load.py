"""The steady rollout load of `bench_publish.py`: `inflight` plane rollouts kept in flight, a new one
submitted each time a result arrives, every result recorded with the times and policy versions the
benchmark reads."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

CALCULATOR = Ref(
    target="env_actors.examples.calculator_env:CalculatorEnv", config={"num_tasks": 300, "max_turns": 4}
)
MAX_TURNS = 4  # the env ends every episode after 2 model turns; this only guards against a runaway loop
MAX_TOKENS = 256  # the scripted policy writes < 150 tokens a turn; nothing is cut
RESULT_TIMEOUT_S = 120.0  # one result with `--inflight` in flight; far past any healthy rollout
RAMP_S = 2.0  # the first `--inflight` submissions are spread over this


@dataclass
class Finished:
    """One rollout's result, as much of it as the benchmark reads."""

    received: float
    """Driver monotonic time the result arrived."""
    submitted_wall: float
    """Driver wall time just before `submit`: the plane stamps the policy after this."""
    ok: bool
    error: str | None
    version_start: int | None
    version_end: int | None
    started_at: float
    """Worker wall time the rollout started (after the plane stamped its policy)."""
    finished_at: float


class SteadyLoad:
    """Keeps `inflight` rollouts in the plane: a new one each time a result arrives, until `stop()`."""

    def __init__(self, plane: RolloutPlane, urls: list[str], inflight: int):
        self.plane = plane
        self.urls = urls
        self.inflight = inflight
        self.finished: list[Finished] = []
        self._submitted: dict[str, float] = {}
        self._stopping = False
        self._count = 0

    def request(self) -> RolloutRequest:
        self._count += 1
        return RolloutRequest(
            env=CALCULATOR,
            task_index=self._count % 300,
            # The plane routes every rollout to the least loaded endpoint; this base_url is replaced.
            client=ClientConfig(base_url=self.urls[0], model=BUNDLED_MODEL),
            sampling=SamplingConfig(max_tokens=MAX_TOKENS),
            max_turns=MAX_TURNS,
        )

    async def _submit(self) -> None:
        request = self.request()
        self._submitted[request.request_id] = time.time()
        await self.plane.submit(request)

    async def run(self) -> None:
        # Staggered over one ramp: started together, equal rollouts finish in waves and stay in step,
        # and a rate over a 50 ms publication would measure where it fell in the wave.
        for _ in range(self.inflight):
            await self._submit()
            await asyncio.sleep(RAMP_S / self.inflight)
        while self._submitted:
            result = await self.plane.next_result(timeout=RESULT_TIMEOUT_S)
            received = time.monotonic()
            submitted_wall = self._submitted.pop(result.request_id)
            self.finished.append(
                Finished(
                    received=received,
                    submitted_wall=submitted_wall,
                    ok=result.ok,
                    error=None
                    if result.error is None
                    else f"{result.kind}: {result.error.type}: {result.error.message}",
                    version_start=result.policy_version_start,
                    version_end=result.policy_version_end,
                    started_at=result.started_at or math.nan,
                    finished_at=result.finished_at or math.nan,
                )
            )
            if not self._stopping:
                await self._submit()

    def stop(self) -> None:
        """No new submissions; `run` returns once every rollout in flight has answered."""
        self._stopping = True

    def count(self, start: float, end: float, failed: bool = False) -> int:
        return sum(start <= f.received < end and not (failed and f.ok) for f in self.finished)
