"""Where a rollout's time goes: the phases of every turn and the waits around a rollout's turns.

Every `Turn` carries a `TurnTimings` (render or bridge, model call, parse, env step) and every `Result` a
`RolloutTimings` (what it waited for before its first turn, and its teardown). Durations are seconds on a
monotonic clock (`clock`), rounded to `PRECISION`; a phase that did not happen is 0 and is left out of the
JSON `rollouts run` writes (`exclude_defaults`). The report (`report.py`), the terminal phase table and the
Ray metrics (`metrics.py`) all read these two models and name phases as `TURN_PHASES` / `WAIT_PHASES` do.

Cost: a turn takes about eight `perf_counter` reads and one small model of four floats (~60 bytes of JSON),
measured in `scripts/bench_result.py` and `scripts/bench_plane.py`.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from rollout_actors.kernel import EXACT_JSON

PRECISION = 4  # 0.1 ms: finer than any phase worth tuning, and a float of at most ~7 JSON characters
clock = time.perf_counter
"""The clock every phase is measured on: monotonic, and a C call of ~50 ns."""


def since(start: float) -> float:
    """Seconds from `start` (a `clock()` reading) to now, rounded to `PRECISION`."""
    return round(clock() - start, PRECISION)


class TurnTimings(BaseModel):
    """The phases of one turn, in the order they ran. `render_s` is the render (first turn) or bridge (later
    turns) that produced this turn's `new_prompt_ids`; chat mode renders on the server, inside `model_s`.

    `queue_s` is the part of `model_s` the server itself says the call waited for its batch: vLLM reports
    it per response when started with `--enable-per-request-metrics` (`ServerSpec` does); 0 otherwise."""

    model_config = EXACT_JSON

    render_s: float = 0.0
    """Rendering (turn 0) or bridging (later turns) this turn's prompt on the renderer."""
    model_s: float = 0.0
    """The model call: every attempt and resumed part, and any pause of the servers waited out."""
    queue_s: float = 0.0
    """Of `model_s`, the server's own queue time (as it reports it; 0 where it does not)."""
    parse_s: float = 0.0
    """Parsing the completion into content, reasoning and tool calls (token mode, on the renderer)."""
    env_s: float = 0.0
    """The environment's step on this turn's answer (with its score when the step ended the episode)."""


class RolloutTimings(BaseModel):
    """The waits of one rollout before its first turn, and after its last. Plane-side waits (`lane_s` to
    `dispatch_s`) are stamped by the plane; the rest by the rollout on its worker."""

    model_config = EXACT_JSON

    submitted_at: float | None = None
    """Wall-clock time (`time.time()`) the plane accepted the request: where the run's timeline starts."""
    lane_s: float = 0.0
    """From submission to its dispatch starting: waiting for a slot in its lane (back-pressure: the lane was
    full), and for the driver's event loop to run it (a wave of thousands submitted at once)."""
    env_pool_s: float = 0.0
    """Waiting for its env pool to start (cold start: the environment's first servers load it)."""
    worker_s: float = 0.0
    """Waiting for a serving pool route and a live rollout worker (all dispatches)."""
    dispatch_s: float = 0.0
    """Ray's transit to the worker and back, beyond the worker's own time (all dispatches)."""
    env_open_s: float = 0.0
    """Placing the env session on an env server and resetting it (the task's first messages)."""
    renderer_s: float = 0.0
    """Waiting for a renderer slot (on a cold pool: the renderer loading its tokenizer)."""
    score_s: float = 0.0
    """Scoring, when the last step did not score (the turn budget ran out first)."""
    teardown_s: float = 0.0
    """Releasing the client, the env session and the renderer slot."""


TURN_PHASES = ("render_s", "model_s", "parse_s", "env_s")
SERVER_PHASES = ("queue_s",)
"""Turn phases inside another (`queue_s` is part of `model_s`): tabled and measured, never stacked."""
WAIT_PHASES = (
    "lane_s",
    "env_pool_s",
    "worker_s",
    "dispatch_s",
    "env_open_s",
    "renderer_s",
    "score_s",
    "teardown_s",
)
COLD_PHASES = ("env_pool_s", "renderer_s")
"""Waits that hold a pool's or a tokenizer's load on a cold start (and little once the pools serve)."""


def phase_name(field: str) -> str:
    """`model_s` -> `model`: how tables, plots and metric tags name a phase."""
    return field.removesuffix("_s")
