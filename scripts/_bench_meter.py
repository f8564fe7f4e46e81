"""Per-turn timing and bytes of plane rollouts, for `bench_trajectory.py`. Nothing here is in the product:
the bench installs it in every Ray worker process it starts (`worker_process_setup_hook`), and it wraps,
in those processes only, the few functions a turn goes through:

- `rollout_actors.rollout.turns.complete_tokens` (the model call): when each call starts and ends, the bytes of
  its HTTP request and answer (at httpx's `send`), and how many of the request's bytes are the prompt.
- `BatchedCalls.call` (renderer calls) and the env session's batched call: the bytes of each call's
  arguments and answer, serialised as Ray would (cloudpickle), and how long the turn waited on it.
- `rollout_actors.rollout.worker.run_rollout`: one record per rollout, appended as a JSON line to
  `$BENCH_METER_DIR/<pid>.jsonl` when it ends.

A call belongs to the turn whose model call started last in the same rollout (a context variable set by
the model-call wrapper; the env session's call tasks copy it when they are created).
"""

from __future__ import annotations

import contextvars
import gc
import json
import os
import time
from typing import Any

DIR_VAR = "BENCH_METER_DIR"
rollout_var: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "bench_rollout", default=None
)
turn_var: contextvars.ContextVar[int] = contextvars.ContextVar("bench_turn", default=0)


def bucket(record: dict[str, Any]) -> dict[str, int]:
    turn = str(turn_var.get())
    return record["bytes"].setdefault(
        turn, {"ray_out": 0, "ray_in": 0, "http_out": 0, "http_in": 0, "prompt": 0}
    )


def install() -> None:
    """Wrap the functions above in this process (idempotent)."""
    import orjson
    from ray import cloudpickle

    import env_actors.direct as direct
    import renderer_actors.batching as batching
    import rollout_actors.rollout.turns as turns
    import rollout_actors.rollout.worker as worker
    from rollout_actors.rollout.client import httpx

    if getattr(turns, "_bench_metered", False):
        return
    turns._bench_metered = True
    rollout_var: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
        "rollout", default=None
    )
    turn_var: contextvars.ContextVar[int] = contextvars.ContextVar("turn", default=0)

    def bucket(record: dict[str, Any]) -> dict[str, int]:
        empty = {"ray_out": 0, "ray_in": 0, "http_out": 0, "http_in": 0, "prompt": 0}
        return record["bytes"].setdefault(str(turn_var.get()), empty)

    complete_tokens = turns.complete_tokens

    async def metered_complete_tokens(
        client: Any, model: str, prompt_ids: list[int], *args: Any, **kwargs: Any
    ):
        record = rollout_var.get()
        if record is None:
            return await complete_tokens(client, model, prompt_ids, *args, **kwargs)
        turn_var.set(turn_var.get() + 1)
        bucket(record)["prompt"] += prompt_bytes(record, prompt_ids)
        started = time.monotonic()
        try:
            return await complete_tokens(client, model, prompt_ids, *args, **kwargs)
        finally:
            record["calls"].append([turn_var.get(), started, time.monotonic(), len(prompt_ids)])

    turns.complete_tokens = metered_complete_tokens

    def spent(record: dict[str, Any], what: str, seconds: float) -> None:
        """Seconds a turn waited on one of its remote calls (renderer parse / bridge, env step)."""
        phases = record["phases"].setdefault(str(turn_var.get()), {})
        phases[what] = phases.get(what, 0.0) + seconds

    def prompt_bytes(record: dict[str, Any], prompt_ids: list[int]) -> int:
        """The prompt's size in the request body (`[1,2,...]`), counted over what was added since the last
        call: counting the whole prompt again would cost the meter what the plane no longer spends."""
        seen, size = record.get("prompt_seen", (0, 2))
        if len(prompt_ids) < seen:  # a fork: a new prompt
            seen, size = 0, 2
        added = prompt_ids[seen:]
        if added:
            size += len(orjson.dumps(added)) - 2 + (1 if seen else 0)  # its brackets, a comma before it
        record["prompt_seen"] = (len(prompt_ids), size)
        return size

    http_send = httpx.AsyncClient.send

    async def metered_http_send(self: Any, request: Any, *args: Any, **kwargs: Any):
        response = await http_send(self, request, *args, **kwargs)
        record = rollout_var.get()
        if record is not None:
            sizes = bucket(record)
            sizes["http_out"] += len(request.content)
            sizes["http_in"] += len(response.content)
        return response

    httpx.AsyncClient.send = metered_http_send

    def wrap_batched(cls: Any, args_of: Any) -> None:
        call = cls.call

        async def metered(self: Any, *args: Any, **kwargs: Any):
            record = rollout_var.get()
            if record is not None:
                bucket(record)["ray_out"] += len(cloudpickle.dumps(args_of(args)))
            started = time.monotonic()
            answer = await call(self, *args, **kwargs)
            if record is not None:
                spent(record, args[2], time.monotonic() - started)
                bucket(record)["ray_in"] += len(cloudpickle.dumps(answer))
            return answer

        cls.call = metered

    wrap_batched(
        batching.BatchedCalls, lambda args: (args[2], args[3])
    )  # (renderer_id, handle, method, args, ..)
    env_call = direct._call

    async def metered_env_call(server: Any, call: Any):  # the env session's batched call
        record = rollout_var.get()
        if record is not None:
            bucket(record)["ray_out"] += len(cloudpickle.dumps(call))
        started = time.monotonic()
        answer = await env_call(server, call)
        if record is not None:
            spent(record, f"env {call.method}", time.monotonic() - started)
            bucket(record)["ray_in"] += len(cloudpickle.dumps(answer))
        return answer

    direct._call = metered_env_call

    run_rollout = worker.run_rollout
    out_dir = os.environ[DIR_VAR]

    async def metered_run_rollout(request: Any, *args: Any, **kwargs: Any):
        record: dict[str, Any] = {"request_id": request.request_id, "calls": [], "bytes": {}, "phases": {}}
        rollout_var.set(record)
        turn_var.set(0)
        try:
            result = await run_rollout(request, *args, **kwargs)
        finally:
            rollout_var.set(None)
        record["kind"] = result.kind
        record.pop("prompt_seen", None)
        record["finished"] = time.monotonic()
        record["gc"] = {"pid": os.getpid(), **collections}  # this process's full collections so far
        with open(os.path.join(out_dir, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    worker.run_rollout = metered_run_rollout

    collections = {"gen2": 0, "gen2_s": 0.0, "longest_s": 0.0, "started": 0.0}

    def time_full_collections(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            collections["started"] = time.perf_counter()
        else:
            spent = time.perf_counter() - collections["started"]
            collections["gen2"] += 1
            collections["gen2_s"] += spent
            collections["longest_s"] = max(collections["longest_s"], spent)

    gc.callbacks.append(time_full_collections)
